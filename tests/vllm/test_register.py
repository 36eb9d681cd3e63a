"""register() against stand-in vLLM registries (vLLM itself is not installed in this venv)."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator

import pytest

import sidecar_client.vllm as plugin


class Registry:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def register(self, mode: str, module: str, class_name: str) -> None:
        self.calls.append((mode, module, class_name))


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[types.ModuleType, Registry, Registry]]:
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.32.0"  # type: ignore[attr-defined]
    tok_mod = types.ModuleType("vllm.tokenizers.registry")
    ren_mod = types.ModuleType("vllm.renderers.registry")
    tokenizers, renderers = Registry(), Registry()
    tok_mod.TokenizerRegistry = tokenizers  # type: ignore[attr-defined]
    ren_mod.RENDERER_REGISTRY = renderers  # type: ignore[attr-defined]
    for name, mod in {"vllm": vllm, "vllm.tokenizers": types.ModuleType("vllm.tokenizers"),
                      "vllm.tokenizers.registry": tok_mod, "vllm.renderers": types.ModuleType("vllm.renderers"),
                      "vllm.renderers.registry": ren_mod}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.delenv("TOKCACHE_DISABLE", raising=False)
    yield vllm, tokenizers, renderers


def test_registers_tokenizer_mode_and_renderer_once(fake_vllm: tuple[types.ModuleType, Registry, Registry]) -> None:
    _, tokenizers, renderers = fake_vllm
    plugin.register()
    plugin.register()  # vLLM calls it several times per process
    assert tokenizers.calls == [("tokcache", "vllm.tokenizers.hf", "CachedHfTokenizer")]
    assert renderers.calls == [("tokcache", "sidecar_client.vllm._renderer", "TokcacheRenderer")]


def test_unsupported_version_keeps_the_mode_with_vllms_renderer(fake_vllm: tuple[types.ModuleType, Registry, Registry],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    vllm, tokenizers, renderers = fake_vllm
    vllm.__version__ = "0.35.1"  # type: ignore[attr-defined]
    plugin.register()
    assert tokenizers.calls == [("tokcache", "vllm.tokenizers.hf", "CachedHfTokenizer")]
    assert renderers.calls == [("tokcache", "vllm.renderers.hf", "HfRenderer")]
    assert "vLLM 0.35.1 is outside the supported range >=0.32,<0.34" in caplog.text


def test_disabled_uses_vllms_renderer(fake_vllm: tuple[types.ModuleType, Registry, Registry],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, renderers = fake_vllm
    monkeypatch.setenv("TOKCACHE_DISABLE", "1")
    plugin.register()
    assert renderers.calls == [("tokcache", "vllm.renderers.hf", "HfRenderer")]


def test_register_never_raises(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm fails
    plugin.register()
    assert "registering the vLLM plugin failed" in caplog.text


def test_importing_the_plugin_does_not_import_vllm() -> None:
    code = "import sys, sidecar_client.vllm; assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
