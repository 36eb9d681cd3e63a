"""register() against stand-in vLLM registries (vLLM itself is not installed in this venv)."""

from __future__ import annotations

import importlib.machinery
import os
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
    hf_mod = types.ModuleType("vllm.renderers.hf")
    hf_mod.__spec__ = importlib.machinery.ModuleSpec("vllm.renderers.hf", None)
    tokenizers, renderers = Registry(), Registry()
    tok_mod.TokenizerRegistry = tokenizers  # type: ignore[attr-defined]
    ren_mod.RENDERER_REGISTRY = renderers  # type: ignore[attr-defined]
    for name, mod in {"vllm": vllm, "vllm.tokenizers": types.ModuleType("vllm.tokenizers"),
                      "vllm.tokenizers.registry": tok_mod, "vllm.renderers": types.ModuleType("vllm.renderers"),
                      "vllm.renderers.registry": ren_mod, "vllm.renderers.hf": hf_mod}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(plugin, "_registered", False)
    for name in ("TOKCACHE_DISABLE", "VLLM_USE_RUST_FRONTEND", "_TOKCACHE_BYPASS_NOTED"):
        monkeypatch.delenv(name, raising=False)
    yield vllm, tokenizers, renderers


def test_registers_tokenizer_mode_and_renderer_once(fake_vllm: tuple[types.ModuleType, Registry, Registry]) -> None:
    _, tokenizers, renderers = fake_vllm
    plugin.register()
    plugin.register()  # vLLM calls it several times per process
    assert tokenizers.calls == [("tokcache", "vllm.tokenizers.hf", "CachedHfTokenizer")]
    assert renderers.calls == [("tokcache", "sidecar_client.vllm._renderer", "TokcacheRenderer")]


def test_an_unverified_version_registers_the_renderer(fake_vllm: tuple[types.ModuleType, Registry, Registry],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    # The version alone decides nothing: the renderer checks the hook points when vLLM builds it.
    vllm, _, renderers = fake_vllm
    vllm.__version__ = "0.35.1"  # type: ignore[attr-defined]
    plugin.register()
    assert renderers.calls == [("tokcache", "sidecar_client.vllm._renderer", "TokcacheRenderer")]
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


def test_without_vllms_hf_renderer_the_mode_uses_vllms_own(fake_vllm: tuple[types.ModuleType, Registry, Registry],
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    _, tokenizers, renderers = fake_vllm
    monkeypatch.delitem(sys.modules, "vllm.renderers.hf")
    renderers.renderers = {"hf": ("vllm.renderers.hf2", "HfRenderer2")}  # type: ignore[attr-defined]
    plugin.register()
    assert renderers.calls == [("tokcache", "vllm.renderers.hf2", "HfRenderer2")]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "hook vllm.renderers.hf.HfRenderer is missing" in errors[0]


def test_a_registry_without_register_is_one_error_line(fake_vllm: tuple[types.ModuleType, Registry, Registry],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    _, tokenizers, renderers = fake_vllm
    sys.modules["vllm.renderers.registry"].RENDERER_REGISTRY = object()  # type: ignore[attr-defined]
    plugin.register()
    assert tokenizers.calls == []
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "hook RENDERER_REGISTRY.register is missing" in errors[0]


def test_rust_frontend_is_one_line_per_serve(fake_vllm: tuple[types.ModuleType, Registry, Registry],
                                             monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    plugin.register()
    lines = [r.getMessage() for r in caplog.records if "Rust frontend" in r.getMessage()]
    assert len(lines) == 1 and "tokcache is bypassed" in lines[0] and lines[0].startswith("tokcache: ")
    # A process vLLM starts after loading plugins inherits the environment: it stays quiet.
    assert os.environ.get("_TOKCACHE_BYPASS_NOTED") == "1"
    monkeypatch.setattr(plugin, "_registered", False)
    plugin.register()
    assert len([r for r in caplog.records if "Rust frontend" in r.getMessage()]) == 1


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


def test_a_broken_install_costs_the_cache_not_vllms_start(
        fake_vllm: tuple[types.ModuleType, Registry, Registry], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An extension that does not import (a failed or stale build): the mode still registers,
    with vLLM's own renderer, and one error line names the extension."""
    from tokcache import native

    def broken() -> None:
        raise native.ExtensionError("tokcache: the C extension tokcache.engine._speedups cannot be imported (gone)")

    monkeypatch.setattr(native, "engine", broken)
    _, tokenizers, renderers = fake_vllm
    with caplog.at_level("ERROR", logger="vllm.tokcache"):
        plugin.register()
    assert renderers.calls == [("tokcache", "vllm.renderers.hf", "HfRenderer")]
    assert tokenizers.calls == [("tokcache", "vllm.tokenizers.hf", "CachedHfTokenizer")]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "tokcache.engine._speedups" in errors[0]
