"""Records of outputs that come back to a render server through vLLM's ``/derender``.

In vLLM's scale-out layout (``vllm launch render``, ``vllm serve --enable-scale-out``) a render
server renders and tokenizes prompts (``/v1/chat/completions/render``, ``/v1/completions/render``:
through the tokcache renderer, so with tokcache's ids) and generate servers take token ids
(``/inference/v1/generate``). The caller hands the generated ids back to a render server's
``/v1/chat/completions/derender`` or ``/v1/completions/derender`` for their text. That is where
the output meets the prompt the plugin served, so the derender wrapper records it as the
generate wrapper records a request: same checks (the prompt ids must be those served for the
text, a stop string is not recorded, ...), same counters, and the response waits for its
record like a generated one.

The prompt text is the prompt ids decoded (special tokens kept): the text the render server
tokenized, for the byte-level tokenizers tokcache serves; when it is not, the served-prompt
check refuses the record (counted ``not_served``). Requests without prompt ids (neither
``prompt_token_ids`` nor the generate response's) are counted ``no_prompt_ids``. Streamed
derender (``stream: true``) is not recorded: its state carries no output ids outside the
parser path.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar_client.vllm._runtime import PluginRuntime

__all__ = ["install_derender_wrapper", "uninstall_derender_wrapper"]

log = logging.getLogger("vllm.tokcache.scale_out")

_MODULE = "vllm.renderers.online_derenderer"
# method -> (its parameters the wrapper reads, in vLLM's order after self)
_METHODS = {
    "derender_chat": ("generate_response", "chat_request", "prompt_token_ids"),
    "derender_completion": ("generate_responses", "prompt_tokens", "completion_request", "prompt_token_ids"),
}


@dataclass(frozen=True)
class _Output:
    """One derendered choice, as ``RequestRecorder.feed`` reads a ``CompletionOutput``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None


def _derenderer_class() -> Any:
    import importlib

    return importlib.import_module(_MODULE).OnlineDerenderer


def install_derender_wrapper(runtime: PluginRuntime) -> bool:
    """Wrap ``OnlineDerenderer.derender_chat`` / ``derender_completion`` once per process.

    False (one info line, nothing wrapped) when this vLLM has no scale-out derenderer or its
    methods take other parameters: the plugin runs without recording derendered outputs.
    """
    try:
        cls = _derenderer_class()
        for name, params in _METHODS.items():
            method = getattr(cls, name)
            if getattr(method, "tokcache_wrapped", False):
                continue
            names = list(inspect.signature(method).parameters)[1:1 + len(params)]
            if tuple(names) != params or not inspect.iscoroutinefunction(method):
                raise TypeError(f"OnlineDerenderer.{name}{inspect.signature(method)}")
        for name in _METHODS:
            if not getattr(getattr(cls, name), "tokcache_wrapped", False):
                setattr(cls, name, _wrap(runtime, name, getattr(cls, name)))
    except Exception as exc:
        log.info("tokcache: vLLM's scale-out /derender is not hooked (%s: %s); outputs it derenders are not "
                 "recorded", type(exc).__name__, exc)
        return False
    return True


def uninstall_derender_wrapper() -> None:
    """Put vLLM's own derender methods back, if the plugin wrapped them; idempotent, never raises."""
    try:
        cls = _derenderer_class()
    except Exception:
        return
    for name in _METHODS:
        current = getattr(cls, name, None)
        if getattr(current, "tokcache_wrapped", False):
            setattr(cls, name, current.__wrapped__)  # type: ignore[union-attr]


def _wrap(runtime: PluginRuntime, name: str, original: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    async def derender(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(self, *args, **kwargs)  # vLLM's answer, unchanged by what follows
        try:
            call = signature.bind(self, *args, **kwargs).arguments
            if name == "derender_chat":
                pairs = [(call["generate_response"], call.get("prompt_token_ids"))]
                request = call.get("chat_request")
            else:
                responses = call["generate_responses"]
                ids = call.get("prompt_token_ids") or [None] * len(responses)
                pairs = list(zip(responses, ids, strict=False))
                request = call.get("completion_request")
            await _record(runtime, self, pairs, request)
        except Exception:  # never into vLLM's response
            log.exception("tokcache: not recording a derendered output")
            runtime.stats.record_skips["plugin_error"] += 1
        return result

    derender.__name__ = original.__name__
    derender.__qualname__ = original.__qualname__
    derender.__doc__ = original.__doc__
    derender.__wrapped__ = original  # type: ignore[attr-defined]
    derender.tokcache_wrapped = True  # type: ignore[attr-defined]
    return derender


async def _record(runtime: PluginRuntime, derenderer: Any, pairs: Sequence[tuple[Any, Sequence[int] | None]],
                  request: Any) -> None:
    """Record each generate response's finished choices against its prompt (see the module)."""
    tokenizer = derenderer.renderer.get_tokenizer()
    salt = getattr(request, "cache_salt", None)
    skip_special = getattr(request, "skip_special_tokens", True) is not False
    for response, given in pairs:
        prompt_ids = given if given is not None else getattr(response, "prompt_token_ids", None)
        if not prompt_ids:
            runtime.stats.record_skips["no_prompt_ids"] += 1
            continue
        prompt_ids = list(prompt_ids)
        # On the event loop: one decode of the prompt, as vLLM's derenderer seeds its own with it.
        prompt = {"prompt": tokenizer.decode(prompt_ids, skip_special_tokens=False),
                  "prompt_token_ids": prompt_ids, "cache_salt": salt}
        recorder = runtime.start_request(prompt, delta=False, trace_headers=None)
        if recorder is None:
            continue  # counted (not_served: these ids were not served for that text here)
        outputs = [_Output(c.index, str(tokenizer.decode(list(c.token_ids), skip_special_tokens=skip_special)),
                           list(c.token_ids), c.finish_reason, c.stop_reason)
                   for c in response.choices if c.token_ids]
        waits = recorder.feed(outputs)
        if waits:
            await runtime.wait_records(waits)
