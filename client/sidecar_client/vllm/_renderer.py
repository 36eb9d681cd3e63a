"""vLLM-facing glue: the ``tokcache`` renderer and the ``AsyncLLM.generate`` wrapper.

Imported only by vLLM's renderer registry, i.e. in a frontend process (API
server, render server) when it builds a renderer. The renderer is vLLM's
``HfRenderer`` with one change: prompt text goes to the sidecar's ``Tokenize``
(on the event loop, no executor hop) and falls back to vLLM's own tokenizer on
any problem. The first renderer of a process checks the hook points
(``_hooks.check_hooks``), logs the start line, and installs the generate and
derender wrappers (``_scale_out``). The hook points are described in
``e2e/VLLM_HOOKS.md``.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.renderers.hf import HfRenderer  # type: ignore[import-not-found,unused-ignore]

from sidecar_client._fingerprint import find_tokenizer_json
from sidecar_client.vllm._config import PluginConfig, PluginConfigError
from sidecar_client.vllm._hooks import HookReport, check_hooks, export_state
from sidecar_client.vllm._runtime import PluginRuntime
from sidecar_client.vllm._scale_out import install_derender_wrapper, uninstall_derender_wrapper
from sidecar_client.vllm._stats import PluginStats, install_prometheus
from sidecar_client.vllm._trace import current_trace, install_into_vllm
from tokcache.engine.tokenizer import fingerprint_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig  # type: ignore[import-not-found,unused-ignore]

__all__ = ["TokcacheRenderer", "forget_process_state", "get_runtime", "install_generate_wrapper",
           "uninstall_generate_wrapper"]

log = logging.getLogger("vllm.tokcache.renderer")

# vLLM attaches cache_salt to the prompt only after tokenization, so render_*_async
# stash it here; tokenize_prompts_async's asyncio.gather copies the context to the hook.
_SALT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tokcache_salt", default=None)

# Encode kwargs the sidecar honours (get_encode_kwargs in vLLM 0.32/0.33); anything else falls back.
_KNOWN_ENCODE_KWARGS = frozenset({"truncation", "max_length", "add_special_tokens"})

_process: _Process | None = None
_process_lock = threading.Lock()  # guards _process: renderers may be built off the loop thread


@dataclass
class _Process:
    """What the plugin decided in this process, at its first renderer.

    ``runtime``: the plugin runs. Else vLLM tokenizes; ``bypass`` counts those
    prompts when a hook is missing (``fallbacks["hook_missing"]``).
    """

    report: HookReport
    runtime: PluginRuntime | None = None
    bypass: PluginStats | None = None


@dataclass(frozen=True)
class _OffStatus:
    """The link's status where there is no link (a missing hook): for the metrics' gauges."""

    breaker: str = "closed"
    breaker_opens: int = 0
    model: str = ""
    handshake: str = "off"
    fingerprint: str = ""


def get_runtime() -> PluginRuntime | None:
    """This process's runtime, if a tokcache renderer enabled one."""
    return _process.runtime if _process is not None else None


def forget_process_state() -> None:
    """Undo what the first renderer did in this process (the generate wrapper, the runtime).

    For tests that build renderers under different conditions in one process; the
    next renderer checks the hooks and starts the plugin again. Not for use in vLLM.
    """
    global _process
    with _process_lock:
        _process = None
    uninstall_generate_wrapper()
    uninstall_derender_wrapper()


def _make_runtime(config: VllmConfig, tokenizer: Any, report: HookReport) -> PluginRuntime | None:
    try:
        plugin_config = PluginConfig.from_env()
    except PluginConfigError as exc:
        log.error("tokcache: %s; the sidecar is not used (vLLM tokenizes in-process)", exc)
        export_state(report.version, "disabled", "config")
        return None
    if plugin_config.disabled:
        log.info("tokcache: disabled by TOKCACHE_DISABLE; vLLM tokenizes in-process")
        export_state(report.version, "disabled", "TOKCACHE_DISABLE")
        return None
    model_config = config.model_config
    if getattr(model_config, "is_encoder_decoder", False):
        log.info("tokcache: encoder-decoder model; the sidecar is not used")
        export_state(report.version, "disabled", "encoder_decoder")
        return None
    path = find_tokenizer_json(getattr(model_config, "tokenizer", None), getattr(model_config, "model", None),
                               tokenizer=tokenizer, revision=getattr(model_config, "tokenizer_revision", None))
    fingerprint = fingerprint_of(path) if path is not None else None

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    runtime = PluginRuntime(plugin_config, fingerprint, tokenizer_file=path, decode=decode)
    install_generate_wrapper(runtime)
    install_derender_wrapper(runtime)
    install_into_vllm()
    install_prometheus(runtime.stats, runtime.link.status)
    export_state(report.version, report.state)
    # The start line: a warning on a version whose hooks check out but that is not verified.
    log.log(logging.INFO if report.verified else logging.WARNING,
            "tokcache: %s; sidecar %s, model %s, deadline %g ms, breaker %d failures / %g s",
            report.line(), plugin_config.address, plugin_config.model or "(by tokenizer fingerprint)",
            plugin_config.timeout_s * 1000, plugin_config.breaker_failures, plugin_config.breaker_reset_s)
    if plugin_config.observe_only:
        log.info("tokcache: observe-only (TOKCACHE_OBSERVE_ONLY): vLLM tokenizes every prompt, the plugin times it")
    else:
        runtime.link.start_handshake()
    return runtime


def _start(renderer: Any, config: VllmConfig, tokenizer: Any) -> _Process:
    """Check the hooks and start the plugin, once per process (the first renderer does it)."""
    global _process
    with _process_lock:
        if _process is not None:
            return _process
        report = check_hooks(renderer)
        state = _process = _Process(report)
        try:
            if not report.ok:
                log.error("tokcache: %s; vLLM tokenizes every prompt itself (counted: "
                          "tokcache_vllm_fallback_total{reason=\"hook_missing\"})", report.line())
                export_state(report.version, report.state, report.missing[0])
                state.bypass = PluginStats()
                install_prometheus(state.bypass, _OffStatus)
            elif tokenizer is not None:
                state.runtime = _make_runtime(config, tokenizer, report)
        except Exception:
            log.exception("tokcache: plugin setup failed; vLLM tokenizes in-process")
            state.runtime = None
        return state


def _salt_of(kwargs: dict[str, Any]) -> str | None:
    """The request's ``cache_salt`` from ``prompt_extras``; None when there is none or it is not a str."""
    extras = kwargs.get("prompt_extras")
    salt = extras.get("cache_salt") if isinstance(extras, dict) else None
    return salt if isinstance(salt, str) else None


class TokcacheRenderer(HfRenderer):  # type: ignore[misc,unused-ignore]
    """``HfRenderer`` whose prompt tokenization asks the tokcache sidecar first.

    With a hook point missing (``_hooks.check_hooks``) it is vLLM's ``HfRenderer``
    exactly, each prompt counted as a ``hook_missing`` fallback.
    """

    def __init__(self, config: VllmConfig, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        self._tokcache: PluginRuntime | None = None
        self._bypass: PluginStats | None = None
        state = _start(self, config, tokenizer)
        # BaseRenderer.__init__ binds the async tokenizer as an INSTANCE attribute
        # (make_async(self._tokenize_prompt, executor)); a method of that name on this
        # class would be shadowed, so re-bind it here and keep vLLM's for the fallback.
        vllm_tokenize = self.__dict__.get("_tokenize_prompt_async")
        if vllm_tokenize is None:
            return  # a missing hook: reported by _start
        self._vllm_tokenize_prompt_async: Callable[..., Awaitable[Any]] = vllm_tokenize
        if state.runtime is not None and tokenizer is not None:
            self._tokcache = state.runtime
            self._tokenize_prompt_async = self._tokcache_tokenize_prompt_async
        elif state.bypass is not None:
            self._bypass = state.bypass
            self._tokenize_prompt_async = self._counted_vllm_tokenize_prompt_async

    # The salt is read from prompt_extras; every argument is passed on unchanged, so these
    # overrides accept whatever this vLLM's methods accept (a missing hook included).
    async def render_chat_async(self, *args: Any, **kwargs: Any) -> Any:
        token = _SALT.set(_salt_of(kwargs))
        try:
            return await super().render_chat_async(*args, **kwargs)
        finally:
            _SALT.reset(token)

    async def render_cmpl_async(self, *args: Any, **kwargs: Any) -> Any:
        token = _SALT.set(_salt_of(kwargs))
        try:
            return await super().render_cmpl_async(*args, **kwargs)
        finally:
            _SALT.reset(token)

    async def _counted_vllm_tokenize_prompt_async(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's own tokenization, counted: the plugin found a hook point missing."""
        assert self._bypass is not None
        self._bypass.fallbacks["hook_missing"] += 1
        t0 = time.perf_counter()
        out = await self._vllm_tokenize_prompt_async(*args, **kwargs)
        self._bypass.observe_tokenize("vllm", time.perf_counter() - t0)
        return out

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


def uninstall_generate_wrapper() -> None:
    """Put vLLM's own ``AsyncLLM.generate`` back, if the plugin wrapped it; idempotent."""
    from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found,unused-ignore]

    current = AsyncLLM.generate
    if getattr(current, "tokcache_wrapped", False):
        AsyncLLM.generate = current.__wrapped__
