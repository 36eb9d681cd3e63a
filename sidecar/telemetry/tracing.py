"""OpenTelemetry traces of cache decisions.

Configured from the standard variables: ``OTEL_TRACES_EXPORTER`` =
``otlp`` | ``console`` | ``none`` (default ``none`` unless
``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is
set, then ``otlp``), sampling from ``OTEL_TRACES_SAMPLER``/``_ARG``, resource
from ``OTEL_SERVICE_NAME``/``OTEL_RESOURCE_ATTRIBUTES`` (the SDK reads those).

Off costs nothing: no provider, no span objects; the engine only stamps
``perf_counter_ns`` at phase edges, which it does anyway, and child spans
(render, lookup, encode, insert) are created after the fact from those stamps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from tokcache.tracing import exporter_from_env

log = logging.getLogger(__name__)

__all__ = ["Tracing", "exporter_from_env"]

TRACER_NAME = "tokcache.sidecar"


class Tracing:
    """Creates the RPC span and its phase children. ``enabled`` False = no-op, no cost."""

    def __init__(self, processor: SpanProcessor | None = None, provider: TracerProvider | None = None) -> None:
        """Tracing with ``processor`` (tests pass a SimpleSpanProcessor over an in-memory exporter)."""
        self.provider: TracerProvider | None = None
        self.tracer: trace.Tracer | None = None
        if processor is not None or provider is not None:
            self.provider = provider or TracerProvider(resource=Resource.create({"service.name": "tokcache"}))
            if processor is not None:
                self.provider.add_span_processor(processor)
            self.tracer = self.provider.get_tracer(TRACER_NAME)

    @classmethod
    def from_env(cls) -> Tracing:
        exporter = exporter_from_env()
        if exporter is None:
            return cls()
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "tokcache")})
        return cls(BatchSpanProcessor(exporter), TracerProvider(resource=resource))

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def record(self, method: str, metadata: Iterable[tuple[str, Any]] | None, start_ns: int, start_pc: int,
               attributes: Mapping[str, Any], phases: Mapping[str, tuple[int, int]], status_code: str,
               error: str | None = None) -> None:
        """Emit the span of one RPC (already finished) with children for its phases.

        ``start_ns`` is the epoch time and ``start_pc`` the perf_counter_ns at
        the RPC's start; phase stamps are perf_counter_ns, mapped onto epoch time.
        The W3C context (traceparent/tracestate) in ``metadata`` becomes the parent.
        """
        if self.tracer is None:
            return
        carrier = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
        parent = extract(carrier)
        end_ns = start_ns + (time.perf_counter_ns() - start_pc)
        span = self.tracer.start_span(f"tokcache.v1.Tokenizer/{method}", context=parent,
                                      kind=trace.SpanKind.SERVER, start_time=start_ns)
        span.set_attribute("rpc.system", "grpc")
        span.set_attribute("rpc.service", "tokcache.v1.Tokenizer")
        span.set_attribute("rpc.method", method)
        span.set_attribute("rpc.grpc.status_code", status_code)
        for key, value in attributes.items():
            span.set_attribute(key, value)
        if error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        ctx = trace.set_span_in_context(span)
        for name, (a, b) in phases.items():
            child = self.tracer.start_span(f"tokcache.{name}", context=ctx, start_time=start_ns + (a - start_pc))
            child.end(end_time=start_ns + (b - start_pc))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
