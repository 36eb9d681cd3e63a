"""Prometheus metrics, every name prefixed ``tokcache_`` (documented in docs/metrics.md).

Request-path metrics are counted in-process; segment-wide figures (bytes
used, entries, evictions by cause) are read from the shared-memory header at
scrape time, so they cover every process using the segment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

__all__ = ["Metrics"]

# 50 µs .. 2.5 s: a cached Tokenize is ~100 µs server-side, a cold 57 KB one a few ms.
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)

# StoreStats field -> eviction cause label.
_EVICTION_FIELDS = {"evictions": "cap", "ttl_evictions": "ttl", "index_evictions": "index",
                    "pressure_evictions": "pressure"}


class _StoreCollector(Collector):
    """Reads each segment's header counters at scrape time."""

    def __init__(self, stores: Callable[[], Mapping[str, Any]]) -> None:
        self._stores = stores

    def collect(self) -> Iterable[Any]:
        used = GaugeMetricFamily("tokcache_shm_used_bytes", "Live bytes in the segment's log", labels=["segment"])
        cap = GaugeMetricFamily("tokcache_shm_capacity_bytes", "Segment size (the byte cap)", labels=["segment"])
        entries = GaugeMetricFamily("tokcache_shm_entries", "Live index entries by kind",
                                    labels=["segment", "kind"])
        evict = CounterMetricFamily("tokcache_evictions", "Entries evicted, by cause (segment-wide)",
                                    labels=["segment", "cause"])
        lookups = CounterMetricFamily("tokcache_store_lookups", "Store reads by result (segment-wide)",
                                      labels=["segment", "result"])
        recov = CounterMetricFamily("tokcache_lock_recoveries", "Writer locks taken over from a dead holder",
                                    labels=["segment"])
        resident = GaugeMetricFamily("tokcache_shm_resident_bytes", "Segment pages resident in tmpfs "
                                     "(what counts against a pod's memory limit)", labels=["segment"])
        soft = GaugeMetricFamily("tokcache_shm_soft_cap_bytes", "Live-set cap now in force (lowered under "
                                 "memory pressure)", labels=["segment"])
        for name, store in self._stores().items():
            try:
                st = store.stats()
            except Exception:  # a scrape must not fail because one segment did
                log.exception("stats of %s failed", name)
                continue
            used.add_metric([name], st.used_bytes)
            cap.add_metric([name], st.capacity)
            for kind, n in st.live_entries.items():
                entries.add_metric([name, getattr(kind, "name", str(kind)).lower()], n)
            for field, cause in _EVICTION_FIELDS.items():
                if hasattr(st, field):
                    evict.add_metric([name, cause], getattr(st, field))
            lookups.add_metric([name, "hit"], st.hits)
            lookups.add_metric([name, "miss"], st.misses)
            lookups.add_metric([name, "corrupt"], st.corrupt)
            recov.add_metric([name], st.lock_recoveries)
            if hasattr(st, "resident_bytes"):
                resident.add_metric([name], st.resident_bytes)
            if hasattr(st, "soft_cap"):
                soft.add_metric([name], st.soft_cap)
        yield from (used, cap, entries, evict, lookups, recov, resident, soft)


class Metrics:
    """The sidecar's metrics on their own registry (tests make several)."""

    def __init__(self, stores: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._http: Any = None  # the /metrics HTTP server, once serving
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.rpc_requests = Counter("tokcache_rpc_requests", "RPCs handled, by method and status code",
                                    ["method", "code"], registry=r)
        self.rpc_duration = Histogram("tokcache_rpc_duration_seconds", "Server-side RPC latency",
                                      ["method", "code"], buckets=LATENCY_BUCKETS, registry=r)
        self.lookups = Counter("tokcache_lookups", "Cache lookups by layer and result",
                               ["layer", "result"], registry=r)
        self.decisions = Counter("tokcache_decisions", "Tokenize decisions by model and source",
                                 ["model", "source"], registry=r)
        self.reused_tokens = Counter("tokcache_reused_tokens", "Tokens served from the cache", ["model"], registry=r)
        self.reused_bytes = Counter("tokcache_reused_bytes", "Prompt text bytes covered by the cache",
                                    ["model"], registry=r)
        self.encoded_bytes = Counter("tokcache_encoded_bytes", "Prompt text bytes encoded by the tokenizer",
                                     ["model"], registry=r)
        self.ar_spliced = Counter("tokcache_ar_spliced_tokens", "Recorded-output (AR) tokens spliced into prompts",
                                  ["model"], registry=r)
        self.records = Counter("tokcache_records", "RecordOutput items by result", ["model", "result"], registry=r)
        self.pending_waits = Counter("tokcache_pending_waits", "Tokenize requests that waited for a recorded "
                                     "output marked as on its way, by outcome", ["model", "outcome"], registry=r)
        self.store_fallbacks = Counter("tokcache_store_fallbacks", "Requests served without the cache "
                                       "because the store failed", ["model"], registry=r)
        self.model_info = Gauge("tokcache_model_info", "Served models (value 1)",
                                ["model", "fingerprint", "backend"], registry=r)
        self.l1_enabled = Gauge("tokcache_l1_enabled", "1 if the model has safe boundaries (L1 on)",
                                ["model"], registry=r)
        # The cluster tier (tokcache.sidecar.tier); series exist at zero without one.
        self.tier_lookups = Counter("tokcache_tier_lookups", "Cluster tier reads (one per Tokenize that asked), "
                                    "by result", ["result"], registry=r)
        self.tier_records = Counter("tokcache_tier_records", "Entries read from the cluster tier, by "
                                    "verification result", ["model", "result"], registry=r)
        self.tier_writes = Counter("tokcache_tier_writes", "Recorded outputs written through to the cluster "
                                   "tier, by result", ["result"], registry=r)
        self.tier_duration = Histogram("tokcache_tier_duration_seconds", "Cluster tier round trips",
                                       ["op"], buckets=LATENCY_BUCKETS, registry=r)
        self.tier_breaker = Gauge("tokcache_tier_breaker_state", "Cluster tier circuit breaker: 0 closed, "
                                  "1 half-open, 2 open (0 without a tier)", registry=r)
        for result in ("hit", "miss", "error", "refused"):
            self.tier_lookups.labels(result)
        for result in ("ok", "error", "dropped", "refused"):
            self.tier_writes.labels(result)
        for op in ("fetch", "write"):
            self.tier_duration.labels(op)
        if stores is not None:
            r.register(_StoreCollector(stores))

    def observe_tier(self, op: str, result: str, seconds: float) -> None:
        """The tier's ``observe`` hook: a call (``op`` fetch or write) or a breaker change
        (``op`` breaker, ``result`` the new state; set here, on the loop, never read from
        the scrape thread)."""
        if op == "breaker":
            self.tier_breaker.set({"closed": 0, "half_open": 1, "open": 2}.get(result, 0))
            return
        if op == "fetch":
            self._child(self.tier_lookups, result).inc()
        else:
            self._child(self.tier_writes, result).inc()
        if result not in ("refused", "dropped"):
            self._child(self.tier_duration, op).observe(seconds)

    def observe_tier_records(self, model: str, stored: int, invalid: int) -> None:
        """Entries a tier read returned: ``stored`` verified (kept locally), ``invalid`` refused."""
        if stored:
            self._child(self.tier_records, model, "stored").inc(stored)
        if invalid:
            self._child(self.tier_records, model, "invalid").inc(invalid)

    def add_model(self, model: str, fingerprint: str, backend: str, l1_enabled: bool) -> None:
        """Publish a served model and create its series at zero, so they exist before traffic."""
        self.model_info.labels(model, fingerprint, backend).set(1)
        self.l1_enabled.labels(model).set(1 if l1_enabled else 0)
        for counter in (self.reused_tokens, self.reused_bytes, self.encoded_bytes, self.ar_spliced,
                        self.store_fallbacks):
            counter.labels(model)
        for result in ("recorded", "refused"):
            self.records.labels(model, result)
        for result in ("stored", "invalid"):
            self.tier_records.labels(model, result)
        for outcome in ("waited", "gave_up"):
            self.pending_waits.labels(model, outcome)
        for source in ("miss", "l0", "l1", "ar"):
            self.decisions.labels(model, source)
        for layer in ("l0", "l1", "ar_prefix", "ar_segment"):
            for result in ("hit", "miss"):
                self.lookups.labels(layer, result)

    def _child(self, metric: Any, *labels: str) -> Any:
        # labels() costs a few µs (validation + lock); children are cached per label tuple.
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self._child(self.rpc_requests, method, code).inc()
        self._child(self.rpc_duration, method, code).observe(seconds)

    def observe_decision(self, model: str, d: Any) -> None:
        """Count one Tokenize's decision (a tokcache.sidecar.engine.model.Decision)."""
        child = self._child
        child(self.decisions, model, d.source).inc()
        for layer, hit in (("l0", d.l0_hit), ("l1", d.l1_hit), ("ar_prefix", d.ar_prefix_hit)):
            if hit is not None:
                child(self.lookups, layer, "hit" if hit else "miss").inc()
        if d.segment_splices:
            child(self.lookups, "ar_segment", "hit").inc()
        child(self.reused_tokens, model).inc(d.cached_tokens)
        child(self.reused_bytes, model).inc(d.cached_bytes)
        child(self.encoded_bytes, model).inc(d.encoded_bytes)
        if d.ar_spliced_tokens:
            child(self.ar_spliced, model).inc(d.ar_spliced_tokens)
        if d.store_errors:
            child(self.store_fallbacks, model).inc()

    def observe_pending(self, model: str, outcome: str) -> None:
        """A Tokenize that waited for a record marked as on its way: ``waited`` (served with
        it) or ``gave_up`` (served without it, after PENDING_WAIT_S)."""
        self._child(self.pending_waits, model, outcome).inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose /metrics on ``addr:port`` from a daemon thread until :meth:`close`.

        Raises OSError if the port cannot be bound (nothing is left running then).
        """
        started = start_http_server(port, addr=addr, registry=self.registry)
        # prometheus-client returns (server, thread) since 0.17; older ones return None.
        self._http = started[0] if isinstance(started, tuple) else None
        log.info("metrics on http://%s:%d/metrics", addr, port)

    def close(self) -> None:
        """Stop serving /metrics and free the port. Idempotent."""
        http, self._http = self._http, None
        if http is not None:
            http.shutdown()
            http.server_close()
