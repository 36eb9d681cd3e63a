"""Observability: OpenTelemetry traces, Prometheus metrics, structured logs."""

from __future__ import annotations

from tokcache.sidecar.telemetry.logs import JsonFormatter, setup_logging
from tokcache.sidecar.telemetry.metrics import Metrics
from tokcache.sidecar.telemetry.tracing import Tracing, exporter_from_env

__all__ = ["JsonFormatter", "Metrics", "Tracing", "exporter_from_env", "setup_logging"]
