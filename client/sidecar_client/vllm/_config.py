"""Plugin configuration from ``TOKCACHE_*`` variables.

Every variable is declared once, in :data:`ENV`. A bad value is reported by
:class:`PluginConfigError` naming the variable; inside vLLM the caller logs it
and disables the sidecar path (it never raises into the host).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_ADDRESS",
    "ENV",
    "PluginConfig",
    "PluginConfigError",
]

DEFAULT_ADDRESS = "unix:///run/tokcache/tokcache.sock"
DEFAULT_TIMEOUT_MS = 200.0
DEFAULT_BREAKER_FAILURES = 5
DEFAULT_BREAKER_RESET_S = 5.0
DEFAULT_RECORD_WAIT_MS = 1000.0

# field -> environment variable (the only place these names appear)
ENV: dict[str, str] = {
    "address": "TOKCACHE_ADDRESS",
    "model": "TOKCACHE_MODEL",
    "timeout_ms": "TOKCACHE_TIMEOUT_MS",
    "breaker_failures": "TOKCACHE_BREAKER_FAILURES",
    "breaker_reset_s": "TOKCACHE_BREAKER_RESET_S",
    "record_wait_ms": "TOKCACHE_RECORD_WAIT_MS",
    "zero_rpc": "TOKCACHE_ZERO_RPC",
    "observe_only": "TOKCACHE_OBSERVE_ONLY",
    "disable": "TOKCACHE_DISABLE",
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class PluginConfigError(ValueError):
    """A ``TOKCACHE_*`` variable has a value the plugin cannot use; ``variable`` names it."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable


@dataclass(frozen=True)
class PluginConfig:
    """How the vLLM plugin talks to the sidecar.

    ``timeout_s`` is the deadline of each Tokenize (the request waits at most
    this long before vLLM's own tokenizer takes over); recording is not on the
    request path and gets :attr:`record_timeout_s`. ``record_wait_s`` bounds how long
    a finishing response waits for its record to reach the sidecar (0: never waits;
    the next turn may then miss the record in another API server process).
    ``zero_rpc``: tokenize in vLLM's process from the sidecar's shared memory when its
    segment can be mapped here (default; ``TOKCACHE_ZERO_RPC=0`` sends every prompt over RPC).
    ``observe_only``: never use the sidecar; vLLM tokenizes every prompt and the plugin only
    times it (``tokcache_vllm_tokenize_seconds{path="vllm"}``): a baseline measured the
    same way, e.g. with and without ``VLLM_USE_FASTOKENS=1``.
    """

    address: str = DEFAULT_ADDRESS
    model: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_MS / 1000.0
    breaker_failures: int = DEFAULT_BREAKER_FAILURES
    breaker_reset_s: float = DEFAULT_BREAKER_RESET_S
    disabled: bool = False
    record_wait_s: float = DEFAULT_RECORD_WAIT_MS / 1000.0
    zero_rpc: bool = True
    observe_only: bool = False

    def __post_init__(self) -> None:
        if not self.address:
            raise PluginConfigError(ENV["address"], "must not be empty")
        if self.model is not None and not self.model:
            raise PluginConfigError(ENV["model"], "must not be empty when set")
        if not self.timeout_s > 0:
            raise PluginConfigError(ENV["timeout_ms"], f"must be > 0, got {self.timeout_s * 1000:g} ms")
        if self.breaker_failures < 1:
            raise PluginConfigError(ENV["breaker_failures"], f"must be >= 1, got {self.breaker_failures}")
        if not self.breaker_reset_s > 0:
            raise PluginConfigError(ENV["breaker_reset_s"], f"must be > 0, got {self.breaker_reset_s:g}")
        if not self.record_wait_s >= 0:
            raise PluginConfigError(ENV["record_wait_ms"], f"must be >= 0, got {self.record_wait_s * 1000:g} ms")

    @property
    def record_timeout_s(self) -> float:
        """Deadline of one RecordOutputs batch: off the request path, so looser."""
        return max(1.0, 10 * self.timeout_s)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginConfig:
        """Read ``TOKCACHE_*``; unset or empty variables keep their defaults."""
        env = os.environ if environ is None else environ

        def get(field: str) -> str | None:
            value = env.get(ENV[field])
            return value.strip() if value is not None and value.strip() else None

        address = get("address") or DEFAULT_ADDRESS
        return cls(
            address=address,
            model=get("model"),
            timeout_s=_float(ENV["timeout_ms"], get("timeout_ms"), DEFAULT_TIMEOUT_MS) / 1000.0,
            breaker_failures=_int(ENV["breaker_failures"], get("breaker_failures"), DEFAULT_BREAKER_FAILURES),
            breaker_reset_s=_float(ENV["breaker_reset_s"], get("breaker_reset_s"), DEFAULT_BREAKER_RESET_S),
            disabled=_flag(ENV["disable"], env.get(ENV["disable"], "")),
            record_wait_s=_float(ENV["record_wait_ms"], get("record_wait_ms"), DEFAULT_RECORD_WAIT_MS) / 1000.0,
            zero_rpc=_flag(ENV["zero_rpc"], env.get(ENV["zero_rpc"], "1")),
            observe_only=_flag(ENV["observe_only"], env.get(ENV["observe_only"], "")),
        )


def _float(variable: str, raw: str | None, default: float) -> float:
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise PluginConfigError(variable, f"expected a number, got {raw!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise PluginConfigError(variable, f"expected a finite number, got {raw!r}")
    return value


def _int(variable: str, raw: str | None, default: int) -> int:
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise PluginConfigError(variable, f"expected an integer, got {raw!r}") from None


def _flag(variable: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise PluginConfigError(variable, f"expected one of 1/0, true/false, yes/no, on/off; got {raw!r}")
