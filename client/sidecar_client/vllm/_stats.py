"""The plugin's counters, and their export on vLLM's ``/metrics``.

Counters are plain ``collections.Counter`` objects updated on the event loop;
:func:`install_prometheus` registers a collector that reads them at scrape
time into ``prometheus_client``'s default registry, which vLLM's API server
serves (single API server; with ``--api-server-count > 1`` vLLM switches to a
multiprocess registry and these are not exported).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["BREAKER_STATES", "PluginStats", "StatusLike", "install_prometheus"]

log = logging.getLogger("vllm.tokcache.stats")

BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}


@dataclass
class PluginStats:
    """What the plugin did, since the process started. Keys are label values.

    - ``tokenize``: prompts the sidecar tokenized, by decision source (miss, l0, l1, ar)
    - ``fallbacks``: prompts vLLM tokenized itself, by reason
    - ``records``: queued, dropped (queue full), recorded, refused (by the sidecar), failed (transport),
      trimmed (an unfinished trailing character's ids left out, see ``held_back_tokens``)
    - ``record_skips``: finished choices not sent, by reason (stop_string, not_served, ...)
    """

    tokenize: Counter[str] = field(default_factory=Counter)
    fallbacks: Counter[str] = field(default_factory=Counter)
    records: Counter[str] = field(default_factory=Counter)
    record_skips: Counter[str] = field(default_factory=Counter)
    cached_tokens: int = 0
    ar_spliced_tokens: int = 0
    record_waits: int = 0
    # Responses that waited for their record (see PluginRuntime.wait_records): how many,
    # how many timed out, total seconds, and the most recent durations (for percentiles).
    response_waits: int = 0
    response_wait_timeouts: int = 0
    response_wait_seconds: float = 0.0
    recent_response_waits: deque[float] = field(default_factory=lambda: deque(maxlen=4096))

    def observe_record_wait(self, seconds: float, *, timed_out: bool) -> None:
        """Count one response that waited ``seconds`` for its records."""
        self.response_waits += 1
        self.response_wait_timeouts += timed_out
        self.response_wait_seconds += seconds
        self.recent_response_waits.append(seconds)

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy (for logs and tests)."""
        return {"tokenize": dict(self.tokenize), "fallbacks": dict(self.fallbacks),
                "records": dict(self.records), "record_skips": dict(self.record_skips),
                "cached_tokens": self.cached_tokens, "ar_spliced_tokens": self.ar_spliced_tokens,
                "record_waits": self.record_waits, "response_waits": self.response_waits,
                "response_wait_timeouts": self.response_wait_timeouts,
                "response_wait_seconds": self.response_wait_seconds}


class StatusLike(Protocol):
    """The link's state at scrape time (``_link.LinkStatus``)."""

    @property
    def breaker(self) -> str: ...
    @property
    def breaker_opens(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def handshake(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...


_installed = False


def install_prometheus(stats: PluginStats, status: Callable[[], StatusLike]) -> bool:
    """Export ``stats`` as ``tokcache_vllm_*`` metrics; idempotent; False if not possible.

    ``status()`` is called at scrape time (breaker and handshake state).
    """
    global _installed
    if _installed:
        return True
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError:
        return False

    class _Collector:
        def collect(self) -> Iterator[Any]:
            try:
                yield from _families(stats, status(), CounterMetricFamily, GaugeMetricFamily)
            except Exception:  # a scrape must never fail because of the plugin
                log.exception("tokcache: metrics collection failed")

        def describe(self) -> list[Any]:
            return []  # unchecked collector: nothing to describe ahead of time

    try:
        REGISTRY.register(_Collector())
    except Exception:
        log.exception("tokcache: could not register metrics")
        return False
    _installed = True
    return True


def _families(stats: PluginStats, status: StatusLike, counter: Any, gauge: Any) -> Iterator[Any]:
    tok = counter("tokcache_vllm_tokenize", "Prompts tokenized by the sidecar, by cache decision source",
                  labels=["source"])
    for source in ("miss", "l0", "l1", "ar", *sorted(set(stats.tokenize) - {"miss", "l0", "l1", "ar"})):
        tok.add_metric([source], stats.tokenize.get(source, 0))
    yield tok
    fb = counter("tokcache_vllm_fallback", "Prompts tokenized by vLLM itself (sidecar not used), by reason",
                 labels=["reason"])
    for reason, n in sorted(stats.fallbacks.items()):
        fb.add_metric([reason], n)
    yield fb
    rec = counter("tokcache_vllm_records", "Finished outputs sent to RecordOutputs, by result", labels=["result"])
    for result in ("queued", "dropped", "recorded", "refused", "failed", "trimmed"):
        rec.add_metric([result], stats.records.get(result, 0))
    yield rec
    skip = counter("tokcache_vllm_record_skips", "Finished outputs not recorded, by reason", labels=["reason"])
    for reason, n in sorted(stats.record_skips.items()):
        skip.add_metric([reason], n)
    yield skip
    yield counter("tokcache_vllm_cached_tokens", "Prompt tokens the sidecar served from its cache",
                  value=stats.cached_tokens)
    yield counter("tokcache_vllm_ar_spliced_tokens", "Generated token ids spliced back into prompts",
                  value=stats.ar_spliced_tokens)
    yield counter("tokcache_vllm_record_waits", "Tokenize calls that first waited for the previous turn's record",
                  value=stats.record_waits)
    yield counter("tokcache_vllm_response_waits", "Responses held until their records reached the sidecar",
                  value=stats.response_waits)
    yield counter("tokcache_vllm_response_wait_timeouts", "Responses released before their records were answered",
                  value=stats.response_wait_timeouts)
    yield counter("tokcache_vllm_response_wait_seconds", "Seconds responses were held for their records",
                  value=stats.response_wait_seconds)
    state = gauge("tokcache_vllm_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open")
    state.add_metric([], BREAKER_STATES.get(status.breaker, -1))
    yield state
    yield counter("tokcache_vllm_breaker_opens", "Times the circuit breaker opened", value=status.breaker_opens)
    info = gauge("tokcache_vllm_sidecar_info", "1, labelled with the sidecar model in use, the handshake state "
                 "and vLLM's tokenizer fingerprint", labels=["model", "handshake", "fingerprint"])
    info.add_metric([status.model, status.handshake, status.fingerprint], 1)
    yield info
