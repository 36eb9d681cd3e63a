"""Store: a crash-safe shared-memory map from 16-byte keys to token-id prefixes.

The facade over one segment (``_segment``): an index of keys (``_index``) pointing into a
log of records (``_log``), and the writer lock (``_lock``). Reads are lock-free and prove
every byte they return; any failure is a miss, wrong bytes are never returned.

Eviction is FIFO by construction (the log's tail) and approximately LRU by bytes on top:
a hit whose chain reaches into the oldest eighth of the arena is copied forward as one
record (best effort, only if the lock is free right now), so touched prefixes outlive
untouched ones. Index buckets that fill up drop their least recently read slot. TTLs are
per kind and fixed at put time.
"""

from __future__ import annotations

import enum
import math
import mmap
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from . import _layout
from ._index import Index
from ._layout import (
    F_CONSOLIDATED,
    HEADER_SIZE,
    KEY_SIZE,
    LSN_BITS,
    MAX_ENTRIES,
    RETIRED_MARK,
    U32_MAX,
    W_CONSOLIDATIONS,
    W_CORRUPT,
    W_EVICTIONS,
    W_EXPIRED,
    W_HEAD,
    W_HITS,
    W_INDEX_EVICTIONS,
    W_LOCK_RECOVERIES,
    W_MISSES,
    W_PUTS,
    W_RETIRED,
    W_TAIL,
    ZERO_KEY,
)
from ._lock import DEFAULT_TIMEOUT, WriterLock
from ._log import CORRUPT, Link, Log
from ._segment import Segment, open_segment, unlink_segment
from .errors import FOREIGN_ERRORS, StoreClosed, translate, translated

__all__ = ["Kind", "Store", "StoreStats", "segment_name"]

CONSOLIDATE_DEPTH: Final = 1024  # a hit this deep is rewritten as one record
_PREFIX_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_FINGERPRINT_RE: Final = re.compile(r"[0-9a-fA-F]{32}")


class Kind(enum.IntEnum):
    """What an entry holds; each kind may have its own TTL."""

    L0 = 1  # exact text
    L1 = 2  # text prefix at a safe boundary
    AR = 3  # recorded model output


def segment_name(prefix: str, fingerprint: str) -> str:
    """The POSIX shm name ``/<prefix>-<fingerprint>`` (fingerprint lower-cased).

    ``prefix``: 1-128 of ``[A-Za-z0-9._-]``, not starting with ``.``, ``_`` or ``-``.
    ``fingerprint``: 32 hex digits. Raises ValueError otherwise.
    """
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"prefix must match {_PREFIX_RE.pattern}, got {prefix!r}")
    if not _FINGERPRINT_RE.fullmatch(fingerprint):
        raise ValueError(f"fingerprint must be 32 hex digits, got {fingerprint!r}")
    return f"/{prefix}-{fingerprint.lower()}"


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of one segment. Counters are shared by every process using it.

    ``hits``/``misses``/``expired``/``corrupt`` are bumped by readers without a lock and may
    lose concurrent increments; the writer counters are exact. ``expired`` and ``corrupt``
    are the misses caused by a passed TTL and by failed verification (``corrupt`` also
    counts log resets after a stray write). ``evictions`` counts records dropped off the
    log, ``index_evictions`` live slots displaced from full buckets. ``live_entries``
    counts unexpired slots pointing into the live log (extrapolated from a sample of
    buckets on large segments; a slot whose chain lost a link still counts).
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
    expired: int
    corrupt: int
    index_evictions: int
    consolidations: int
    lock_recoveries: int


class Store:
    """A crash-safe key -> token-ids store in one POSIX shared-memory segment.

    Create with :meth:`open`. ``get`` is lock-free and safe from any number of threads and
    processes; ``put`` serialises writers through a cross-process lock. ``close`` must not
    race with other calls on the same instance.
    """

    name: str
    attached_existing: bool
    size: int

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
        self._segment = segment
        self._ttl = dict(ttl)
        self._clock = clock
        # A hit whose oldest link is this far behind head has < 1/8 arena left to live.
        self._danger = geometry.arena_size - geometry.arena_size // 8
        self._view = memoryview(segment.mm)
        self._header = self._view[:HEADER_SIZE]
        # Header u64 words: aligned 8-byte loads and stores, so head/tail never read torn.
        self._words = self._header.cast("Q")
        self._index = Index(segment.mm, geometry.index_off, geometry.n_buckets, self._words)
        self._log = Log(segment.mm, geometry.arena_off, geometry.arena_size, self._words, self.name)
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
    ) -> Store:
        """Attach to segment ``<prefix>-<fingerprint>`` if valid, else (re)create it.

        Valid means: our magic and LAYOUT_VERSION, same fingerprint, same size, header
        check ok. Otherwise the segment is replaced by a new one of exactly ``size`` bytes
        (header + index + arena fit in it; the file never grows). ``fingerprint`` is 32 hex
        digits. ``ttl`` gives seconds per kind (missing or 0: no expiry). ``clock`` returns
        epoch seconds (tests inject one). ``lock_timeout`` bounds how long ``put`` waits for
        a live writer. Raises ValueError for bad arguments and SegmentError on OS failures.
        Safe to call concurrently from several processes.
        """
        name = segment_name(prefix, fingerprint)
        ttls = _check_ttl(ttl)
        if lock_timeout <= 0:
            raise ValueError(f"lock_timeout must be > 0, got {lock_timeout}")
        _layout.geometry_for(size)  # ValueError before touching shared memory
        with translate(f"open {name}"):
            segment = open_segment(name, bytes.fromhex(fingerprint), size)
            try:
                return cls(segment, ttl=ttls, clock=clock or time.time, lock_timeout=lock_timeout)
            except BaseException:
                segment.close()
                raise

    # --- reads --------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The ids stored for ``key``: the parent chain's ids then this entry's ids.

        Packed little-endian uint32. None when the key is absent, expired, or any link of
        its chain is missing, evicted or fails verification. Never returns bytes other than
        ones put for this key. Lock-free: never waits for a writer (it may copy a hit
        forward when its chain is about to be evicted, but only if the lock is free).
        Raises ValueError for a key that is not 16 bytes or is all zero.
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
            data, oldest, depth, expiry = found
            if not expiry or now < expiry:  # the record's expiry is the authority
                second = int(now) & U32_MAX
                if second != access:
                    self._index.touch(soff, second)
                words[W_HITS] += 1
                if words[W_HEAD] - oldest > self._danger or depth > CONSOLIDATE_DEPTH:
                    self._consolidate(key, lsn_kind, data, expiry)
                return data
        words[W_MISSES] += 1
        words[W_EXPIRED] += 1
        return None

    # --- writes -------------------------------------------------------------------------

    def put(
        self,
        parent: bytes | None,
        parent_tokens: int,
        ids: bytes,
        entries: Sequence[tuple[bytes, int]],
        kind: Kind,
    ) -> bool:
        """Append one record of ``ids`` (packed LE uint32) continuing ``parent``'s prefix.

        The record's logical prefix is get(parent) (``parent_tokens`` tokens; no parent: 0)
        followed by ``ids``. Each (key, n) in ``entries`` (0 <= n <= len(ids)//4) then maps
        ``key`` to the parent's ids + the first n of ``ids``; many keys share the record,
        which keeps a growing conversation linear in memory. A key listed twice keeps its
        last n. Re-putting a key replaces its mapping.

        Returns False and stores nothing when the record is bigger than the arena, when
        ``parent`` is not (or no longer) stored with exactly ``parent_tokens`` tokens, or
        when the segment was replaced under this Store. The parent is bound by its record,
        not its key: re-putting the parent key later does not change this record's prefix.
        An expired parent still serves as a prefix. Takes the writer lock; raises
        LockTimeout when a live writer keeps it longer than ``lock_timeout``, ValueError for
        bad arguments.
        """
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        kind = Kind(kind)
        if len(ids) % 4:
            raise ValueError(f"ids must be packed uint32 (len % 4 == 0), got {len(ids)} bytes")
        n_ids = len(ids) // 4
        if parent is None:
            if parent_tokens != 0:
                raise ValueError("parent_tokens must be 0 when parent is None")
        else:
            _check_key(parent, "parent")
            if parent_tokens < 0:
                raise ValueError(f"parent_tokens must be >= 0, got {parent_tokens}")
        if parent_tokens + n_ids > U32_MAX:
            raise ValueError("more than 2**32 - 1 tokens")
        mapping: dict[bytes, int] = {}
        for key, n in entries:
            _check_key(key, "entry key")
            if not 0 <= n <= n_ids:
                raise ValueError(f"entry n must be in [0, {n_ids}], got {n}")
            mapping[key] = n
        if not mapping:
            raise ValueError("entries must not be empty")
        if len(mapping) > MAX_ENTRIES:
            raise ValueError(f"at most {MAX_ENTRIES} entries per record")
        items = list(mapping.items())
        size = _layout.record_size(len(items), len(ids))
        if size > self._log.size:
            return False
        now = self._clock()
        ttl = self._ttl.get(kind, 0.0)
        expiry = min(math.ceil(now + ttl), U32_MAX) if ttl > 0 else 0
        try:
            self._lock.acquire()
        except FOREIGN_ERRORS as exc:
            raise translated(f"lock {self.name}", exc) from exc
        try:
            if self._words[W_RETIRED] == RETIRED_MARK:
                return False
            head, tail = self._log.bounds()
            link: Link | None = None
            if parent is not None:
                lsn_kind = self._index.lookup(parent)
                found = None if lsn_kind < 0 else self._log.parent(lsn_kind, parent, parent_tokens, head, tail)
                if found is None:
                    return False
                if found.floor >= self._log.needed(head, size):
                    link = Link(found.lsn, found.check, found.n, parent_tokens, found.size, found.floor)
                else:
                    # This very append would evict the start of the parent's chain and
                    # leave the record unreadable: store the whole prefix inline instead.
                    walked = self._log.walk(parent, lsn_kind)
                    if isinstance(walked, int) or len(walked[0]) != 4 * parent_tokens:
                        return False
                    ids = walked[0] + ids
                    items = [(key, n + parent_tokens) for key, n in items]
                    size = _layout.record_size(len(items), len(ids))
                    if size > self._log.size:
                        return False
            self._append(head, tail, size, link, ids, items, kind, expiry, 0, now)
            self._words[W_PUTS] += 1
            return True
        finally:
            self._lock.release()

    def _consolidate(self, key: bytes, lsn_kind: int, data: bytes, expiry: int) -> None:
        """Copy a hit's whole prefix forward as one record and repoint ``key`` (best effort)."""
        size = _layout.record_size(1, len(data))
        if size > self._log.size // 2 or not self._lock.try_acquire():
            return
        try:
            if self._words[W_RETIRED] == RETIRED_MARK or self._index.lookup(key) != lsn_kind:
                return  # replaced segment, or key re-put since we read it: newer wins
            head, tail = self._log.bounds()
            entries = [(key, len(data) // 4)]
            kind = lsn_kind >> LSN_BITS
            self._append(head, tail, size, None, data, entries, kind, expiry, F_CONSOLIDATED, self._clock())
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
        entries: list[tuple[bytes, int]],
        kind: int,
        expiry: int,
        flags: int,
        now: float,
    ) -> None:
        """Write the record, then point every entry's key at it. Lock held."""
        lsn, tail, head = self._log.append(head, tail, size, link, ids, entries, kind, expiry, flags)
        lsn_kind = kind << LSN_BITS | lsn
        access = int(now) & U32_MAX
        for key, _n in entries:
            self._index.set(key, lsn_kind, expiry, access, tail, head, now)

    # --- introspection and lifetime -----------------------------------------------------

    @property
    def replaced(self) -> bool:
        """True once another opener replaced this segment: reopen to write again."""
        return self._mm is not None and self._words[W_RETIRED] == RETIRED_MARK

    def stats(self) -> StoreStats:
        """A snapshot of sizes and the shared counters (see :class:`StoreStats`)."""
        if self._mm is None:
            raise StoreClosed(f"{self.name} is closed")
        words = self._words
        head, tail = words[W_HEAD], words[W_TAIL]
        live = self._index.live_entries(head, tail, self._clock())
        return StoreStats(
            capacity=self.size,
            arena_bytes=self._log.size,
            used_bytes=head - tail if 0 <= head - tail <= self._log.size else 0,
            index_slots=self._index.slots,
            live_entries=MappingProxyType({kind: live.get(kind, 0) for kind in Kind}),
            hits=words[W_HITS],
            misses=words[W_MISSES],
            puts=words[W_PUTS],
            evictions=words[W_EVICTIONS],
            expired=words[W_EXPIRED],
            corrupt=words[W_CORRUPT],
            index_evictions=words[W_INDEX_EVICTIONS],
            consolidations=words[W_CONSOLIDATIONS],
            lock_recoveries=words[W_LOCK_RECOVERIES],
        )

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
