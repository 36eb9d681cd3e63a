"""The plugin's circuit breaker: :mod:`tokcache.breaker` (shared with the sidecar's cluster tier)."""

from __future__ import annotations

from tokcache.breaker import BreakerState, CircuitBreaker

__all__ = ["BreakerState", "CircuitBreaker"]
