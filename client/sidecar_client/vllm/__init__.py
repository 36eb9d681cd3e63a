"""tokcache plugin for vLLM: ``vllm serve MODEL --tokenizer-mode tokcache``.

Registered through the ``vllm.general_plugins`` entry point (``register``),
which vLLM calls in every process it starts (API server, engine core,
workers). It registers the name ``tokcache`` twice:

- as a tokenizer mode that keeps vLLM's own HF tokenizer class
  (``vllm.tokenizers.hf.CachedHfTokenizer``), which the engine core uses for
  detokenization and structured output, and
- as a renderer (``sidecar_client.vllm._renderer.TokcacheRenderer``, a
  subclass of vLLM's ``HfRenderer``, imported only where vLLM builds a
  renderer) that sends rendered prompt text to the sidecar's ``Tokenize``
  and records finished generations with ``RecordOutputs``.

Whether it runs is decided by checking the hook points it uses (``_hooks``):
``register()`` checks the two registries; the renderer, built in each
frontend process, checks the rest and logs one start line (info on a
verified vLLM, a warning on an unverified one whose hooks check out, an
error naming a missing hook, after which vLLM tokenizes, counted). With
``VLLM_USE_RUST_FRONTEND=1`` vLLM's Rust frontend tokenizes: one line says
tokcache is bypassed.

Configuration (environment, read once per process by the renderer):
``TOKCACHE_ADDRESS``, ``TOKCACHE_MODEL``, ``TOKCACHE_TIMEOUT_MS``,
``TOKCACHE_BREAKER_FAILURES``, ``TOKCACHE_BREAKER_RESET_S``,
``TOKCACHE_RECORD_WAIT_MS``, ``TOKCACHE_ZERO_RPC``, ``TOKCACHE_OBSERVE_ONLY``,
``TOKCACHE_DISABLE`` (``_config.ENV``). See ``docs/configuration.md``.

Everything fails open: a slow, dead or mismatched sidecar means vLLM
tokenizes in-process, as without the plugin.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from sidecar_client.vllm._config import PluginConfig, PluginConfigError
from sidecar_client.vllm._hooks import (
    BYPASS_NOTED_ENV,
    RUST_FRONTEND_ENV,
    VERIFIED_VLLM,
    check_registries,
    check_vllm_version,
    export_state,
    rust_frontend,
)
from sidecar_client.vllm._trace import TraceContextMiddleware

__all__ = [
    "MODE",
    "VERIFIED_VLLM",
    "PluginConfig",
    "PluginConfigError",
    "TraceContextMiddleware",
    "check_vllm_version",
    "register",
]

log = logging.getLogger("vllm.tokcache")

MODE = "tokcache"
RENDERER = ("sidecar_client.vllm._renderer", "TokcacheRenderer")
HF_TOKENIZER = ("vllm.tokenizers.hf", "CachedHfTokenizer")
HF_RENDERER = ("vllm.renderers.hf", "HfRenderer")

_registered = False


def register() -> None:
    """Entry point of ``vllm.general_plugins``: register mode and renderer ``tokcache``.

    Cheap and idempotent (vLLM may call it more than once per process; only
    the first call acts). Imports only vLLM's two registries, which vLLM has
    loaded already. Never raises: an error is logged, and then
    ``--tokenizer-mode tokcache`` fails at startup as an unknown mode would.
    """
    global _registered
    if _registered:
        return
    _registered = True
    try:
        _register()
    except Exception:
        log.exception("tokcache: registering the vLLM plugin failed")


def _register() -> None:
    import vllm  # type: ignore[import-not-found,unused-ignore]
    from vllm.renderers.registry import RENDERER_REGISTRY  # type: ignore[import-not-found,unused-ignore]
    from vllm.tokenizers.registry import TokenizerRegistry  # type: ignore[import-not-found,unused-ignore]

    version = str(getattr(vllm, "__version__", "unknown"))
    if rust_frontend():
        _note_rust_frontend(version)
    problem = check_registries(TokenizerRegistry, RENDERER_REGISTRY)
    if problem is not None:
        log.error("tokcache: vLLM %s: hook %s; tokenizer mode %r is not registered (use one of vLLM's modes)",
                  version, problem, MODE)
        export_state(version, "hook_missing", problem)
        return
    try:
        disabled = PluginConfig.from_env().disabled
    except PluginConfigError:
        disabled = False  # reported by the renderer, which disables the sidecar path itself
    # The mode keeps vLLM's own HF tokenizer class and, when the plugin cannot run, vLLM's
    # own HF renderer: as registered by this vLLM, where it says.
    TokenizerRegistry.register(MODE, *_vllm_entry(TokenizerRegistry, "tokenizers", HF_TOKENIZER))
    hf_renderer = _vllm_entry(RENDERER_REGISTRY, "renderers", HF_RENDERER)
    if disabled:
        RENDERER_REGISTRY.register(MODE, *hf_renderer)
        log.info("tokcache: disabled by TOKCACHE_DISABLE; mode %r uses vLLM's own HfRenderer", MODE)
        return
    broken = _broken_install()
    if broken is not None:
        # The renderer imports the client library, which needs its C extensions: a broken
        # install must cost this process its cache, never its start.
        log.error("tokcache: %s; mode %r uses vLLM's own renderer", broken, MODE)
        export_state(version, "broken_install", broken)
        RENDERER_REGISTRY.register(MODE, *hf_renderer)
        return
    if hf_renderer != HF_RENDERER or not _module_exists(HF_RENDERER[0]):
        # TokcacheRenderer subclasses vllm.renderers.hf.HfRenderer: importing it here would fail.
        hook = f"{'.'.join(HF_RENDERER)} is missing (vLLM's hf renderer is {'.'.join(hf_renderer)})"
        log.error("tokcache: vLLM %s: hook %s; mode %r uses vLLM's own renderer", version, hook, MODE)
        export_state(version, "hook_missing", hook)
        RENDERER_REGISTRY.register(MODE, *hf_renderer)
        return
    # The renderer checks the remaining hook points when vLLM builds it (frontend processes
    # only) and logs the start line there.
    RENDERER_REGISTRY.register(MODE, *RENDERER)


def _vllm_entry(registry: Any, table: str, default: tuple[str, str]) -> tuple[str, str]:
    """vLLM's own ``hf`` entry of a registry (module, class), else ``default``."""
    entry = getattr(registry, table, {}).get("hf") if isinstance(getattr(registry, table, None), dict) else None
    if isinstance(entry, tuple) and len(entry) == 2 and all(isinstance(e, str) for e in entry):
        return entry
    return default


def _broken_install() -> str | None:
    """Why tokcache's C extensions cannot be used in this process (a build that failed, or
    that does not match these sources), or None when they load."""
    from tokcache import native

    try:
        native.engine()
        native.store()
    except native.ExtensionError as exc:
        return str(exc)
    return None


def _module_exists(name: str) -> bool:
    """Whether ``name`` can be imported, without importing it (its parent package is imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _note_rust_frontend(version: str) -> None:
    """One line per ``vllm serve``, and the state metric: vLLM's Rust frontend bypasses tokcache."""
    export_state(version, "rust_frontend")
    if os.environ.get(BYPASS_NOTED_ENV):
        return  # logged by the process that started this one
    os.environ[BYPASS_NOTED_ENV] = "1"
    log.warning("tokcache: %s=1: vLLM's Rust frontend renders and tokenizes prompts, tokcache is bypassed "
                "(no cache reads, no records); unset it to use --tokenizer-mode tokcache", RUST_FRONTEND_ENV)
