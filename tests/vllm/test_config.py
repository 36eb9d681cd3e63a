"""TOKCACHE_* parsing for the vLLM plugin."""

from __future__ import annotations

import pytest

from sidecar_client.vllm._config import (
    DEFAULT_ADDRESS,
    ENV,
    PluginConfig,
    PluginConfigError,
)


def test_defaults_from_an_empty_environment() -> None:
    c = PluginConfig.from_env({})
    assert c == PluginConfig()
    assert c.address == DEFAULT_ADDRESS and c.model is None and c.timeout_s == 0.2
    assert c.breaker_failures == 5 and c.breaker_reset_s == 5.0 and not c.disabled
    assert c.record_timeout_s == 2.0


def test_every_variable() -> None:
    c = PluginConfig.from_env({
        "TOKCACHE_ADDRESS": "unix:///run/x.sock", "TOKCACHE_MODEL": "qwen3", "TOKCACHE_TIMEOUT_MS": "50",
        "TOKCACHE_BREAKER_FAILURES": "2", "TOKCACHE_BREAKER_RESET_S": "0.5", "TOKCACHE_DISABLE": "yes",
        "TOKCACHE_RECORD_WAIT_MS": "0", "TOKCACHE_ZERO_RPC": "0", "TOKCACHE_OBSERVE_ONLY": "1",
    })
    assert c == PluginConfig("unix:///run/x.sock", "qwen3", 0.05, 2, 0.5, True, record_wait_s=0.0, zero_rpc=False,
                             observe_only=True)
    assert c.record_timeout_s == 1.0  # at least a second: off the request path


def test_the_names_are_declared_once() -> None:
    assert set(ENV.values()) == {"TOKCACHE_ADDRESS", "TOKCACHE_MODEL", "TOKCACHE_TIMEOUT_MS",
                                 "TOKCACHE_BREAKER_FAILURES", "TOKCACHE_BREAKER_RESET_S",
                                 "TOKCACHE_RECORD_WAIT_MS", "TOKCACHE_ZERO_RPC", "TOKCACHE_OBSERVE_ONLY",
                                 "TOKCACHE_DISABLE"}


def test_blank_values_keep_defaults() -> None:
    assert PluginConfig.from_env({"TOKCACHE_MODEL": " ", "TOKCACHE_TIMEOUT_MS": ""}) == PluginConfig()


@pytest.mark.parametrize("value,disabled", [("1", True), ("TRUE", True), ("on", True), ("0", False),
                                            ("false", False), ("", False), ("off", False)])
def test_disable_flag(value: str, disabled: bool) -> None:
    assert PluginConfig.from_env({"TOKCACHE_DISABLE": value}).disabled is disabled


@pytest.mark.parametrize("variable,value", [
    ("TOKCACHE_TIMEOUT_MS", "fast"), ("TOKCACHE_TIMEOUT_MS", "0"), ("TOKCACHE_TIMEOUT_MS", "-5"),
    ("TOKCACHE_TIMEOUT_MS", "nan"), ("TOKCACHE_BREAKER_FAILURES", "0"), ("TOKCACHE_BREAKER_FAILURES", "2.5"),
    ("TOKCACHE_BREAKER_RESET_S", "0"), ("TOKCACHE_DISABLE", "maybe"), ("TOKCACHE_RECORD_WAIT_MS", "-1"),
    ("TOKCACHE_ZERO_RPC", "sometimes"),
])
def test_bad_values_name_the_variable(variable: str, value: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        PluginConfig.from_env({variable: value})
    assert err.value.variable == variable and variable in str(err.value)

