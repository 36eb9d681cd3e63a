"""Which OpenTelemetry span exporter the standard ``OTEL_*`` variables ask for (sidecar and clients).

``OTEL_TRACES_EXPORTER`` = ``otlp`` | ``console`` | ``none``; unset means ``none`` unless
``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (then
``otlp``). Needs ``opentelemetry-sdk`` (and the OTLP exporter package for ``otlp``);
without them tracing stays off, said once in the log.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["exporter_from_env"]


def exporter_from_env(env: Mapping[str, str] | None = None) -> Any:  # noqa: ANN401 - an SDK SpanExporter
    """The span exporter the OTEL_* variables ask for, or None (tracing off)."""
    env = os.environ if env is None else env
    choice = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not choice:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        choice = "otlp" if endpoint else "none"
    if choice == "none":
        return None
    if choice == "console":
        try:
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        except ImportError:
            log.error("OTEL_TRACES_EXPORTER=console but opentelemetry-sdk is not installed; tracing off")
            return None
        return ConsoleSpanExporter()
    if choice == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.error("OTEL_TRACES_EXPORTER=otlp but opentelemetry-exporter-otlp-proto-grpc is not "
                      "installed (pip install 'tokcache[otlp]'); tracing off")
            return None
        return OTLPSpanExporter()
    log.error("OTEL_TRACES_EXPORTER=%r is not one of otlp, console, none; tracing off", choice)
    return None
