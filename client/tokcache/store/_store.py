"""Store: a crash-safe shared-memory map from 16-byte keys to token-id prefixes.

The facade over one segment (``_segment``): an index of keys (``_index``) pointing into a
log of records (``_log``), and the writer lock (``_lock``). Reads are lock-free and prove
every byte they return; any failure is a miss, wrong bytes are never returned.

Eviction is FIFO by construction (the log's tail) and approximately LRU by bytes on top:
a hit whose chain reaches into the oldest eighth of the log is copied forward as one
record (best effort, only if the lock is free right now), so touched prefixes outlive
untouched ones. Index buckets that fill up drop their least recently read slot.

TTLs are per kind, per key, fixed at put time: an expired key is never served, its index
slot is reused first, and records whose every key expired are swept off the tail (by
``put`` and :meth:`Store.sweep`). A chain lives as long as its oldest record: a hit whose
chain holds a record about to expire is copied forward too.

Ids are stored 3 bytes wide when the segment was created for a vocabulary that fits in
24 bits (``id_bytes``), else 4; the API always takes and returns packed LE uint32, and
converts at the boundary (``_layout.narrow``/``widen``, C-level slices).

Memory pressure: :meth:`Store.shrink` sets a soft cap in the shared header that every
writer honours, evicts down to it and gives the freed arena pages back to the kernel
(tmpfs pages count against a container's memory limit); :meth:`Store.set_soft_cap`
raises it again. Evictions are counted by cause (cap, ttl, pressure).
"""

from __future__ import annotations

import math
import mmap
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from . import _layout
from ._index import Index
from ._layout import (
    F_CONSOLIDATED,
    F_SEGMENT,
    HEADER_SIZE,
    KEY_SIZE,
    LSN_BITS,
    LSN_MASK,
    MAX_ENTRIES,
    MAX_ENTRY_START,
    PAGE,
    RECORD_ALIGN,
    RETIRED_MARK,
    U32_MAX,
    W_AR_PUTS,
    W_CONSOLIDATIONS,
    W_CORRUPT,
    W_EVICT_TTL,
    W_EXPIRED,
    W_HEAD,
    W_HITS,
    W_MARKS,
    W_MARKS_AT,
    W_MARKS_UNTIL,
    W_MISSES,
    W_PUTS,
    W_RELEASE_TAIL,
    W_RETIRED,
    W_SOFT_CAP,
    W_TAIL,
    ZERO_KEY,
    marks_may_live,
    narrow,
    widen,
)
from ._lock import DEFAULT_TIMEOUT, WriterLock
from ._log import CORRUPT, Entry, Known, Link, Log, RecordRef, Walk, effective_cap, min_soft_cap
from ._manifest import read_manifest, write_manifest
from ._names import segment_name
from ._segment import Segment, attach_existing, open_segment, unlink_segment
from ._stats import EVICTION_CAUSES, Kind, StoreStats, resident_bytes, stats_of
from .errors import FOREIGN_ERRORS, SegmentFull, StoreClosed, translate, translated

PutEntry = tuple[bytes, int] | tuple[bytes, int, Kind] | tuple[bytes, int, Kind, int]
"""A put's entry: (key, n), (key, n, kind) or (key, n, kind, start)."""

__all__ = ["EVICTION_CAUSES", "Kind", "Shrink", "Store", "StoreStats", "segment_name"]

CONSOLIDATE_DEPTH: Final = 1024  # a hit this deep is rewritten as one record
# Under a soft cap, free arena pages are given back each time tail has moved this far
# (or an eighth of the cap, if larger): one madvise per batch, not per put.
RELEASE_BATCH: Final = 64 * PAGE


class _Prepared(NamedTuple):
    """A put checked and converted outside the lock (Store._prepare)."""

    parent: bytes | None
    parent_tokens: int
    stored: bytes  # ids in the segment's width
    items: list[Entry]
    kind: Kind
    flags: int
    size: int
    record_expiry: int
    ar: bool  # it puts an AR entry
    now: float


class Shrink(NamedTuple):
    """What :meth:`Store.shrink` did: live log bytes and resident segment bytes, before and after."""

    used_before: int
    used_after: int
    resident_before: int
    resident_after: int


class Store:
    """A crash-safe key -> token-ids store in one POSIX shared-memory segment.

    Create with :meth:`open` (or :meth:`attach_readonly` for a reader that never writes).
    ``get`` is lock-free and safe from any number of threads and processes; ``put``,
    ``shrink``, ``set_soft_cap`` and ``sweep`` serialise writers through a cross-process
    lock. ``close`` must not race with other calls on the same instance. ``id_bytes`` is
    the width the segment stores ids in (3 or 4, from its header); callers never see it.
    """

    name: str
    attached_existing: bool
    size: int
    id_bytes: int

    def __init__(
        self,
        segment: Segment,
        *,
        ttl: Mapping[Kind, float],
        clock: Callable[[], float],
        lock_timeout: float,
    ) -> None:
        """Wrap an open segment (use :meth:`open`). Takes ownership of ``segment``."""
        geometry = segment.geometry
        self.name = segment.name
        self.attached_existing = segment.attached_existing
        self.size = geometry.size
        self.id_bytes = segment.id_bytes
        self._segment = segment
        self._ttl = dict(ttl)
        self._clock = clock
        # A chain holding a record that expires this soon is copied forward on a hit.
        positive = [t for t in self._ttl.values() if t > 0]
        self._ttl_margin = min(positive) / 8 if positive else 0.0
        self._view = memoryview(segment.mm)
        self._header = self._view[:HEADER_SIZE]
        # Header u64 words: aligned 8-byte loads and stores, so head/tail never read torn.
        self._words = self._header.cast("Q")
        self._index = Index(segment.mm, geometry.index_off, geometry.n_buckets, self._words)
        self._log = Log(segment.mm, geometry.arena_off, geometry.arena_size, self._words, self.name, self.id_bytes,
                        fd=segment.fd)
        # A hit whose oldest link is this far behind head has < 1/8 of the log left to
        # live; recomputed when the soft cap word changes.
        self._soft_word = -1
        self._danger = 0
        try:
            self._lock = WriterLock(f"{segment.name}.lock", self._words, segment.fd, timeout=lock_timeout)
        except BaseException:
            self._release_views()
            raise
        self._mm: mmap.mmap | None = segment.mm

    @classmethod
    def open(
        cls,
        *,
        prefix: str,
        fingerprint: str,
        size: int,
        ttl: Mapping[Kind, float] | None = None,
        clock: Callable[[], float] | None = None,
        lock_timeout: float = DEFAULT_TIMEOUT,
        id_bytes: int = 4,
    ) -> Store:
        """Attach to segment ``<prefix>-<fingerprint>`` if valid, else (re)create it.

        Valid means: our magic and LAYOUT_VERSION, same fingerprint, same size, header
        check ok. Otherwise the segment is replaced by a new one of exactly ``size`` bytes
        (header + index + arena fit in it; the file never grows). ``fingerprint`` is 32 hex
        digits. ``ttl`` gives seconds per kind (missing or 0: no expiry). ``clock`` returns
        epoch seconds (tests inject one). ``lock_timeout`` bounds how long ``put`` waits for
        a live writer. ``id_bytes`` (3 or 4) is how wide a segment this call *creates*
        stores each id: 3 when every id of the tokenizer is < 2**24 (``id_bytes_for`` of
        its vocabulary size), saving a quarter of the ids' bytes. Re-attaching keeps the
        width in the segment's header whatever ``id_bytes`` says (same fingerprint: same
        vocabulary, and a 3-byte segment refuses ids that do not fit); see
        :attr:`id_bytes`. Raises ValueError for bad arguments and SegmentError on OS
        failures. Safe to call concurrently from several processes.
        """
        name = segment_name(prefix, fingerprint)
        ttls = _check_ttl(ttl)
        if lock_timeout <= 0:
            raise ValueError(f"lock_timeout must be > 0, got {lock_timeout}")
        _layout.geometry_for(size)  # ValueError before touching shared memory
        _layout.check_id_bytes(id_bytes)
        with translate(f"open {name}"):
            segment = open_segment(name, bytes.fromhex(fingerprint), size, id_bytes)
            try:
                return cls(segment, ttl=ttls, clock=clock or time.time, lock_timeout=lock_timeout)
            except BaseException:
                segment.close()
                raise

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        fingerprint: str | None = None,
        ttl: Mapping[Kind, float] | None = None,
        clock: Callable[[], float] | None = None,
        lock_timeout: float = DEFAULT_TIMEOUT,
    ) -> Store:
        """Open the existing segment called ``name`` ("/prefix-fingerprint") for writing, as it is.

        Unlike :meth:`open` it never creates, resizes or replaces a segment: for a process
        that writes into a segment someone else owns (a client storing what its reads
        learned). Raises SegmentError when there is no such segment or it may not be
        written (permissions), SegmentMismatch when it is not one this code can use.
        """
        ttls = _check_ttl(ttl)
        with translate(f"attach {name}"):
            segment = attach_existing(name, bytes.fromhex(fingerprint) if fingerprint else None, writable=True)
            try:
                return cls(segment, ttl=ttls, clock=clock or time.time, lock_timeout=lock_timeout)
            except BaseException:
                segment.close()
                raise

    # --- reads --------------------------------------------------------------------------

    def _live_slot(self, key: bytes) -> int | None:
        """``lsn_kind`` of ``key``'s slot if it is unexpired and points into the live log."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        if len(key) != KEY_SIZE or key == ZERO_KEY:
            raise ValueError("key must be 16 bytes, not all zero")
        soff = self._index.find(key)
        if soff < 0:
            return None
        lsn_kind, expiry, _ = self._index.read(soff)
        if expiry and self._clock() >= expiry:
            return None
        if lsn_kind & ((1 << LSN_BITS) - 1) < self._words[W_TAIL]:
            return None  # the record fell off the log: the slot is stale
        return int(lsn_kind)

    def slot(self, key: bytes) -> tuple[int, int] | None:
        """(record LSN, tail) of ``key``'s live, unexpired slot, or None — no record read.

        For a reader that already holds the record the slot names (by LSN: LSNs are never
        reused) and knows ``key`` is in it: the chain is live while ``tail`` is at or
        below the chain's floor. Lock-free; counts nothing.
        """
        lsn_kind = self._live_slot(key)
        if lsn_kind is None:
            return None
        return lsn_kind & LSN_MASK, int(self._words[W_TAIL])

    def probe(self, key: bytes) -> bool:
        """:meth:`contains` (the lookup's name for it; see ``StoreReader.probe``)."""
        return self._live_slot(key) is not None

    def last_present(self, keys: list[bytes], lo: int, hi: int) -> int:
        """The highest ``i`` in ``[lo, hi)`` for which :meth:`probe` of ``keys[i]`` is True, or
        -1: the same answer as probing from ``hi - 1`` down, in one call. The keys are the
        caller's own (16 bytes, from ``tokcache.store.keys``)."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        return self._index.last_live(keys, lo, hi, self._clock(), self._words[W_TAIL])

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` has a live, unexpired index slot — without reading its chain.

        A cheap probe for searching many candidate keys (the engine's longest-prefix
        search); a True may still be a miss for :meth:`get` (a chain link evicted or
        corrupt), never the reverse. Lock-free; counts nothing.
        """
        return self._live_slot(key) is not None

    def tail(self) -> int:
        """The log's tail now: records below it are evicted (a slot pointing under it is dead)."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        return int(self._words[W_TAIL])

    def native_region(self) -> tuple[Any, int, int] | None:
        """(mapping, index offset, buckets): the index as a native reader probes it, while this
        stays open (see ``tokcache/store/_index.h``)."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        return self._index.region()

    def holds_ar(self) -> bool:
        """Whether an AR record was ever put in this segment (lock-free, O(1)).

        False proves that no AR key is stored, so a reader may skip AR lookups.
        True stays True after those records are evicted: it only costs lookups.
        """
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        return self._words[W_AR_PUTS] > 0

    def marks(self) -> bool:
        """Whether a pending-record mark was ever put here (:meth:`mark`; lock-free, O(1))."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        return self._words[W_MARKS] > 0

    def marks_live(self, now: float) -> bool:
        """Whether a mark put here may be live at ``now`` (Unix s): :meth:`marks`, until every
        mark's expiry has passed (``_layout.marks_may_live``; lock-free, O(1))."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        return marks_may_live(self._words, now)

    def mark(self, key: bytes, expiry: int, *, lock_timeout: float | None = None) -> bool:
        """Map ``key`` to an empty record that expires at ``expiry`` (Unix seconds; a past
        second such as 1 withdraws an earlier mark): a *mark*, which says something about
        the text behind the key rather than holding ids for it (``tokcache.store.keys.pending_key``:
        a recorded output is on its way). Counted in W_MARKS before the key appears, so a
        reader that finds the counter 0 knows no mark exists. False when the store took
        nothing (a replaced segment). Takes the writer lock (LockTimeout as :meth:`put`).
        """
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        _check_key(key, "mark key")
        if not 0 < expiry <= U32_MAX:
            raise ValueError(f"expiry must be a Unix second in [1, {U32_MAX}], got {expiry}")
        size = _layout.record_size(1, 0)
        now = self._clock()
        bounds = self._begin_write(now, lock_timeout)
        try:
            if bounds is None:
                return False
            head, tail = bounds
            words = self._words
            words[W_MARKS] += 1
            words[W_MARKS_UNTIL] = max(words[W_MARKS_UNTIL], expiry)  # (see marks_live)
            words[W_MARKS_AT] = words[W_MARKS]
            self._append(head, tail, size, None, b"", [(key, 0, Kind.L1, expiry, 0)], Kind.L1, expiry, 0, now,
                         self._log.cap())
            words[W_PUTS] += 1
            return True
        finally:
            self._lock.release()

    def head(self) -> int:
        """The log's head (the LSN the next record is written at): where following it starts."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        return int(self._words[W_HEAD])

    def follow(self, cursor: int, *, flag: int = F_SEGMENT, limit: int = 4096) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Entries of the records put with ``flag`` since LSN ``cursor`` (0: the oldest live), at
        most ``limit`` records looked at per call: (the cursor to pass next, [(key, ids as
        packed LE uint32)]). Lock-free; see ``Log.follow``."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        return self._log.follow(cursor, flag, limit)

    def version(self, key: bytes) -> int | None:
        """An opaque token that changes whenever ``key``'s mapping does, or None if absent.

        It identifies the record the key's live slot points at (records are immutable
        and never reuse a position), so a caller that cached ``get(key)`` together with
        ``version(key)`` may reuse its copy while the version is unchanged. Lock-free.
        """
        return self._live_slot(key)

    def read(self, key: bytes, known: Known | None = None, *, widened: bool = True) -> Walk | None:
        """:meth:`get` for a reader that may already hold part of the chain.

        Decides hit or miss exactly like :meth:`get` (same slot, expiry, floor and tail
        checks), but stops walking at the first record ``known`` names (see
        ``Log.walk_known``); ``Walk.rest`` holds the ids after it as packed LE uint32.
        Counts and touches like :meth:`get`; a hit in danger of eviction is copied forward.
        ``widened`` False: ``Walk.rest`` as stored (``id_bytes`` per id), not packed u32.
        """
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        if len(key) != KEY_SIZE or key == ZERO_KEY:
            raise ValueError("key must be 16 bytes, not all zero")
        words = self._words
        soff = self._index.find(key)
        if soff < 0:
            words[W_MISSES] += 1
            return None
        lsn_kind, expiry, access = self._index.read(soff)
        now = self._clock()
        if expiry and now >= expiry:
            words[W_MISSES] += 1
            words[W_EXPIRED] += 1
            return None
        found = self._log.walk_known(key, lsn_kind, known)
        if isinstance(found, int):
            words[W_MISSES] += 1
            if found == CORRUPT:
                words[W_CORRUPT] += 1
            return None
        if found.key_expiry and now >= found.key_expiry:
            words[W_MISSES] += 1
            words[W_EXPIRED] += 1
            return None
        second = int(now) & U32_MAX
        if second != access:
            self._index.touch(soff, second)
        words[W_HITS] += 1
        if (words[W_HEAD] - found.oldest > self._danger_zone() or found.depth > CONSOLIDATE_DEPTH
                or (found.chain_expiry and now + self._ttl_margin >= found.chain_expiry)):
            whole = self._log.walk(key, lsn_kind) if found.held is not None else None
            if whole is None or not isinstance(whole, int):
                self._consolidate(key, lsn_kind, found.rest if whole is None else whole[0], found.key_expiry)
        return found._replace(rest=widen(found.rest, self.id_bytes)) if widened else found

    def get(self, key: bytes) -> bytes | None:
        """The ids stored for ``key``: the parent chain's ids then this entry's ids.

        Packed little-endian uint32, whatever the segment's id width. None when the key is
        absent, expired, or any link of its chain is missing, evicted or fails verification.
        Never returns bytes other than ones put for this key. Lock-free: never waits for a
        writer (it may copy a hit forward when its chain is about to be evicted or expire,
        but only if the lock is free). Raises ValueError for a key that is not 16 bytes or
        is all zero.
        """
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        if len(key) != KEY_SIZE or key == ZERO_KEY:
            raise ValueError("key must be 16 bytes, not all zero")
        words = self._words
        soff = self._index.find(key)
        if soff < 0:
            words[W_MISSES] += 1
            return None
        lsn_kind, expiry, access = self._index.read(soff)
        now = self._clock()
        if not expiry or now < expiry:
            found = self._log.walk(key, lsn_kind)
            if isinstance(found, int):
                words[W_MISSES] += 1
                if found == CORRUPT:
                    words[W_CORRUPT] += 1
                return None
            data, oldest, depth, expiry, chain_expiry = found
            if not expiry or now < expiry:  # the record's entry is the authority
                second = int(now) & U32_MAX
                if second != access:
                    self._index.touch(soff, second)
                words[W_HITS] += 1
                if (
                    words[W_HEAD] - oldest > self._danger_zone()
                    or depth > CONSOLIDATE_DEPTH
                    or (chain_expiry and now + self._ttl_margin >= chain_expiry)
                ):
                    self._consolidate(key, lsn_kind, data, expiry)
                return widen(data, self.id_bytes)
        words[W_MISSES] += 1
        words[W_EXPIRED] += 1
        return None

    def _danger_zone(self) -> int:
        soft = self._words[W_SOFT_CAP]
        if soft != self._soft_word:
            cap = effective_cap(soft, self._log.size)
            self._soft_word, self._danger = soft, cap - cap // 8
        return self._danger

    # --- writes -------------------------------------------------------------------------

    def put(
        self,
        parent: bytes | None,
        parent_tokens: int,
        ids: bytes,
        entries: Sequence[PutEntry],
        kind: Kind,
        *,
        lock_timeout: float | None = None,
        flags: int = 0,
    ) -> RecordRef | None:
        """Append one record of ``ids`` (packed LE uint32) continuing ``parent``'s prefix.

        The record's logical prefix is get(parent) (``parent_tokens`` tokens; no parent: 0)
        followed by ``ids``. Each (key, n) in ``entries`` (0 <= n <= len(ids)//4) then maps
        ``key`` to the parent's ids + the first n of ``ids``; many keys share the record,
        which keeps a growing conversation linear in memory. An entry may name its own
        kind as (key, n, kind) — its TTL then applies to that key — otherwise ``kind``
        applies; (key, n, kind, start) with ``start`` > 0, in a record without ``parent``, maps
        ``key`` to ``ids[start:n]`` alone (a recorded output's segment variants share its
        ids). A key listed twice keeps its last n. Re-putting a key replaces its mapping.

        Returns the new record (a RecordRef: its identity, base and own ids, for a reader
        memo; always truthy) — or None and stores nothing when the record is bigger than the arena, when
        ``parent`` is not (or no longer) stored with exactly ``parent_tokens`` tokens, when
        an id of ``ids`` does not fit the segment's width (>= 2**24 with ``id_bytes`` 3:
        never truncated, never an error), or when the segment was replaced under this Store.
        The parent is bound by its record, not its key: re-putting the parent key later does
        not change this record's prefix. An expired parent still serves as a prefix. Takes
        the writer lock; raises LockTimeout when a live writer keeps it longer than
        ``lock_timeout`` (default: the store's), SegmentFull (nothing stored) when the tmpfs cannot allocate the
        pages the record goes to even after evicting to give some back, ValueError for bad
        arguments. ``flags``: F_SEGMENT or 0 (the log's own flags are set here).
        """
        prepared = self._prepare(parent, parent_tokens, ids, entries, kind, flags)
        if prepared is None:
            return None
        bounds = self._begin_write(prepared.now, lock_timeout)
        try:
            return None if bounds is None else self._put_prepared(prepared, bounds)
        finally:
            self._lock.release()

    def put_many(
        self,
        records: Sequence[tuple[bytes | None, int, bytes, Sequence[PutEntry],
                                Kind, int]],
        *,
        lock_timeout: float | None = None,
    ) -> list[RecordRef | None]:
        """:meth:`put` of each (parent, parent_tokens, ids, entries, kind, flags), in order,
        under one taking of the writer lock: a recorded output's chain and its segment
        records. The same result per record as :meth:`put`'s (None: that one was refused);
        the same errors, raised before anything is stored for a bad argument."""
        if not records:
            return []
        prepared = [self._prepare(*r) for r in records]
        now = max((p.now for p in prepared if p is not None), default=self._clock())
        bounds = self._begin_write(now, lock_timeout)
        out: list[RecordRef | None] = []
        try:
            if bounds is None:
                return [None] * len(records)
            head, tail = bounds
            for p in prepared:
                ref = None if p is None else self._put_prepared(p, (head, tail))
                out.append(ref)
                if ref is not None:  # the next record goes after this one
                    head, tail = int(self._words[W_HEAD]), int(self._words[W_TAIL])
            return out
        finally:
            self._lock.release()

    def _prepare(self, parent: bytes | None, parent_tokens: int, ids: bytes,
                 entries: Sequence[PutEntry], kind: Kind,
                 flags: int) -> _Prepared | None:
        """A put's arguments checked and converted, outside the lock; None when the record
        cannot be stored (an id too wide for the segment, bigger than the arena)."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        kind = kind if type(kind) is Kind else Kind(kind)
        if len(ids) % 4:
            raise ValueError(f"ids must be packed uint32 (len % 4 == 0), got {len(ids)} bytes")
        n_ids = len(ids) // 4
        width = self.id_bytes
        if parent is None:
            if parent_tokens != 0:
                raise ValueError("parent_tokens must be 0 when parent is None")
        else:
            _check_key(parent, "parent")
            if parent_tokens < 0:
                raise ValueError(f"parent_tokens must be >= 0, got {parent_tokens}")
        if parent_tokens + n_ids > U32_MAX:
            raise ValueError("more than 2**32 - 1 tokens")
        mapping: dict[bytes, tuple[int, Kind, int]] = {}
        for entry in entries:  # (the checks inlined: ~10 keys per record)
            key, n = entry[0], entry[1]
            if len(key) != KEY_SIZE or key == ZERO_KEY:
                raise ValueError("entry key must be 16 bytes, not all zero")
            if not 0 <= n <= n_ids:
                raise ValueError(f"entry n must be in [0, {n_ids}], got {n}")
            start = entry[3] if len(entry) > 3 else 0
            if start and not (parent is None and 0 < start < n and start <= MAX_ENTRY_START):
                raise ValueError(f"entry start must be in [1, n) in a record without parent, got {start}")
            k = kind if len(entry) == 2 else entry[2]
            mapping[key] = (n, k if type(k) is Kind else Kind(k), start)
        if not mapping:
            raise ValueError("entries must not be empty")
        if len(mapping) > MAX_ENTRIES:
            raise ValueError(f"at most {MAX_ENTRIES} entries per record")
        if flags & ~F_SEGMENT:
            raise ValueError(f"flags must be F_SEGMENT or 0, got {flags}")
        stored = narrow(ids, width)  # before the lock: the conversion is O(n)
        if stored is None:
            return None
        size = _layout.record_size(len(mapping), len(stored))
        if size > self._log.size:
            return None
        now = self._clock()
        expiry_of: dict[Kind, int] = {}  # the entries' kinds: their expiries
        items: list[Entry] = []
        for key, (n, k, start) in mapping.items():
            e = expiry_of.get(k)
            if e is None:
                e = expiry_of[k] = self._expiry(k, now)
            items.append((key, n, k, e, start))
        expiries = expiry_of.values()
        record_expiry = 0 if 0 in expiries else max(expiries)
        return _Prepared(parent, parent_tokens, stored, items, kind, flags, size, record_expiry,
                         kind == Kind.AR or Kind.AR in expiry_of, now)

    def _put_prepared(self, p: _Prepared, bounds: tuple[int, int]) -> RecordRef | None:
        """Append a prepared record at ``bounds`` (head, tail). Lock held."""
        head, tail = bounds
        cap = self._log.cap()
        link: Link | None = None
        stored, items, size = p.stored, p.items, p.size
        parent, parent_tokens = p.parent, p.parent_tokens
        if parent is not None:
            lsn_kind = self._index.lookup(parent)
            found = None if lsn_kind < 0 else self._log.parent(lsn_kind, parent, parent_tokens, head, tail)
            if found is None:
                return None
            if found.floor >= self._log.needed(head, size, cap):
                link = Link(found.lsn, found.check, found.n, parent_tokens, found.size, found.floor)
            else:
                # This very append would evict the start of the parent's chain and
                # leave the record unreadable: store the whole prefix inline instead.
                walked = self._log.walk(parent, lsn_kind)  # stored ids: no conversion
                if isinstance(walked, int) or len(walked[0]) != self.id_bytes * parent_tokens:
                    return None
                stored = walked[0] + stored
                items = [(key, n + parent_tokens, k, e, 0) for key, n, k, e, _start in items]
                size = _layout.record_size(len(items), len(stored))
                if size > self._log.size:
                    return None
        if p.ar:
            # Before the keys appear: a reader that sees an AR key also sees this.
            self._words[W_AR_PUTS] += 1
        ref = self._append(head, tail, size, link, stored, items, p.kind, p.record_expiry, p.flags, p.now, cap)
        self._words[W_PUTS] += 1
        return ref

    def _begin_write(self, now: float, lock_timeout: float | None) -> tuple[int, int] | None:
        """Take the writer lock, then (head, tail) after sweeping expired records off the
        tail, or None when the segment was retired (write nothing). The caller releases the
        lock, whatever this returns; on an exception it is not held. LockTimeout as :meth:`put`.
        (A try / finally in the caller, not a context manager: a put's ~10 us less of
        interpreter work when its caches are cold.)"""
        try:
            self._lock.acquire(lock_timeout)
        except FOREIGN_ERRORS as exc:
            raise translated(f"lock {self.name}", exc) from exc
        try:
            if self._words[W_RETIRED] == RETIRED_MARK:
                return None
            head, tail = self._log.bounds()
            return head, self._log.sweep(head, tail, now)
        except BaseException:
            self._lock.release()
            raise

    def _expiry(self, kind: Kind, now: float) -> int:
        ttl = self._ttl.get(kind, 0.0)
        return min(math.ceil(now + ttl), U32_MAX) if ttl > 0 else 0

    def _consolidate(self, key: bytes, lsn_kind: int, data: bytes, expiry: int) -> None:
        """Copy a hit's whole prefix (``data``: stored ids) forward as one record and repoint
        ``key`` (best effort)."""
        size = _layout.record_size(1, len(data))
        if size > self._log.size // 2 or not self._lock.try_acquire():
            return
        try:
            if self._words[W_RETIRED] == RETIRED_MARK or self._index.lookup(key) != lsn_kind:
                return  # replaced segment, or key re-put since we read it: newer wins
            head, tail = self._log.bounds()
            kind = lsn_kind >> LSN_BITS
            entries: list[Entry] = [(key, len(data) // self.id_bytes, kind, expiry, 0)]
            now = self._clock()
            cap = self._log.cap()
            try:
                self._append(head, tail, size, None, data, entries, kind, expiry, F_CONSOLIDATED, now, cap)
            except SegmentFull:
                return  # a full tmpfs: the hit was served, the copy is only an optimisation
            self._words[W_CONSOLIDATIONS] += 1
        finally:
            self._lock.release()

    def _append(
        self,
        head: int,
        tail: int,
        size: int,
        link: Link | None,
        ids: bytes,
        entries: list[Entry],
        kind: int,
        expiry: int,
        flags: int,
        now: float,
        cap: int,
    ) -> RecordRef:
        """Write the record (``ids``: stored ids), then point every entry's key at it;
        under a soft cap, give back the pages tail left behind (in batches). Lock held.
        Returns the record's identity."""
        lsn, tail, head = self._append_backed(head, tail, size, link, ids, entries, kind, expiry, flags, cap)
        ref = RecordRef(lsn, self._log.check_at(lsn), link.base if link is not None else 0, len(ids) // self.id_bytes,
                        link.floor if link is not None else lsn)
        self._index.set_all(entries, lsn, int(now) & U32_MAX, tail, head, now)
        if cap < self._log.size:
            released_at = self._words[W_RELEASE_TAIL]
            if tail - released_at >= max(RELEASE_BATCH, cap // 8) or released_at > tail:
                self._log.release(head, tail)
        return ref

    def _append_backed(
        self,
        head: int,
        tail: int,
        size: int,
        link: Link | None,
        ids: bytes,
        entries: list[Entry],
        kind: int,
        expiry: int,
        flags: int,
        cap: int,
    ) -> tuple[int, int, int]:
        """``Log.append``, making room in the tmpfs when it is full. Lock held.

        The pages a record goes to may have been given back (soft cap, ``shrink``) and the
        tmpfs filled by another process since: then evict a record's worth of bytes (and a
        few pages) from tail as pressure evictions, never the start of ``link``'s chain,
        give their pages back and try once more. SegmentFull when that is not enough (the
        space went elsewhere again, or there was not that much to evict); nothing is
        written then, the evicted records stay evicted and their pages are free.
        """
        try:
            return self._log.append(head, tail, size, link, ids, entries, kind, expiry, flags, cap)
        except SegmentFull:
            target = max(0, head - tail - size - 4 * PAGE)
            if link is not None:
                target = max(target, head - link.floor)
            tail = self._log.evict_to(head, tail, target)
            self._log.release(head, tail)
        return self._log.append(head, tail, size, link, ids, entries, kind, expiry, flags, cap)

    # --- memory pressure and maintenance ------------------------------------------------

    def shrink(self, target_bytes: int, *, timeout: float | None = None) -> Shrink:
        """Hold the live log to ``target_bytes``: soft cap, evict, give pages back.

        Sets the shared soft cap (every writer process honours it until
        :meth:`set_soft_cap` raises it), evicts the oldest records beyond it (counted as
        pressure evictions) and punches the arena pages outside the live log out of the
        tmpfs file (``madvise(MADV_REMOVE)``), so ``resident_bytes`` drops. The soft cap
        has a floor (1/64 of the arena); the index pages stay resident. Idempotent. Takes
        the writer lock (LockTimeout after ``timeout`` or the store's lock timeout).
        """
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        target = self._soft_cap_value(target_bytes)
        resident_before = self.resident_bytes()
        self._acquire(timeout)
        try:
            head, tail = self._log.bounds()
            used_before = head - tail
            self._words[W_SOFT_CAP] = target
            tail = self._log.sweep(head, tail, self._clock())
            tail = self._log.evict_to(head, tail, effective_cap(target, self._log.size))
            try:
                self._log.release(head, tail)
            except FOREIGN_ERRORS as exc:  # madvise: the soft cap and evictions stand
                raise translated(f"shrink {self.name}", exc) from exc
            used_after = head - tail
        finally:
            self._lock.release()
        return Shrink(used_before, used_after, resident_before, self.resident_bytes())

    def set_soft_cap(self, limit_bytes: int | None, *, timeout: float | None = None) -> int:
        """Let writers use ``limit_bytes`` of the arena (None: all of it); returns the cap in force.

        Raising the cap lets the cache grow back as new records arrive; lowering it only
        takes effect on the next puts (use :meth:`shrink` to evict and release at once).
        Takes the writer lock.
        """
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        value = 0 if limit_bytes is None else self._soft_cap_value(limit_bytes)
        self._acquire(timeout)
        try:
            self._words[W_SOFT_CAP] = value
        finally:
            self._lock.release()
        return effective_cap(value, self._log.size)

    @property
    def arena_bytes(self) -> int:
        """Bytes of the log region (the segment less header and index)."""
        return self._log.size

    @property
    def used_bytes(self) -> int:
        """Bytes the live log spans now (cheap: two header words)."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        used = self._words[W_HEAD] - self._words[W_TAIL]
        return used if 0 <= used <= self._log.size else 0

    @property
    def soft_cap(self) -> int:
        """The arena bytes writers may use now (``arena_bytes`` when no soft cap is set)."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        return self._log.cap()

    def sweep(self) -> int:
        """Reclaim records at the tail whose keys all expired; under a soft cap, also give
        free pages back. Returns the records swept. Never waits: a busy lock means a writer
        is at it, and returns 0. Meant for a periodic maintenance tick (puts sweep too).
        """
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        if not self._lock.try_acquire():
            return 0
        try:
            if self._words[W_RETIRED] == RETIRED_MARK:
                return 0
            before = self._words[W_EVICT_TTL]
            head, tail = self._log.bounds()
            tail = self._log.sweep(head, tail, self._clock())
            if self._log.cap() < self._log.size and self._words[W_RELEASE_TAIL] != tail:
                self._log.release(head, tail)
            return int(self._words[W_EVICT_TTL] - before)
        finally:
            self._lock.release()

    def resident_bytes(self) -> int:
        """Bytes of the segment allocated in tmpfs now (charged to a memory cgroup)."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        return resident_bytes(self._segment.fd)

    def _soft_cap_value(self, limit: int) -> int:
        if limit < 0:
            raise ValueError(f"soft cap must be >= 0 bytes, got {limit}")
        floor = min_soft_cap(self._log.size)
        return min(max(limit, floor), self._log.size) // RECORD_ALIGN * RECORD_ALIGN

    def _acquire(self, timeout: float | None) -> None:
        try:
            self._lock.acquire(timeout)
        except FOREIGN_ERRORS as exc:
            raise translated(f"lock {self.name}", exc) from exc

    # --- the manifest -------------------------------------------------------------------

    def publish(self, body: bytes, *, timeout: float | None = None) -> None:
        """Publish ``body`` as the segment's manifest (replacing any). Takes the writer lock.

        ValueError when it is larger than ``MANIFEST_MAX``; LockTimeout as :meth:`put`.
        """
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        self._acquire(timeout)
        try:
            write_manifest(self._segment.mm, body)
        finally:
            self._lock.release()

    def manifest(self) -> bytes | None:
        """The published manifest bytes, or None (lock-free)."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        return read_manifest(self._segment.mm)

    @property
    def generation(self) -> int:
        """The segment's random identity, fixed at creation (another segment under the same
        name has another one)."""
        return self._segment.generation

    # --- introspection and lifetime -----------------------------------------------------

    @property
    def replaced(self) -> bool:
        """True once another opener replaced this segment: reopen to write again."""
        return self._mm is not None and self._words[W_RETIRED] == RETIRED_MARK

    def stats(self) -> StoreStats:
        """A snapshot of sizes and the shared counters (see :class:`StoreStats`)."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        return stats_of(self._words, self._index, self._log, self.size, self._segment.fd, self._clock())

    def close(self) -> None:
        """Unmap the segment and drop the lock handle. Idempotent; the segment stays."""
        if self._mm is None:
            return
        self._mm = None
        self._lock.close()
        self._release_views()
        self._segment.close()

    def unlink(self) -> None:
        """Remove the segment name and the lock semaphore. Idempotent.

        Mappings stay valid until closed. Only for when every user is going away: a process
        still attached keeps the old semaphore while a new opener would create another.
        """
        with translate(f"unlink {self.name}"):
            unlink_segment(self.name, self._segment.inode)
            self._lock.unlink()

    def _release_views(self) -> None:
        self._words.release()
        self._header.release()
        self._view.release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else f"{self.size} bytes"
        return f"<Store {self.name} {state}>"


def _check_key(key: bytes, what: str) -> None:
    if len(key) != KEY_SIZE or key == ZERO_KEY:
        raise ValueError(f"{what} must be 16 bytes, not all zero")


def _check_ttl(ttl: Mapping[Kind, float] | None) -> dict[Kind, float]:
    out: dict[Kind, float] = {}
    for kind, seconds in (ttl or {}).items():
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"ttl for {kind!r} must be finite and >= 0, got {seconds}")
        out[Kind(kind)] = float(seconds)
    return out
