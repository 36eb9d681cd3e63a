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

Configuration (environment, read once per process by the renderer):
``TOKCACHE_ADDRESS``, ``TOKCACHE_MODEL``, ``TOKCACHE_TIMEOUT_MS``,
``TOKCACHE_BREAKER_FAILURES``, ``TOKCACHE_BREAKER_RESET_S``,
``TOKCACHE_RECORD_QUEUE``, ``TOKCACHE_DISABLE``. See ``docs/vllm.md``.

Everything fails open: a slow, dead or mismatched sidecar means vLLM
tokenizes in-process, as without the plugin.
"""

from __future__ import annotations

import logging

from sidecar_client.vllm._config import SUPPORTED_VLLM, PluginConfig, PluginConfigError, check_vllm_version
from sidecar_client.vllm._trace import TraceContextMiddleware

__all__ = [
    "MODE",
    "SUPPORTED_VLLM",
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
    supported, line = check_vllm_version(version)
    try:
        disabled = PluginConfig.from_env().disabled
    except PluginConfigError:
        disabled = False  # reported by the renderer, which disables the sidecar path itself
    TokenizerRegistry.register(MODE, *HF_TOKENIZER)
    if supported and not disabled:
        RENDERER_REGISTRY.register(MODE, *RENDERER)
        log.info("tokcache: %s; tokenizer mode %r registered", line, MODE)
        return
    # Keep --tokenizer-mode tokcache working (fail open) with vLLM's plain renderer.
    RENDERER_REGISTRY.register(MODE, *HF_RENDERER)
    if not supported:
        log.warning("tokcache: %s; mode %r uses vLLM's own HfRenderer, the sidecar is not used", line, MODE)
    else:
        log.info("tokcache: disabled by TOKCACHE_DISABLE; mode %r uses vLLM's own HfRenderer", MODE)
