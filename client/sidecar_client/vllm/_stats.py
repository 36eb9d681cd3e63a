"""The plugin's counters, and their export on vLLM's ``/metrics``.

:class:`PluginStats` is plain Python (``collections.Counter`` and numbers,
updated on the event loop) so the plugin works without prometheus_client.
:func:`install_prometheus` binds it to real ``prometheus_client`` metrics:
from then on every increase is mirrored into a labelled Counter, and each
response's wait for its record is observed into a Histogram. Being real
metrics, they work in both of vLLM's modes:

- one API server: vLLM serves prometheus_client's default registry;
- ``--api-server-count > 1``: vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` before
  spawning the API servers, so each process's values go to its own mmap files
  and ``/metrics`` (a ``MultiProcessCollector``) sums counters and histograms
  over the processes. Gauges pick a mode: ``breaker_state`` is the worst
  (``livemax``) of the live processes, ``sidecar_info`` has one series per
  state any live process is in.

Gauges (breaker, handshake) are set from ``status()`` after each plugin event
and, with one API server, again at scrape time.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

__all__ = ["BREAKER_STATES", "RESPONSE_WAIT_BUCKETS", "TOKENIZE_BUCKETS", "MirroredCounter", "PluginStats",
           "StatusLike", "install_prometheus"]

log = logging.getLogger("vllm.tokcache.stats")

BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}

# A response waits for its records stored in vLLM's own process (a few hundred µs), or where
# the process cannot write the node's segment for one RecordOutputs round trip (a few ms; the
# bound is TOKCACHE_RECORD_WAIT_MS, default 1 s). Fine buckets at the low end.
RESPONSE_WAIT_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
                         0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# PluginStats counter attribute -> (metric name, help, label name, label values exported at 0)
_FAMILIES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "tokenize": ("tokcache_vllm_tokenize", "Prompts tokenized by the sidecar, by cache decision source",
                 "source", ("miss", "l0", "l1", "ar")),
    "fallbacks": ("tokcache_vllm_fallback", "Prompts tokenized by vLLM itself (sidecar not used), by reason",
                  "reason", ()),
    "records": ("tokcache_vllm_records", "Finished outputs recorded, in this process or by RecordOutputs, by result",
                "result", ("queued", "dropped", "recorded", "refused", "failed", "trimmed")),
    "record_skips": ("tokcache_vllm_record_skips", "Finished outputs not recorded, by reason", "reason", ()),
    "pending": ("tokcache_vllm_pending", "Recorded outputs marked as on their way in the node's segment (marked: "
                "a response went before the sidecar answered its record; withdrawn once it did), and prompts that "
                "waited for such an output (waited) or were served without it after the wait (gave_up)",
                "event", ("marked", "withdrawn", "waited", "gave_up")),
    "served": ("tokcache_vllm_served", "Prompts the cache answered, by where the decision was made (local: in "
               "vLLM's process from the node's shared memory, no RPC; sidecar: its Tokenize RPC)",
               "path", ("local", "sidecar")),
    "paths": ("tokcache_vllm_read_path", "Prompts read in vLLM's process (served path local), by the read path that "
              "served them (native: the C fast path; python: the reference path, the same ids for more CPU)",
              "path", ("native", "python")),
    "declines": ("tokcache_vllm_native_declines", "Prompts read in vLLM's process by the python path, by why the "
                 "native fast path left them to it (no_base: a first turn, or a conversation another API server "
                 "read last; l0: cached whole; ...)", "reason", ()),
}
# Seconds to produce a prompt's ids, by path: local, sidecar, vllm (vLLM's own tokenizer,
# when the plugin falls back or observes only).
TOKENIZE_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
                    0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
# PluginStats number attribute -> (metric name, help)
_SCALARS: dict[str, tuple[str, str]] = {
    "cached_tokens": ("tokcache_vllm_cached_tokens", "Prompt tokens the sidecar served from its cache"),
    "ar_spliced_tokens": ("tokcache_vllm_ar_spliced_tokens", "Generated token ids spliced back into prompts"),
    "record_waits": ("tokcache_vllm_record_waits",
                     "Tokenize calls that first waited for the previous turn's record"),
    "response_wait_timeouts": ("tokcache_vllm_response_wait_timeouts",
                               "Responses released before their records were answered"),
}


class MirroredCounter(Counter[str]):
    """A ``Counter`` that reports every increase of a key to a sink (a labelled prometheus counter).

    Increases made through item assignment (``c[key] += n``, ``update``) are
    reported; decreases are not (prometheus counters only go up). Event loop only.
    """

    _sink: Callable[[str, float], None] | None = None

    def __setitem__(self, key: str, value: int) -> None:
        delta = value - self.get(key, 0)
        super().__setitem__(key, value)
        sink = self._sink
        if sink is not None and delta > 0:
            sink(key, delta)


@dataclass
class PluginStats:
    """What the plugin did, since the process started. Keys are label values.

    - ``tokenize``: prompts the sidecar tokenized, by decision source (miss, l0, l1, ar)
    - ``fallbacks``: prompts vLLM tokenized itself, by reason
    - ``records``: recorded, refused (the output failed verification), failed (a store or transport
      error), in this process or by the sidecar; queued, dropped (queue full) for the sidecar's;
      trimmed (an unfinished trailing character's ids left out, see ``held_back_tokens``)
    - ``record_skips``: finished choices not sent, by reason (stop_string, not_served, ...)
    - ``pending``: records marked as on their way and prompts that waited for one (the
      in-process client's ``LocalStats.pending``: the same object)
    - ``paths``: prompts read in vLLM's process, by the read path that served them (native,
      python; the in-process client's ``LocalStats.paths``: the same object)
    - ``declines``: the python ones by why the native path left them to it (the in-process
      client's ``LocalStats.declines``: the same object)

    After :func:`install_prometheus`, increases of the counters and of the numbers
    named in ``_SCALARS`` are mirrored into prometheus metrics as they happen.
    """

    tokenize: Counter[str] = field(default_factory=MirroredCounter)
    served: Counter[str] = field(default_factory=MirroredCounter)
    fallbacks: Counter[str] = field(default_factory=MirroredCounter)
    records: Counter[str] = field(default_factory=MirroredCounter)
    record_skips: Counter[str] = field(default_factory=MirroredCounter)
    pending: Counter[str] = field(default_factory=MirroredCounter)  # the in-process client's, shared
    paths: Counter[str] = field(default_factory=MirroredCounter)  # the in-process client's, shared
    declines: Counter[str] = field(default_factory=MirroredCounter)  # the in-process client's, shared
    cached_tokens: int = 0
    ar_spliced_tokens: int = 0
    record_waits: int = 0
    # Responses that waited for their record (see PluginRuntime.wait_records): how many,
    # how many timed out, total seconds, and the most recent durations (for percentiles).
    response_waits: int = 0
    response_wait_timeouts: int = 0
    response_wait_seconds: float = 0.0
    recent_response_waits: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    # Time to produce each prompt's ids, by path (local / sidecar / vllm): the latest 4096.
    recent_tokenize: dict[str, deque[float]] = field(default_factory=dict)
    # Set by install_prometheus (object.__setattr__): not a field, so eq/repr/asdict ignore it.
    _mirror: ClassVar[_Mirror | None] = None

    def __setattr__(self, name: str, value: Any) -> None:
        mirror = self.__dict__.get("_mirror")
        if mirror is not None and name in _SCALARS:
            delta = value - getattr(self, name)
            object.__setattr__(self, name, value)
            if delta > 0:
                mirror.add(name, delta)
            return
        object.__setattr__(self, name, value)

    def observe_record_wait(self, seconds: float, *, timed_out: bool) -> None:
        """Count one response that waited ``seconds`` for its records."""
        self.response_waits += 1
        self.response_wait_timeouts += timed_out
        self.response_wait_seconds += seconds
        self.recent_response_waits.append(seconds)
        mirror = self._mirror
        if mirror is not None:
            mirror.observe_wait(seconds)

    def observe_tokenize(self, path: str, seconds: float) -> None:
        """Count the time one prompt's ids took on ``path`` (local, sidecar or vllm)."""
        self.recent_tokenize.setdefault(path, deque(maxlen=4096)).append(seconds)
        mirror = self._mirror
        if mirror is not None:
            mirror.observe_tokenize(path, seconds)

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy (for logs and tests)."""
        return {"tokenize": dict(self.tokenize), "served": dict(self.served), "paths": dict(self.paths),
                "declines": dict(self.declines), "fallbacks": dict(self.fallbacks),
                "records": dict(self.records), "record_skips": dict(self.record_skips),
                "cached_tokens": self.cached_tokens, "ar_spliced_tokens": self.ar_spliced_tokens,
                "record_waits": self.record_waits, "response_waits": self.response_waits,
                "response_wait_timeouts": self.response_wait_timeouts,
                "response_wait_seconds": self.response_wait_seconds}


class StatusLike(Protocol):
    """The link's state (``_link.LinkStatus``)."""

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


def _multiprocess() -> bool:
    # The test prometheus_client itself uses (values.get_value_class, MetricWrapperBase.remove).
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_multiproc_dir" in os.environ


class _Export:
    """The ``tokcache_vllm_*`` metrics of one registry (one per process in practice)."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter as PromCounter
        from prometheus_client import Gauge, Histogram

        self.registry = registry  # kept alive: _exports is keyed by its id
        self.mirrors: list[weakref.ref[_Mirror]] = []
        # Registered first, so a single-process scrape refreshes the gauges before reading them.
        registry.register(_ScrapeRefresh(self))
        self.families = {attr: PromCounter(name, doc, [label], registry=registry)
                         for attr, (name, doc, label, _) in _FAMILIES.items()}
        for attr, (_, _, _, shown) in _FAMILIES.items():
            for value in shown:
                self.families[attr].labels(value)
        self.scalars = {attr: PromCounter(name, doc, registry=registry) for attr, (name, doc) in _SCALARS.items()}
        self.response_wait = Histogram("tokcache_vllm_response_wait_seconds",
                                       "Seconds a finishing response waited for its records: stored in this "
                                       "process, or answered by the sidecar", buckets=RESPONSE_WAIT_BUCKETS,
                                       registry=registry)
        self.tokenize_time = Histogram("tokcache_vllm_tokenize_seconds",
                                       "Seconds to produce a prompt's ids, by path: local (in this process from "
                                       "shared memory), sidecar (Tokenize RPC), vllm (vLLM's own tokenizer)",
                                       ["path"], buckets=TOKENIZE_BUCKETS, registry=registry)
        self.breaker_opens = PromCounter("tokcache_vllm_breaker_opens", "Times the circuit breaker opened",
                                         registry=registry)
        self.breaker_state = Gauge("tokcache_vllm_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open "
                                   "(the worst of the live API server processes)", registry=registry,
                                   multiprocess_mode="livemax")
        self.sidecar_info = Gauge("tokcache_vllm_sidecar_info", "1, labelled with the sidecar model in use, the "
                                  "handshake state and vLLM's tokenizer fingerprint",
                                  ["model", "handshake", "fingerprint"], registry=registry,
                                  multiprocess_mode="livemax")

    def refresh_all(self) -> None:
        for ref in list(self.mirrors):
            mirror = ref()
            if mirror is not None:
                mirror.refresh()


class _ScrapeRefresh:
    """An unchecked collector that yields nothing: it refreshes the gauges when a scrape starts."""

    def __init__(self, export: _Export) -> None:
        self._export = weakref.ref(export)

    def collect(self) -> Iterator[Any]:
        export = self._export()
        if export is not None:
            export.refresh_all()
        return iter(())

    def describe(self) -> list[Any]:
        return []


class _Mirror:
    """Copies one PluginStats's increases into an :class:`_Export`. Never raises into the caller."""

    def __init__(self, export: _Export, status: Callable[[], StatusLike]) -> None:
        self.export = export
        self.status = status
        self._breaker: int | None = None
        self._opens = 0
        self._info: tuple[str, str, str] | None = None
        self._refreshing = False  # status() may count something itself: no re-entry
        self._failed = False

    def _failure(self) -> None:
        if not self._failed:  # once: a broken export must not flood vLLM's log
            self._failed = True
            log.exception("tokcache: updating metrics failed (further failures not logged)")

    def count(self, attr: str, key: str, delta: float) -> None:
        try:
            self.export.families[attr].labels(key).inc(delta)
        except Exception:
            self._failure()
        self.refresh()

    def add(self, attr: str, delta: float) -> None:
        try:
            self.export.scalars[attr].inc(delta)
        except Exception:
            self._failure()
        self.refresh()

    def observe_wait(self, seconds: float) -> None:
        try:
            self.export.response_wait.observe(seconds)
        except Exception:
            self._failure()

    def observe_tokenize(self, path: str, seconds: float) -> None:
        try:
            self.export.tokenize_time.labels(path).observe(seconds)
        except Exception:
            self._failure()

    def refresh(self) -> None:
        """Set the gauges and breaker_opens from ``status()`` (only what changed)."""
        if self._refreshing:
            return
        self._refreshing = True
        try:
            st = self.status()
            breaker = BREAKER_STATES.get(st.breaker, -1)
            if breaker != self._breaker:
                self.export.breaker_state.set(breaker)
                self._breaker = breaker
            if st.breaker_opens > self._opens:
                self.export.breaker_opens.inc(st.breaker_opens - self._opens)
                self._opens = st.breaker_opens
            info = (st.model, st.handshake, st.fingerprint)
            if info != self._info:
                old, self._info = self._info, info
                self.export.sidecar_info.labels(*info).set(1)
                if old is not None:
                    self.export.sidecar_info.labels(*old).set(0)
                    if not _multiprocess():  # a multiprocess file keeps the series; 0 says "not any more"
                        self.export.sidecar_info.remove(*old)
        except Exception:
            self._failure()
        finally:
            self._refreshing = False


_exports: dict[int, _Export] = {}  # id(registry) -> its metrics; the _Export keeps the registry alive


def install_prometheus(stats: PluginStats, status: Callable[[], StatusLike], *, registry: Any = None) -> bool:
    """Export ``stats`` as ``tokcache_vllm_*`` metrics; False if not possible (never raises).

    ``registry``: prometheus_client's default ``REGISTRY`` unless given (tests).
    The metrics are created once per registry; binding the same ``stats`` again
    is a no-op. Counts made before binding are carried over (durations of
    response waits: the last 4096). ``status()`` is called on the event loop
    after plugin events and at single-process scrapes. Event loop only.
    """
    if stats._mirror is not None:
        return True
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return False
    reg = REGISTRY if registry is None else registry
    try:
        export = _exports.get(id(reg))
        if export is None:
            export = _exports[id(reg)] = _Export(reg)
        mirror = _Mirror(export, status)
        for attr in _FAMILIES:
            counter = getattr(stats, attr)
            for key, n in counter.items():
                if n > 0:
                    export.families[attr].labels(key).inc(n)
            if isinstance(counter, MirroredCounter):
                counter._sink = lambda key, delta, attr=attr: mirror.count(attr, key, delta)
            else:
                log.warning("tokcache: stats.%s is a plain Counter; its increases are not exported", attr)
        for attr in _SCALARS:
            n = getattr(stats, attr)
            if n > 0:
                export.scalars[attr].inc(n)
        for seconds in stats.recent_response_waits:
            export.response_wait.observe(seconds)
        for path, values in stats.recent_tokenize.items():
            for seconds in values:
                export.tokenize_time.labels(path).observe(seconds)
        object.__setattr__(stats, "_mirror", mirror)
        export.mirrors.append(weakref.ref(mirror))
        mirror.refresh()
    except Exception:
        log.exception("tokcache: could not register metrics")
        return False
    return True
