"""Observability: OpenTelemetry traces, Prometheus metrics, structured logs."""

from __future__ import annotations

from sidecar.telemetry.logs import JsonFormatter, setup_logging
from sidecar.telemetry.metrics import Metrics
from sidecar.telemetry.tracing import Tracing, exporter_from_env

__all__ = ["JsonFormatter", "Metrics", "Tracing", "exporter_from_env", "setup_logging"]
