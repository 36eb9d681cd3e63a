"""Spans for decisions made in the client's process (OpenTelemetry, if installed and asked for).

A Tokenize answered in-process never reaches the sidecar, so its cache decision would be
invisible in traces. It gets a ``tokcache.Tokenize`` span here, with the ``tokcache.*``
attributes the sidecar puts on its own ``Tokenize`` spans and ``tokcache.served_by =
"local"``, under the caller's span: the W3C ``traceparent`` the caller passed (the vLLM
plugin passes the request's), else the current OpenTelemetry context.

Where spans go: the process's own SDK tracer provider when it has one; else, when the
standard ``OTEL_*`` variables ask for an exporter (``OTEL_TRACES_EXPORTER=console|otlp``),
a provider of this library's own with that exporter; else nowhere, for the cost of a
check once a second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sidecar_client._models import TokenizeResult

__all__ = ["trace_local", "trace_local_record"]

try:
    from opentelemetry import trace as _otel_trace
    from opentelemetry.propagate import extract as _extract
except ImportError:  # pragma: no cover - the API ships with the client's dependencies
    _otel_trace = None  # type: ignore[assignment]
    _extract = None  # type: ignore[assignment]

_RECHECK_S = 1.0
# Guards the three below: which tracer to use and when that was decided.
_lock = threading.Lock()
_tracer: Any = None
_checked = -1.0
_own_provider: Any = None  # made once from OTEL_* when the process has no SDK provider


def _current_tracer() -> Any:  # noqa: ANN401 - an OpenTelemetry Tracer or None
    global _tracer, _checked, _own_provider
    now = time.monotonic()
    if now - _checked < _RECHECK_S:
        return _tracer
    with _lock:
        _checked = now
        provider = _otel_trace.get_tracer_provider() if _otel_trace is not None else None
        if provider is not None and not isinstance(provider, _otel_trace.ProxyTracerProvider):
            _tracer = provider.get_tracer("sidecar_client")
        elif _own_provider is not None:
            _tracer = _own_provider.get_tracer("sidecar_client")
        else:
            _tracer = _make_own_tracer()
        return _tracer


def _make_own_tracer() -> Any:  # noqa: ANN401
    global _own_provider
    from tokcache.tracing import exporter_from_env

    exporter = exporter_from_env()
    if exporter is None:
        return None
    try:
        import os

        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        return None
    _own_provider = TracerProvider(resource=Resource.create(
        {"service.name": os.environ.get("OTEL_SERVICE_NAME", "tokcache-client")}))
    _own_provider.add_span_processor(BatchSpanProcessor(exporter))
    return _own_provider.get_tracer("sidecar_client")


def _span(name: str, start_ns: int, carrier: Sequence[tuple[str, str]],
          attributes: Callable[[], dict[str, Any]]) -> None:
    """One finished span ``name`` (started at perf_counter ``start_ns``, ended now), a child of
    the W3C context in ``carrier`` (traceparent/tracestate) or else the current one; its
    ``attributes()`` made only when it records. Never raises."""
    if _otel_trace is None:
        return
    try:
        tracer = _current_tracer()
        if tracer is None:
            return
        context = _extract({k.lower(): v for k, v in carrier}) if carrier else None
        elapsed = time.perf_counter_ns() - start_ns
        end = time.time_ns()
        span = tracer.start_span(name, context=context, start_time=end - elapsed)
        if span.is_recording():
            span.set_attributes(attributes())
        span.end(end_time=end)
    except Exception:  # telemetry never fails a request
        return


def trace_local(model: str, fingerprint: str, result: TokenizeResult, mode: str, salted: bool, start_ns: int,
                carrier: Sequence[tuple[str, str]] = ()) -> None:
    """Record one in-process Tokenize as a ``tokcache.Tokenize`` span (see :func:`_span`)."""
    def attributes() -> dict[str, Any]:
        d = result.decision
        return {
            "tokcache.model": model, "tokcache.fingerprint": fingerprint, "tokcache.source": d.source,
            "tokcache.cached_tokens": d.cached_tokens, "tokcache.cached_chars": d.cached_chars,
            "tokcache.encoded_chars": d.encoded_chars, "tokcache.ar_spliced_tokens": d.ar_spliced_tokens,
            "tokcache.boundary_count": d.boundaries, "tokcache.salt_present": salted,
            "tokcache.backend": result.backend, "tokcache.num_tokens": len(result.token_ids),
            "tokcache.mode": mode, "tokcache.served_by": "local",
        }
    _span("tokcache.Tokenize", start_ns, carrier, attributes)


def trace_local_record(model: str, fingerprint: str, result: str, recorded_tokens: int, entries: int,
                       start_ns: int, carrier: Sequence[tuple[str, str]] = ()) -> None:
    """Record one in-process RecordOutput as a ``tokcache.RecordOutput`` span (``result``:
    "recorded" or "refused"; see :func:`_span`)."""
    _span("tokcache.RecordOutput", start_ns, carrier, lambda: {
        "tokcache.model": model, "tokcache.fingerprint": fingerprint, "tokcache.result": result,
        "tokcache.recorded_tokens": recorded_tokens, "tokcache.entries": entries, "tokcache.served_by": "local",
    })
