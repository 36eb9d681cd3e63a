"""The hook check against stand-in vLLM modules (vLLM is not installed in this venv).

The same checks run against vLLM's real classes, per version, in e2e/versions/.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from sidecar_client.vllm._hooks import (
    VERIFIED_VLLM,
    HookReport,
    check_hooks,
    check_registries,
    check_vllm_version,
    rust_frontend,
)


class BaseRenderer:
    def __init__(self) -> None:
        self._tokenize_prompt_async = self._tokenize_prompt  # bound per instance, as vLLM does

    async def render_chat_async(self, conversations: Any, chat_params: Any, tok_params: Any = None, *,
                                prompt_extras: Any = None, skip_mm_cache: bool = False) -> Any: ...

    async def render_cmpl_async(self, prompts: Any, tok_params: Any = None, *, prompt_extras: Any = None) -> Any: ...

    def _tokenize_prompt(self, prompt: Any, params: Any) -> Any: ...

    @staticmethod
    def _build_tokens_prompt(token_ids: Any, prompt: Any, *, offset_mapping: Any = None) -> Any: ...

    def _wants_offsets(self, prompt: Any, params: Any) -> bool:
        return False


class HfRenderer(BaseRenderer):
    pass


class TokenizeParams:
    def get_encode_kwargs(self) -> dict[str, Any]:
        return {}


class AsyncLLM:
    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *, trace_headers: Any = None,
                       session_id: Any = None) -> AsyncIterator[Any]:
        yield None


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    modules = {
        "vllm": {"__version__": "0.34.0"},
        "vllm.renderers": {}, "vllm.renderers.hf": {"HfRenderer": HfRenderer},
        "vllm.renderers.params": {"TokenizeParams": TokenizeParams},
        "vllm.v1": {}, "vllm.v1.engine": {}, "vllm.v1.engine.async_llm": {"AsyncLLM": AsyncLLM},
        "vllm.sampling_params": {"RequestOutputKind": RequestOutputKind},
        "vllm.outputs": {"CompletionOutput": CompletionOutput},
    }
    for name, attrs in modules.items():
        mod = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(mod, key, value)
        monkeypatch.setitem(sys.modules, name, mod)
    yield


def test_hooks_as_the_plugin_uses_them_check_out(fake_vllm: None) -> None:
    report = check_hooks(HfRenderer())
    assert report == HookReport(version="0.34.0", verified=True)
    assert report.ok and report.state == "verified" and report.line() == "vLLM 0.34.0 is verified " \
        f"(verified: {', '.join(VERIFIED_VLLM)})"


def test_an_unverified_version_with_good_hooks_runs(fake_vllm: None) -> None:
    report = check_hooks(HfRenderer(), version="0.35.0")
    assert report.ok and report.state == "unverified"
    assert report.line().endswith("its hook points check out")


@pytest.mark.parametrize("owner,name,hook", [
    (BaseRenderer, "_build_tokens_prompt", "BaseRenderer._build_tokens_prompt is missing"),
    (BaseRenderer, "_wants_offsets", "BaseRenderer._wants_offsets is missing"),
    (BaseRenderer, "render_chat_async", "HfRenderer.render_chat_async is missing"),
    (TokenizeParams, "get_encode_kwargs", "TokenizeParams.get_encode_kwargs is missing"),
    (AsyncLLM, "generate", "AsyncLLM.generate is missing"),
])
def test_a_removed_hook_is_named(fake_vllm: None, monkeypatch: pytest.MonkeyPatch, owner: type, name: str,
                                 hook: str) -> None:
    monkeypatch.delattr(owner, name)
    report = check_hooks(HfRenderer())
    assert not report.ok and report.state == "hook_missing"
    assert report.missing == (hook,) and f"hook {hook}" in report.line()


def test_a_changed_signature_is_named(fake_vllm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    async def render_cmpl_async(self: Any, prompts: Any) -> Any: ...  # prompt_extras gone

    async def generate(self: Any, prompt: Any, sampling_params: Any, request_id: str) -> AsyncIterator[Any]:
        yield None  # trace_headers gone

    monkeypatch.setattr(BaseRenderer, "render_cmpl_async", render_cmpl_async)
    monkeypatch.setattr(AsyncLLM, "generate", generate)
    report = check_hooks(HfRenderer())
    assert [m.split(" (")[0] for m in report.missing] == [
        "HfRenderer.render_cmpl_async has another signature", "AsyncLLM.generate has another signature"]


def test_an_unbound_tokenize_prompt_async_is_named(fake_vllm: None) -> None:
    renderer = HfRenderer()
    del renderer._tokenize_prompt_async
    report = check_hooks(renderer)
    assert report.missing and report.missing[0].startswith("BaseRenderer._tokenize_prompt_async is not bound")
    assert check_hooks(None).ok  # without a renderer that check is the renderer's


def test_a_module_that_fails_to_import_is_named(fake_vllm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm.outputs", None)
    report = check_hooks(HfRenderer())
    assert len(report.missing) == 1
    assert report.missing[0].startswith("CompletionOutput cannot be imported (ModuleNotFoundError: ")


def test_registries() -> None:
    class Registry:
        def register(self, mode: str, module: str, class_name: str) -> None: ...

    assert check_registries(Registry(), Registry()) is None
    assert check_registries(Registry(), object()) == "RENDERER_REGISTRY.register is missing"


@pytest.mark.parametrize("version,ok", [
    ("0.32.0", True), ("0.32.1.dev12+g1234", True), ("0.33.0+cu128", True), ("0.34.0", True),
    ("0.31.2", False), ("0.35.0", False), ("1.0.0", False), ("dev", False), ("v0.33.1", True),
    ("0.34", True), ("0.34.0+cpu", True), ("0.3.4", False), ("", False),
])
def test_verified_versions(version: str, ok: bool) -> None:
    verified, line = check_vllm_version(version)
    assert verified is ok and version in line and "verified: 0.32, 0.33, 0.34" in line


@pytest.mark.parametrize("value,on", [("1", True), ("0", False), ("", False), ("2", True), ("yes", False)])
def test_rust_frontend_flag(value: str, on: bool) -> None:
    assert rust_frontend({"VLLM_USE_RUST_FRONTEND": value}) is on
    assert rust_frontend({}) is False
