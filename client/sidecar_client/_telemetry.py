"""Spans for decisions made in the client's process (OpenTelemetry API, if installed).

A Tokenize answered in-process never reaches the sidecar, so its cache decision would
be invisible in traces. It gets a ``tokcache.Tokenize`` span here, under the caller's
current span (vLLM's request span in the plugin), with the same ``tokcache.*``
attributes the sidecar puts on its own ``Tokenize`` spans and ``tokcache.served_by =
"local"``. Without ``opentelemetry-api`` installed, or with no SDK configured (a
non-recording tracer), this costs a check and nothing else.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sidecar_client._models import TokenizeResult

__all__ = ["trace_local"]

try:
    from opentelemetry import trace as _otel_trace
except ImportError:  # pragma: no cover - the API ships with the sidecar's dependencies
    _otel_trace = None  # type: ignore[assignment]

_tracer: Any = None
# Whether an SDK tracer provider is installed, and when that was last looked at: an SDK
# is usually set up once at start, so this is checked once a second, not per request.
_sdk = False
_sdk_checked = -1.0
_SDK_RECHECK_S = 1.0


def _tracing_on() -> bool:
    global _sdk, _sdk_checked
    now = time.monotonic()
    if now - _sdk_checked >= _SDK_RECHECK_S:
        _sdk_checked = now
        _sdk = _otel_trace is not None and not isinstance(_otel_trace.get_tracer_provider(),
                                                           _otel_trace.ProxyTracerProvider)
    return _sdk


def trace_local(model: str, fingerprint: str, result: TokenizeResult, mode: str, salted: bool, start_ns: int) -> None:
    """Record one in-process Tokenize as a span (started at perf_counter ``start_ns``). Never raises."""
    global _tracer
    if _otel_trace is None or not _tracing_on():
        return  # no SDK: nothing would be recorded
    try:
        if _tracer is None:
            _tracer = _otel_trace.get_tracer("sidecar_client")
        elapsed = time.perf_counter_ns() - start_ns
        end = time.time_ns()
        span = _tracer.start_span("tokcache.Tokenize", start_time=end - elapsed)
        if span.is_recording():
            d = result.decision
            span.set_attributes({
                "tokcache.model": model, "tokcache.fingerprint": fingerprint, "tokcache.source": d.source,
                "tokcache.cached_tokens": d.cached_tokens, "tokcache.cached_chars": d.cached_chars,
                "tokcache.encoded_chars": d.encoded_chars, "tokcache.ar_spliced_tokens": d.ar_spliced_tokens,
                "tokcache.boundary_count": d.boundaries, "tokcache.salt_present": salted,
                "tokcache.backend": result.backend, "tokcache.num_tokens": len(result.token_ids),
                "tokcache.mode": mode, "tokcache.served_by": "local",
            })
        span.end(end_time=end)
    except Exception:  # telemetry never fails a request
        return
