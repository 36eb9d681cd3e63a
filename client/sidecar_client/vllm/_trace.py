"""W3C trace context of the HTTP request, for the Tokenize call's gRPC metadata.

vLLM's renderer never sees the HTTP request, and reads trace headers only
after rendering. A pure ASGI middleware puts ``traceparent``/``tracestate``
in a context variable; the tokenize coroutine runs inside the request's task
tree (``asyncio.gather`` copies the context), so it reads them there.
``AsyncLLM.generate`` gets the same headers as ``trace_headers`` (for records).

The middleware is added to vLLM's app automatically (:func:`install_into_vllm`);
``--middleware sidecar_client.vllm.TraceContextMiddleware`` also works.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["TRACE_KEYS", "TraceContextMiddleware", "current_trace", "install_into_vllm", "trace_metadata"]

log = logging.getLogger("vllm.tokcache.trace")

TRACE_KEYS = ("traceparent", "tracestate")
_TRACE_KEYS_B = tuple(k.encode() for k in TRACE_KEYS)

_TRACE: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar("tokcache_trace", default=())

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def current_trace() -> tuple[tuple[str, str], ...]:
    """The (key, value) trace headers of the HTTP request being served, or ()."""
    return _TRACE.get()


def trace_metadata(headers: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata from vLLM's ``trace_headers`` mapping (only the W3C keys)."""
    if not headers:
        return ()
    return tuple((k, str(headers[k])) for k in TRACE_KEYS if headers.get(k))


class TraceContextMiddleware:
    """ASGI middleware: exposes the request's W3C trace headers to the tokcache plugin."""

    tokcache_trace = True  # marker: install_into_vllm does not add it twice

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        found = tuple((k.decode(), v.decode("latin-1")) for k, v in scope.get("headers", ())
                      if k in _TRACE_KEYS_B)
        if not found:
            await self.app(scope, receive, send)
            return
        token = _TRACE.set(found)
        try:
            await self.app(scope, receive, send)
        finally:
            _TRACE.reset(token)


_APP_MODULE = "vllm.entrypoints.launchers.app"


def install_into_vllm() -> bool:
    """Make vLLM's ``build_app`` add :class:`TraceContextMiddleware`; idempotent.

    Wraps ``init_entrypoints_middleware`` as looked up by ``build_app`` (vLLM
    0.32/0.33). Called from the renderer's constructor, which runs before the
    app is built. False (logged) when the module layout is not the expected one.
    """
    module = sys.modules.get(_APP_MODULE)
    original = getattr(module, "init_entrypoints_middleware", None) if module is not None else None
    if original is None:
        log.info("tokcache: %s not loaded; to forward trace context to the sidecar, pass "
                 "--middleware sidecar_client.vllm.TraceContextMiddleware", _APP_MODULE)
        return False
    if getattr(original, "tokcache_wrapped", False):
        return True

    def init_entrypoints_middleware(args: Any, app: Any, *rest: Any, **kwargs: Any) -> Any:
        result = original(args, app, *rest, **kwargs)
        try:
            given = [m for m in (getattr(args, "middleware", None) or []) if m.endswith("TraceContextMiddleware")]
            if not given:
                app.add_middleware(TraceContextMiddleware)
        except Exception:
            log.exception("tokcache: could not add the trace-context middleware")
        return result

    init_entrypoints_middleware.tokcache_wrapped = True  # type: ignore[attr-defined]
    init_entrypoints_middleware.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, "init_entrypoints_middleware", init_entrypoints_middleware)  # noqa: B010
    return True
