"""A per-process memo of chains this process has read or written, by record identity.

Reading a long chain out of shared memory (copy + verify every record, widen, build the
ids) is the largest cost of a warm lookup: ~120 µs for 16k ids as bytes, ~5 ms for 272k
ids as a Python list. The records a process just wrote or read are the ones its next
request for the same conversation walks through, so it keeps their ids, keyed by the
record's identity ``(lsn, check prefix)``: records are immutable and that pair names one
for ever, so an entry never goes stale — it only becomes useless once the record is
evicted, and the LRU drops it. ``Log.walk_known`` asks :meth:`ChainMemo.known` at each
record and stops at the first one held; whether a lookup hits never depends on the memo.

An entry is ``(container, base, n)``: ``container[:base + n]`` are the chain's ids up to
the record's first ``n`` own ids (see :mod:`tokcache.engine.ids` for containers).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Generic

from tokcache.engine.ids import IdFormat, Ids
from tokcache.store import RecordRef

__all__ = ["DEFAULT_MEMO_IDS", "ChainMemo"]

DEFAULT_MEMO_IDS = 8 << 20  # ids referenced at most (shared containers count once per entry)


class ChainMemo(Generic[Ids]):
    """LRU by ids; thread-safe (one lock guards the dicts and the count).

    Besides the chain, an entry may know some of the record's keys and how many of its
    ids each uses (the keys this process wrote it with, or read it by): a lookup of such
    a key whose index slot names the record's LSN needs no read of shared memory at all
    (:meth:`held_key`). LSNs are never reused, and the record lists the key, so a slot
    naming that LSN for that key can only mean this record.
    """

    def __init__(self, fmt: IdFormat[Ids, Any], max_ids: int = DEFAULT_MEMO_IDS) -> None:
        self.fmt: IdFormat[Ids, Any] = fmt
        self._max = max_ids
        self._ids = 0
        # (lsn, check prefix) -> (container, base, n, floor, {key: n})
        self._entries: OrderedDict[tuple[int, bytes], tuple[Ids, int, int, int, dict[bytes, int]]] = OrderedDict()
        self._by_lsn: dict[int, tuple[int, bytes]] = {}
        self._lock = threading.Lock()

    def known(self, lsn: int, check: bytes) -> tuple[Ids, int, int] | None:
        """(container, base, n) for the record ``(lsn, check)``, or None (``Log.walk_known``)."""
        with self._lock:
            entry = self._entries.get((lsn, check))
            if entry is None:
                return None
            self._entries.move_to_end((lsn, check))
            return entry[0], entry[1], entry[2]

    def held_key(self, lsn: int, key: bytes) -> tuple[Ids, int, int] | None:
        """(container, tokens of ``key``'s ids, chain floor) when the record at ``lsn`` is held
        and is known to list ``key``; else None. ``_speedups.extend`` gives the same answer from
        :meth:`native_view` (its step 8): a rule changed here is changed there."""
        with self._lock:
            ident = self._by_lsn.get(lsn)
            if ident is None:
                return None
            container, base, n, floor, keys = self._entries[ident]
            used = keys.get(key)
            if used is None or used > n or floor < 0:
                return None
            self._entries.move_to_end(ident)
            return container, base + used, floor

    def native_view(self) -> tuple[dict[int, tuple[int, bytes]], dict[tuple[int, bytes], Any]]:
        """The two dicts :meth:`held_key` reads (LSN -> identity, identity -> entry), for the
        native fast path to read in place (``_speedups.extend``: the same answer and use mark,
        without a Python call: ~17 µs of a request whose caches are cold). Read only, under the
        GIL, without the lock: between two steps of :meth:`put` an identity or an entry may be
        missing (a miss: the Python path serves), never wrong, since an entry, once filed, is
        never changed (a new tuple and a new key dict replace it) and an identity names one
        record for ever. The same two objects for the memo's life."""
        return self._by_lsn, self._entries

    def put(self, ref: RecordRef, ids: Ids, keys: Mapping[bytes, int] | None = None) -> None:
        """Remember that ``ids[:ref.base + ref.n]`` is the chain through ``ref``, and that
        each of ``keys`` uses that many of the record's own ids.

        ``ids`` is never mutated (containers are immutable, see ``tokcache.engine.ids``).
        """
        size = ref.base + ref.n
        if size > self._max or self.fmt.count(ids) < size:
            return
        ident = (ref.lsn, ref.check)
        with self._lock:
            old = self._entries.pop(ident, None)
            known = dict(keys or {})
            if old is not None:
                self._ids -= old[1] + old[2]
                known = {**old[4], **known}
            self._entries[ident] = (ids, ref.base, ref.n, ref.floor, known)
            self._by_lsn[ref.lsn] = ident
            self._ids += size
            while self._ids > self._max:
                (lsn, _), (_, base, n, _, _) = self._entries.popitem(last=False)
                self._by_lsn.pop(lsn, None)
                self._ids -= base + n

    def __len__(self) -> int:
        return len(self._entries)
