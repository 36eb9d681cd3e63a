"""What a segment holds and has done: kinds of entries, counters, sizes (shared by Store and StoreReader)."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from ._index import Index
from ._layout import (
    W_CONSOLIDATIONS,
    W_CORRUPT,
    W_EVICT_CAP,
    W_EVICT_PRESSURE,
    W_EVICT_TTL,
    W_EXPIRED,
    W_HEAD,
    W_HITS,
    W_INDEX_EVICTIONS,
    W_LOCK_PID,
    W_LOCK_RECOVERIES,
    W_MISSES,
    W_PUTS,
    W_RELEASED,
    W_TAIL,
)
from ._log import Log

__all__ = ["EVICTION_CAUSES", "Kind", "StoreStats", "resident_bytes", "stats_of"]

EVICTION_CAUSES: Final = ("cap", "ttl", "pressure")


class Kind(enum.IntEnum):
    """What an entry holds; each kind may have its own TTL."""

    L0 = 1  # exact text
    L1 = 2  # text prefix at a safe boundary
    AR = 3  # recorded model output


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of one segment. Counters are shared by every process using it.

    ``hits``/``misses``/``expired``/``corrupt`` are bumped by readers without a lock and may
    lose concurrent increments; the writer counters are exact. ``expired`` and ``corrupt``
    are the misses caused by a passed TTL and by failed verification (``corrupt`` also
    counts log resets after a stray write). Records dropped off the log are counted by
    cause: ``evictions`` to make room within the segment (the byte cap),
    ``ttl_evictions`` swept because every key in them expired, ``pressure_evictions`` to
    stay under the soft cap memory pressure set; ``evictions_by_cause`` maps "cap",
    "ttl", "pressure" to the same three. ``index_evictions`` counts live slots displaced
    from full buckets. ``live_entries``
    counts unexpired slots pointing into the live log (extrapolated from a sample of
    buckets on large segments; a slot whose chain lost a link still counts).
    ``soft_cap`` is the arena bytes writers may use now (``arena_bytes`` without memory
    pressure); ``resident_bytes`` the segment's pages actually allocated in tmpfs (what
    counts against a memory limit), ``released_bytes`` the arena bytes given back so far.
    ``id_bytes`` is the width each id is stored in (3 or 4).
    """

    capacity: int
    arena_bytes: int
    used_bytes: int
    index_slots: int
    live_entries: Mapping[Kind, int]
    hits: int
    misses: int
    puts: int
    evictions: int
    ttl_evictions: int
    pressure_evictions: int
    evictions_by_cause: Mapping[str, int]
    expired: int
    corrupt: int
    index_evictions: int
    consolidations: int
    lock_recoveries: int
    soft_cap: int
    resident_bytes: int
    released_bytes: int
    lock_holder_pid: int
    id_bytes: int

    def as_dict(self) -> dict[str, object]:
        """JSON-able form (kinds by name)."""
        out: dict[str, object] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name == "live_entries":
                value = {Kind(kind).name: n for kind, n in value.items()}
            elif isinstance(value, Mapping):
                value = dict(value)
            out[name] = value
        return out


def stats_of(words: memoryview, index: Index, log: Log, size: int, fd: int, now: float) -> StoreStats:
    """The StoreStats of a mapped segment (shared by Store and StoreReader)."""
    head, tail = words[W_HEAD], words[W_TAIL]
    live = index.live_entries(head, tail, now)
    by_cause = {"cap": words[W_EVICT_CAP], "ttl": words[W_EVICT_TTL], "pressure": words[W_EVICT_PRESSURE]}
    return StoreStats(
        capacity=size,
        arena_bytes=log.size,
        used_bytes=head - tail if 0 <= head - tail <= log.size else 0,
        index_slots=index.slots,
        live_entries=MappingProxyType({kind: live.get(kind, 0) for kind in Kind}),
        hits=words[W_HITS],
        misses=words[W_MISSES],
        puts=words[W_PUTS],
        evictions=by_cause["cap"],
        ttl_evictions=by_cause["ttl"],
        pressure_evictions=by_cause["pressure"],
        evictions_by_cause=MappingProxyType(by_cause),
        expired=words[W_EXPIRED],
        corrupt=words[W_CORRUPT],
        index_evictions=words[W_INDEX_EVICTIONS],
        consolidations=words[W_CONSOLIDATIONS],
        lock_recoveries=words[W_LOCK_RECOVERIES],
        soft_cap=log.cap(),
        resident_bytes=resident_bytes(fd),
        released_bytes=words[W_RELEASED],
        lock_holder_pid=words[W_LOCK_PID],
        id_bytes=log.id_bytes,
    )


def resident_bytes(fd: int) -> int:
    """Bytes of the segment file allocated in tmpfs now (charged to a memory cgroup)."""
    try:
        return os.fstat(fd).st_blocks * 512
    except OSError:
        return 0
