"""vLLM-facing glue: the ``tokcache`` renderer and the ``AsyncLLM.generate`` wrapper.

Imported only by vLLM's renderer registry, i.e. in a frontend process (API
server) when it builds a renderer. The renderer is vLLM's ``HfRenderer``
with one change: prompt text goes to the sidecar's ``Tokenize`` (on the event
loop, no executor hop) and falls back to vLLM's own tokenizer on any problem.
The hook points are described in ``e2e/VLLM_HOOKS.md``.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import vllm  # type: ignore[import-not-found,unused-ignore]
from vllm.renderers.hf import HfRenderer  # type: ignore[import-not-found,unused-ignore]

from sidecar_client._fingerprint import find_tokenizer_json, fingerprint_file
from sidecar_client.vllm._config import PluginConfig, PluginConfigError, check_vllm_version
from sidecar_client.vllm._runtime import PluginRuntime
from sidecar_client.vllm._stats import install_prometheus
from sidecar_client.vllm._trace import current_trace, install_into_vllm

if TYPE_CHECKING:
    from vllm.config import VllmConfig  # type: ignore[import-not-found,unused-ignore]

__all__ = ["TokcacheRenderer", "get_runtime"]

log = logging.getLogger("vllm.tokcache.renderer")

# vLLM attaches cache_salt to the prompt only after tokenization, so render_*_async
# stash it here; tokenize_prompts_async's asyncio.gather copies the context to the hook.
_SALT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tokcache_salt", default=None)

# Encode kwargs the sidecar honours (get_encode_kwargs in vLLM 0.32/0.33); anything else falls back.
_KNOWN_ENCODE_KWARGS = frozenset({"truncation", "max_length", "add_special_tokens"})

_runtime: PluginRuntime | None = None
_runtime_made = False
_runtime_lock = threading.Lock()  # guards _runtime/_runtime_made: renderers may be built off the loop thread


def get_runtime() -> PluginRuntime | None:
    """This process's runtime, if a tokcache renderer enabled one."""
    return _runtime


def _make_runtime(config: VllmConfig, tokenizer: Any) -> PluginRuntime | None:
    try:
        plugin_config = PluginConfig.from_env()
    except PluginConfigError as exc:
        log.error("tokcache: %s; the sidecar is not used (vLLM tokenizes in-process)", exc)
        return None
    if plugin_config.disabled:
        log.info("tokcache: disabled by TOKCACHE_DISABLE; vLLM tokenizes in-process")
        return None
    model_config = config.model_config
    if getattr(model_config, "is_encoder_decoder", False):
        log.info("tokcache: encoder-decoder model; the sidecar is not used")
        return None
    path = find_tokenizer_json(getattr(model_config, "tokenizer", None), getattr(model_config, "model", None),
                               tokenizer=tokenizer, revision=getattr(model_config, "tokenizer_revision", None))
    fingerprint = fingerprint_file(path) if path is not None else None

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    runtime = PluginRuntime(plugin_config, fingerprint, tokenizer_file=path, decode=decode)
    install_generate_wrapper(runtime)
    install_into_vllm()
    install_prometheus(runtime.stats, runtime.link.status)
    _, version_line = check_vllm_version(str(getattr(vllm, "__version__", "unknown")))
    log.info("tokcache: %s; sidecar %s, model %s, deadline %g ms, breaker %d failures / %g s, record queue %d",
             version_line, plugin_config.address, plugin_config.model or "(by tokenizer fingerprint)",
             plugin_config.timeout_s * 1000, plugin_config.breaker_failures, plugin_config.breaker_reset_s,
             plugin_config.record_queue)
    if plugin_config.observe_only:
        log.info("tokcache: observe-only (TOKCACHE_OBSERVE_ONLY): vLLM tokenizes every prompt, the plugin times it")
    else:
        runtime.link.start_handshake()
    return runtime


def _runtime_for(config: VllmConfig, tokenizer: Any) -> PluginRuntime | None:
    global _runtime, _runtime_made
    with _runtime_lock:
        if not _runtime_made:
            _runtime_made = True
            try:
                _runtime = _make_runtime(config, tokenizer)
            except Exception:
                log.exception("tokcache: plugin setup failed; vLLM tokenizes in-process")
                _runtime = None
        return _runtime


class TokcacheRenderer(HfRenderer):  # type: ignore[misc,unused-ignore]
    """``HfRenderer`` whose prompt tokenization asks the tokcache sidecar first."""

    def __init__(self, config: VllmConfig, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        self._tokcache: PluginRuntime | None = None
        # BaseRenderer.__init__ binds the async tokenizer as an INSTANCE attribute
        # (make_async(self._tokenize_prompt, executor)); a method of that name on this
        # class would be shadowed, so re-bind it here and keep vLLM's for the fallback.
        vllm_tokenize = self.__dict__.get("_tokenize_prompt_async")
        if vllm_tokenize is None:
            log.warning("tokcache: this vLLM's renderer has no _tokenize_prompt_async attribute; "
                        "the sidecar is not used")
            return
        self._vllm_tokenize_prompt_async: Callable[..., Awaitable[Any]] = vllm_tokenize
        if tokenizer is not None:
            self._tokcache = _runtime_for(config, tokenizer)
        if self._tokcache is not None:
            self._tokenize_prompt_async = self._tokcache_tokenize_prompt_async

    async def render_chat_async(self, conversations: Any, chat_params: Any, tok_params: Any = None, *,
                                prompt_extras: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        token = _SALT.set((prompt_extras or {}).get("cache_salt"))
        try:
            return await super().render_chat_async(conversations, chat_params, tok_params,
                                                   prompt_extras=prompt_extras, **kwargs)
        finally:
            _SALT.reset(token)

    async def render_cmpl_async(self, prompts: Any, tok_params: Any = None, *,
                                prompt_extras: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        token = _SALT.set((prompt_extras or {}).get("cache_salt"))
        try:
            return await super().render_cmpl_async(prompts, tok_params, prompt_extras=prompt_extras, **kwargs)
        finally:
            _SALT.reset(token)

    def _unsupported(self, prompt: Any, params: Any, kwargs: dict[str, Any]) -> str | None:
        if not isinstance(prompt.get("prompt"), str):
            return "not_text"
        if prompt.get("multi_modal_data") or prompt.get("multi_modal_uuids"):
            return "multimodal"
        if self._wants_offsets(prompt, params):
            return "offsets"
        if getattr(params, "truncate_prompt_tokens", None) is not None:
            return "truncation"
        if set(kwargs) - _KNOWN_ENCODE_KWARGS:
            return "encode_kwargs"
        return None

    async def _tokcache_tokenize_prompt_async(self, prompt: Any, params: Any) -> Any:
        runtime = self._tokcache
        assert runtime is not None
        try:
            kwargs = params.get_encode_kwargs()
            reason = "observe_only" if runtime.config.observe_only else self._unsupported(prompt, params, kwargs)
            if reason is not None:
                runtime.fallback(reason)
            else:
                max_length = kwargs.get("max_length") if kwargs.get("truncation") else None
                ids = await runtime.tokenize(prompt["prompt"], add_special_tokens=bool(kwargs.get(
                    "add_special_tokens", True)), cache_salt=_SALT.get(), trace=current_trace(),
                    max_length=max_length)
                if ids is not None:
                    return self._build_tokens_prompt(ids, prompt)
        except Exception:  # the host must never see our errors (CancelledError still propagates)
            log.exception("tokcache: tokenize hook failed; vLLM tokenizes this prompt")
            runtime.fallback("plugin_error")
        t0 = time.perf_counter()
        out = await self._vllm_tokenize_prompt_async(prompt, params)
        runtime.stats.observe_tokenize("vllm", time.perf_counter() - t0)
        return out


def install_generate_wrapper(runtime: PluginRuntime) -> None:
    """Wrap ``AsyncLLM.generate`` once per process so finished outputs are recorded."""
    from vllm.sampling_params import RequestOutputKind  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found,unused-ignore]

    original = AsyncLLM.generate
    if getattr(original, "tokcache_wrapped", False):
        return
    delta_kind = RequestOutputKind.DELTA

    async def generate(self: Any, prompt: Any, sampling_params: Any, request_id: str, *args: Any,
                       **kwargs: Any) -> AsyncGenerator[Any, None]:
        recorder = None
        try:
            recorder = runtime.start_request(prompt, delta=sampling_params.output_kind == delta_kind,
                                             trace_headers=kwargs.get("trace_headers"))
        except Exception:
            log.exception("tokcache: not recording request %s", request_id)
        inner = original(self, prompt, sampling_params, request_id, *args, **kwargs)
        try:
            async for out in inner:
                if recorder is not None:
                    waits = recorder.feed(getattr(out, "outputs", ()))
                    if waits:
                        # The output that finishes a choice waits for its record: once the
                        # client has the response, every process on the node finds it.
                        await runtime.wait_records(waits)
                yield out
        finally:
            # Closing our generator (client went away) must abort vLLM's request now, not at GC.
            await inner.aclose()

    wrapped: Callable[..., Any] = generate
    wrapped.__name__ = original.__name__
    wrapped.__qualname__ = original.__qualname__
    wrapped.__doc__ = original.__doc__
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    wrapped.tokcache_wrapped = True  # type: ignore[attr-defined]
    AsyncLLM.generate = wrapped
    log.info("tokcache: AsyncLLM.generate wrapped; finished outputs are recorded")
