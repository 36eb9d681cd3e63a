"""The arena: a circular log of immutable records, and chains of them.

Positions are LSNs, monotonic byte offsets (position = lsn % arena size); the live log is
``[tail, head)`` (header words W_TAIL, W_HEAD). Appending past the end advances tail, which
evicts everything below it at once: no per-record bookkeeping, nothing to repair after a
crash. Records never wrap; the writer pads to the start of the arena instead.

Writer order, under the writer lock: advance tail (evict) -> write the record -> publish
head -> (the caller) write index slots. A writer that dies at any step leaves only bytes
that nothing references yet.

A reader copies each record of a chain out of the segment file (``pread``, see below),
verifies it (magic, own LSN,
SHA-256 check, link to its parent), and only then re-reads tail. The writer moves tail past
a record before overwriting any of it, so a record still at or above tail after the copy
was not being overwritten during it: a torn copy always ends as a miss, and the checks
also turn any stray write into a miss.

Tail moves for three reasons, each counted: room for an append within the arena (cap),
room within the soft cap that memory pressure sets (pressure), and records at the tail
whose every key has expired (TTL sweep). Pages of the arena outside ``[tail, head)`` may
be given back to the kernel (``madvise(MADV_REMOVE)`` punches holes in the tmpfs file);
that happens after tail has moved past them, so a reader racing it sees zeros in a record
below tail, which is a miss like any other overwrite.

Holes must never be touched through the mapping: any fault on one allocates a page, and on
a full tmpfs that is SIGBUS, for a load as much as a store. So readers copy arena bytes
with ``pread`` (a hole reads as zeros, past the end of the file as nothing), and the writer
allocates (``posix_fallocate``) every page an append stores into, the pad gap included,
before it changes anything: every page holding a byte of ``[tail, head)`` is allocated,
and the writer reads the mapping only there. A full tmpfs then surfaces as SegmentFull.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

from tokcache import native

from ._layout import (
    CHECK_SIZE,
    ENTRY,
    ENTRY_SIZE,
    ENTRY_TAIL,
    F_HAS_PARENT,
    KEY_SIZE,
    LINK_CHECK_SIZE,
    LSN_BITS,
    LSN_MASK,
    LSN_SOFT_LIMIT,
    MAGIC_SIZE,
    MIN_RECORD,
    PAD_MAGIC,
    PAGE,
    RECORD,
    RECORD_EXPIRY_OFF,
    RECORD_LSN_OFF,
    RECORD_MAGIC,
    RECORD_MAGIC_OFF,
    RECORD_SIZE,
    RECORD_SIZE_OFF,
    U32,
    U64,
    W_CORRUPT,
    W_EVICT_CAP,
    W_EVICT_PRESSURE,
    W_EVICT_TTL,
    W_HEAD,
    W_RELEASE_TAIL,
    W_RELEASED,
    W_SOFT_CAP,
    W_TAIL,
    check_of,
    widen,
)
from ._segment import reserve
from .errors import SegmentError, SegmentFull

_native: Any = native.store()  # TOKCACHE_PURE_PYTHON=1: write_record's Python (the tests compare both)

__all__ = [
    "CORRUPT", "EVICTED", "MAX_CHAIN", "Chain", "Entry", "Known", "Link", "Log", "ParentRef", "RecordRef", "Walk",
]

log = logging.getLogger(__name__)

MAX_CHAIN: Final = 4096  # links a reader follows; a longer chain is treated as corrupt
# Why a walk failed.
EVICTED: Final = 1
CORRUPT: Final = 2

_ZERO_CHECK: Final = bytes(CHECK_SIZE)
_ZERO_LINK_CHECK: Final = bytes(LINK_CHECK_SIZE)

# Records the TTL sweep steps over per call: bounds the time a put spends on it.
SWEEP_STEPS: Final = 64

Chain = tuple[bytes, int, int, int, int]
"""A verified chain: (ids as stored, in the segment's width: ``_layout.widen`` makes them
u32; LSN of its oldest record; number of records; the key's expiry; the earliest expiry
among the records before the key's own (0: none expires))."""

Entry = tuple[bytes, int, int, int, int]
"""One key of a record being written: (key, ids of the record it uses, kind, expiry, start)."""

Known = Callable[[int, bytes], "tuple[Any, int, int] | None"]
"""What a reader holds: (LSN, check prefix) of a record -> (held ids, base, n), see walk_known."""


class RecordRef(NamedTuple):
    """One record's identity and the part of it a key (or a reader) uses.

    ``lsn`` and ``check`` (the first LINK_CHECK_SIZE bytes of its check) identify the record
    for ever (records are immutable and the check covers the LSN); ``base`` is the number
    of tokens before its own ids in its chain, ``n`` how many of its own ids are meant;
    ``floor`` the LSN of the chain's oldest record (the chain is readable while tail is
    at or below it; -1: unknown).
    """

    lsn: int
    check: bytes
    base: int
    n: int
    floor: int = -1


class Walk(NamedTuple):
    """A verified chain read by :meth:`Log.walk_known`.

    ``rest`` holds the stored ids after ``held_tokens`` (all of them when ``held`` is
    None); ``own`` is the key's own record (its ``n``: the ids the key uses of it), and
    ``keys`` every chain key that record holds with the ids of it each uses (a reader's memo
    then answers any of them without reading the record again).
    """

    rest: bytes
    oldest: int
    depth: int
    key_expiry: int
    chain_expiry: int
    own: RecordRef
    held: Any
    held_tokens: int
    keys: dict[bytes, int] = {}


class Link(NamedTuple):
    """The parent fields of a record header."""

    lsn: int
    check: bytes  # first LINK_CHECK_SIZE bytes of the parent's check
    n: int  # ids of the parent record in the prefix
    base: int  # tokens before this record's own ids
    size: int  # the parent record's size, so a reader copies it in one slice
    floor: int  # LSN of the chain's oldest record


class ParentRef(NamedTuple):
    """Where a parent key's prefix ends, as found by the writer under the lock."""

    lsn: int
    check: bytes
    n: int
    size: int
    floor: int


class Log:
    """The arena region of a mapped segment whose ids are ``id_bytes`` wide.

    The log deals in stored ids only (``id_bytes`` per id): what ``walk`` returns is what
    ``append`` takes, so copying a chain forward or inlining a parent never converts.
    """

    def __init__(
        self, mm: mmap.mmap, arena_off: int, arena_size: int, words: memoryview, name: str, id_bytes: int,
        *, fd: int,
    ) -> None:
        self._mm = mm
        self._fd = fd  # the segment file: pread for readers, posix_fallocate for the writer
        self._off = arena_off
        self.size = arena_size
        self.id_bytes = id_bytes
        self._words = words
        self._name = name

    # --- readers (lock-free) --------------------------------------------------------------

    def walk(self, key: bytes, lsn_kind: int) -> Chain | int:
        """Read and verify ``key``'s chain from the record at ``lsn_kind``.

        The key's own record must list ``key`` (with how many of its ids the key uses):
        that is what makes a stale or torn index slot harmless. Each parent is bound by
        its LSN, the first bytes of its check and the token count before it. Returns the
        Chain (its ids joined once, as stored), or EVICTED / CORRUPT.
        """
        found = self.walk_known(key, lsn_kind, None)
        if isinstance(found, int):
            return found
        return found.rest, found.oldest, found.depth, found.key_expiry, found.chain_expiry

    def walk_known(self, key: bytes, lsn_kind: int, known: Known | None) -> Walk | int:
        """:meth:`walk`, stopping at the first record of the chain the caller already holds.

        ``known(lsn, check8)`` returns ``(held, base, n)`` when the caller holds the ids of
        the chain up to and including the first ``n`` ids of the record with that LSN and
        check prefix (``base`` = tokens before that record's own ids), else None. Records
        are immutable and (LSN, check) identifies one, so no version is needed. The walk
        then returns ``Walk.held`` with the token count to take from it and only the stored
        ids after it in ``rest``. Eviction is decided exactly as by a full walk (the chain's
        floor and tail), so a hit or a miss never depends on what a process holds.
        """
        if _native is not None:  # the same walk in C (this method's Python is the reference)
            got = _native.walk(self._fd, self._off, self.size, self.id_bytes, self._mm, key, lsn_kind, known,
                               MAX_CHAIN)
            if type(got) is int:
                return got
            rest, oldest, depth, key_expiry, chain_expiry, own, held, held_tokens, keys = got
            return Walk(rest, oldest, depth, key_expiry, chain_expiry, RecordRef(*own), held, held_tokens, keys)
        return self._walk_known(key, lsn_kind, known)

    def _walk_known(self, key: bytes, lsn_kind: int, known: Known | None) -> Walk | int:
        """:meth:`walk_known` without the extension (the reference)."""
        width = self.id_bytes
        arena_size = self.size
        arena_off = self._off
        words = self._words
        tail = words[W_TAIL]
        cur = lsn_kind & LSN_MASK
        kind = lsn_kind >> LSN_BITS
        parts: list[bytes] = []
        n = -1  # ids to take from the current record; -1: from its entry for `key`
        expect_base = 0
        expect_check = b""
        end = 0
        key_expiry = 0
        chain_expiry = 0
        depth = 0
        own: RecordRef | None = None
        held: Any = None
        held_tokens = 0
        start = 0  # the key's first id in its own record (a segment entry's)
        own_keys: dict[bytes, int] = {}
        pos = cur % arena_size
        if cur < tail:
            return EVICTED  # before touching its bytes: their page may have been given back
        if pos + MIN_RECORD > arena_size:
            return self._failed(cur)
        size = U32.unpack(self._read(arena_off + pos + RECORD_SIZE_OFF, U32.size))[0]
        while True:
            if cur < tail:
                return EVICTED
            depth += 1
            pos = cur % arena_size
            if depth > MAX_CHAIN or size < MIN_RECORD or pos + size > arena_size:
                return self._failed(cur)
            off = arena_off + pos
            rec = self._read(off, size)
            (
                _check,
                magic,
                size2,
                own_lsn,
                parent_lsn,
                parent_check,
                parent_n,
                base,
                n_ids,
                n_entries,
                _rec_kind,
                flags,
                expiry,
                parent_size,
                floor,
            ) = RECORD.unpack_from(rec)
            if (
                magic != RECORD_MAGIC
                or own_lsn != cur
                or size2 != size
                or not rec.startswith(check_of(memoryview(rec)[CHECK_SIZE:]))
            ):
                return self._failed(cur)
            ids_off = RECORD_SIZE + ENTRY_SIZE * n_entries
            if ids_off + width * n_ids > size:
                return self._failed(cur)
            if n < 0:
                q = _find_entry(rec, key, ids_off)
                if q < 0:
                    return self._failed(cur)
                n, key_expiry, entry_kind, s_lo, s_hi = ENTRY_TAIL.unpack_from(rec, q + KEY_SIZE)
                start = s_lo | s_hi << 16
                if entry_kind != kind:
                    return self._failed(cur)
                if floor < tail:
                    return EVICTED  # its oldest link is gone: do not bother walking
                end = cur + size
                if n > n_ids or (start and (flags & F_HAS_PARENT or base or start >= n)):
                    return self._failed(cur)
                own = RecordRef(cur, bytes(rec[:LINK_CHECK_SIZE]), base, n, floor)
                for e in range(RECORD_SIZE, ids_off, ENTRY_SIZE):  # every chain key of the record
                    e_key, e_n, _e_exp, _e_kind, e_lo, e_hi = ENTRY.unpack_from(rec, e)
                    if not (e_lo or e_hi):
                        own_keys[e_key] = e_n
                if known is not None and not start:  # (a segment entry is no chain prefix)
                    got = known(cur, own.check)
                    if got is not None and got[1] == base and n <= got[2]:
                        held, held_tokens = got[0], base + n
                        break
            elif base + n != expect_base or not rec.startswith(expect_check):
                return self._failed(cur)
            elif expiry and (not chain_expiry or expiry < chain_expiry):
                chain_expiry = expiry
            if n > n_ids:
                return self._failed(cur)
            if n:
                parts.append(rec[ids_off + width * start : ids_off + width * n])
            start = 0
            if not flags & F_HAS_PARENT:
                if base:
                    return self._failed(cur)
                break
            if parent_lsn >= cur:  # links only point backwards: no cycles
                return self._failed(cur)
            if known is not None:
                got = known(parent_lsn, parent_check)
                if got is not None and got[1] + parent_n == base and parent_n <= got[2]:
                    held, held_tokens = got[0], base
                    break
            expect_base = base
            expect_check = parent_check
            n = parent_n
            cur = parent_lsn
            size = parent_size
        # All copies are done: re-read tail (see the module docstring). end > head means a
        # corrupted head; treat like eviction.
        if cur < words[W_TAIL] or end > words[W_HEAD]:
            return EVICTED
        if len(parts) == 1:
            data = parts[0]
        else:
            parts.reverse()
            data = b"".join(parts)
        assert own is not None
        return Walk(data, cur, depth, key_expiry, chain_expiry, own, held, held_tokens, own_keys)

    def follow(self, cursor: int, flag: int, limit: int) -> tuple[int, list[tuple[bytes, bytes]]]:
        """The entries of the records carrying ``flag`` from LSN ``cursor`` on, at most ``limit``
        records looked at: (where to continue, [(key, its ids as packed LE u32)]). Lock-free.

        Follows the log as it is written: whoever appends, in whatever process, the follower
        sees every record once (a cursor below tail starts again at tail: what was evicted
        before it was read is missed, counted by nobody, as a full queue would drop it). Each
        record is copied and verified as a chain walk verifies it; one that fails is skipped.
        """
        words = self._words
        arena_size = self.size
        head = words[W_HEAD]
        at = max(cursor, words[W_TAIL])
        out: list[tuple[bytes, bytes]] = []
        width = self.id_bytes
        for _ in range(limit):
            if at >= head:
                break
            pos = at % arena_size
            room = arena_size - pos
            if room < RECORD_SIZE:  # too short for any record: the writer padded here
                at += room
                continue
            magic, size = MAGIC_SIZE.unpack(self._read(self._off + pos + RECORD_MAGIC_OFF, MAGIC_SIZE.size))
            if magic == PAD_MAGIC and size == room:
                at += size
                continue
            if magic != RECORD_MAGIC or not MIN_RECORD <= size <= room or size & 7 or at + size > head:
                # Not a record boundary: overwritten under the follower (it fell behind tail),
                # or corrupt. Resync at tail, or at the next lap, which starts with a record.
                tail = words[W_TAIL]
                at = tail if at < tail else at + room
                continue
            rec = self._read(self._off + pos, size)
            fields = RECORD.unpack_from(rec)
            if fields[3] == at and rec.startswith(check_of(memoryview(rec)[CHECK_SIZE:])) and fields[11] & flag:
                n_ids, n_entries = fields[8], fields[9]
                ids_off = RECORD_SIZE + ENTRY_SIZE * n_entries
                if ids_off + width * n_ids <= size:
                    ids = widen(rec[ids_off:ids_off + width * n_ids], width)
                    for e in range(n_entries):
                        key, n, _expiry, _kind, s_lo, s_hi = ENTRY.unpack_from(rec, RECORD_SIZE + ENTRY_SIZE * e)
                        start = s_lo | s_hi << 16
                        if start < n <= n_ids or (not start and n <= n_ids):
                            out.append((key, ids[4 * start:4 * n]))
            at += size
        # A record copied after tail passed it may be torn: its check failed and it was
        # skipped, or it verified and is whole.
        return at, out

    def check_at(self, lsn: int) -> bytes:
        """The check prefix (LINK_CHECK_SIZE bytes) of the record at ``lsn`` (just written)."""
        return self._read(self._off + lsn % self.size, LINK_CHECK_SIZE)

    def _read(self, off: int, n: int) -> bytes:
        """``n`` bytes of the segment at ``off``, copied with pread(2), not through the mapping.

        Tail may pass these bytes and their pages be given back after the caller checked
        it; a fault on such a hole is SIGBUS on a full tmpfs, pread reads zeros (a short
        read past the end of the file is padded): a failed check, a miss.
        """
        try:
            data = os.pread(self._fd, n, off)
        except OSError as exc:
            raise SegmentError(f"{self._name}: reading {n} bytes at {off}: {exc}") from exc
        return data if len(data) == n else data.ljust(n, b"\0")

    def _write(self, off: int, data: bytes | bytearray) -> None:
        """Store ``data`` at ``off`` of the segment with pwrite(2), not through the mapping (the
        writer lock is held, the pages were reserved). A store through the mapping faults on
        the first touch of each page in this process: a writer that is not the segment's owner
        (a client recording an output) touched ~3 new pages per record, ~3 page faults each."""
        try:
            done = os.pwrite(self._fd, data, off)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise SegmentFull(f"{self._name}: no room for {len(data)} bytes at {off}") from exc
            raise SegmentError(f"{self._name}: writing {len(data)} bytes at {off}: {exc}") from exc
        if done != len(data):
            raise SegmentError(f"{self._name}: wrote {done} of {len(data)} bytes at {off}")

    def _failed(self, lsn: int) -> int:
        """Why verifying the record at ``lsn`` failed: overwritten after eviction, or corrupt."""
        return EVICTED if lsn < self._words[W_TAIL] else CORRUPT

    # --- the writer (lock held) -----------------------------------------------------------

    def bounds(self) -> tuple[int, int]:
        """(head, tail), reset to an empty log if a stray write made them inconsistent."""
        words = self._words
        head, tail = words[W_HEAD], words[W_TAIL]
        if tail <= head < LSN_SOFT_LIMIT and head - tail <= self.size and not (head | tail) & 7:
            return head, tail
        # Restart empty at or past both values: every slot then points below tail or above
        # head, and record identity (own LSN in the check) guards any LSN reused later.
        fresh = (max(head, tail) + 7) & ~7
        if fresh >= LSN_SOFT_LIMIT:
            fresh = 0
        words[W_TAIL] = fresh
        words[W_HEAD] = fresh
        words[W_CORRUPT] += 1
        log.warning("store %s: log bounds head=%d tail=%d were corrupt; log reset", self._name, head, tail)
        return fresh, fresh

    def cap(self) -> int:
        """The bytes the live log may span now: the arena, or less under a soft cap."""
        return effective_cap(self._words[W_SOFT_CAP], self.size)

    def needed(self, head: int, size: int, cap: int) -> int:
        """The tail that appending ``size`` bytes at ``head`` requires (all below dies)."""
        pos = head % self.size
        pad = self.size - pos if pos + size > self.size else 0
        return head + pad + size - cap

    def parent(self, lsn_kind: int, key: bytes, tokens: int, head: int, tail: int) -> ParentRef | None:
        """The prefix ``key`` maps to via the record at ``lsn_kind``, if it is live, lists
        ``key`` and has exactly ``tokens`` tokens; else None.

        Reads the header and key table only: the reader verifies the whole chain anyway,
        so a corrupt parent costs an unreadable record, never wrong ids.
        """
        lsn = lsn_kind & LSN_MASK
        pos = lsn % self.size
        if lsn < tail or lsn + MIN_RECORD > head or pos + MIN_RECORD > self.size:
            return None  # (only [tail, head) is sure to be allocated: see the module docstring)
        off = self._off + pos
        head_bytes = self._read(off, RECORD_SIZE)
        (check, magic, size, own, _pl, _pc, _pn, base, n_ids, n_entries, _k, flags, _e, _ps, floor) = (
            RECORD.unpack(head_bytes)
        )
        ids_off = RECORD_SIZE + ENTRY_SIZE * n_entries
        if (
            magic != RECORD_MAGIC
            or own != lsn
            or not MIN_RECORD <= size <= self.size - pos
            or lsn + size > head
            or ids_off > size
        ):
            return None
        table = head_bytes + self._read(off + RECORD_SIZE, ids_off - RECORD_SIZE)
        q = _find_entry(table, key, ids_off)
        if q < 0:
            return None
        n, _expiry, _kind, s_lo, s_hi = ENTRY_TAIL.unpack_from(table, q + KEY_SIZE)
        if s_lo or s_hi:
            return None  # a segment entry: no prefix to continue
        floor = min(floor, lsn) if flags & F_HAS_PARENT else lsn
        if n > n_ids or base + n != tokens or floor < tail:
            return None  # (floor < tail: the chain already lost its start)
        return ParentRef(lsn, check[:LINK_CHECK_SIZE], n, size, floor)

    def append(
        self,
        head: int,
        tail: int,
        size: int,
        link: Link | None,
        ids: bytes,
        entries: Sequence[Entry],
        kind: int,
        expiry: int,
        flags: int,
        cap: int,
    ) -> tuple[int, int, int]:
        """Write one record of ``size`` bytes at head, evicting so the log spans <= ``cap``.

        ``ids`` are stored ids (``id_bytes`` each). Returns (its LSN, new tail, new head);
        the caller then points index slots at it.
        Records evicted to stay within the arena count as cap evictions, those evicted
        only because ``cap`` is below the arena size as pressure evictions.
        Raises SegmentFull, having changed nothing, when the tmpfs cannot allocate the
        pages the record (and the pad before it) go to.
        """
        words = self._words
        pos = head % self.size
        pad = self.size - pos if pos + size > self.size else 0
        lsn = head + pad
        restart = lsn + size >= LSN_SOFT_LIMIT
        if restart:
            tail = lsn = pos = pad = 0
        # Before anything changes: pages given back earlier are holes again, and storing
        # into one the tmpfs cannot allocate is SIGBUS. (Eviction below reads past head
        # only inside this range.)
        if pad:
            reserve(self._fd, self._off + pos, pad, self._name)
        reserve(self._fd, self._off + lsn % self.size, size, self._name)
        if restart:
            # Restart at 0 (after 32 PiB): head first, so no reader sees an old record live.
            words[W_HEAD] = 0
            words[W_TAIL] = 0
        needed = lsn + size - self.size
        soft_needed = lsn + size - cap
        if tail < soft_needed:
            if tail < needed:
                tail = self._evict(tail, needed, lsn, W_EVICT_CAP)
            if tail < soft_needed:
                tail = self._evict(tail, soft_needed, lsn, W_EVICT_PRESSURE)
            words[W_TAIL] = tail  # published before any byte below it is overwritten
        if pad >= RECORD_SIZE:
            self._write(self._off + pos + RECORD_MAGIC_OFF, MAGIC_SIZE.pack(PAD_MAGIC, pad))
        record = bytearray(size)
        write_record(record, 0, lsn, size, link, entries, ids, len(ids) // self.id_bytes, kind, flags, expiry)
        self._write(self._off + lsn % self.size, record)
        head = lsn + size
        words[W_HEAD] = head  # the record is complete before any slot can point at it
        return lsn, tail, head

    def evict_to(self, head: int, tail: int, target: int) -> int:
        """Advance tail until the log spans at most ``target`` bytes (pressure evictions).

        Publishes and returns the new tail. Lock held.
        """
        if head - tail > target:
            tail = self._evict(tail, head - target, head, W_EVICT_PRESSURE)
            self._words[W_TAIL] = tail
        return tail

    def sweep(self, head: int, tail: int, now: float) -> int:
        """Advance tail over records whose every key has expired (at most SWEEP_STEPS).

        Stops at the first record that has a live key, never expires, or does not parse
        (the cap eviction deals with that one). Publishes and returns the new tail. Lock held.
        """
        arena_size = self.size
        swept = 0
        start = tail
        for _ in range(SWEEP_STEPS):
            if tail >= head:
                break
            pos = tail % arena_size
            room = arena_size - pos
            if room < RECORD_SIZE:
                tail += room
                continue
            head_bytes = self._read(self._off + pos, RECORD_SIZE)
            magic, size = MAGIC_SIZE.unpack_from(head_bytes, RECORD_MAGIC_OFF)
            if magic == PAD_MAGIC and size == room:
                tail += size
                continue
            if magic != RECORD_MAGIC or not MIN_RECORD <= size <= room or size & 7 or tail + size > head:
                break
            own = U64.unpack_from(head_bytes, RECORD_LSN_OFF)[0]
            expiry = U32.unpack_from(head_bytes, RECORD_EXPIRY_OFF)[0]
            if own != tail or not expiry or now < expiry:
                break
            tail += size
            swept += 1
        tail = min(tail, head)
        if tail != start:
            self._words[W_TAIL] = tail
            if swept:
                self._words[W_EVICT_TTL] += swept
        return tail

    def release(self, head: int, tail: int) -> int:
        """Give the arena pages outside ``[tail, head)`` back to the kernel. Lock held.

        A page holding any live byte is kept. Returns the bytes of the ranges punched
        (pages that were already holes included; ``st_blocks`` tells what is resident).
        """
        arena_size = self.size
        live = head - tail
        if live >= arena_size:
            return 0
        if live <= 0:
            free = [(0, arena_size)]
        else:
            t = tail % arena_size
            e = t + live
            free = [(0, t), (e, arena_size)] if e <= arena_size else [(e - arena_size, t)]
        released = 0
        for lo, hi in free:
            start = self._off + _page_up(lo)
            # The arena's last partial page holds no live byte past arena_size.
            end = self._off + (_page_up(hi) if hi == arena_size else _page_down(hi))
            if end > start:
                self._mm.madvise(mmap.MADV_REMOVE, start, end - start)
                released += end - start
        words = self._words
        words[W_RELEASE_TAIL] = tail
        words[W_RELEASED] += released
        return released

    def _evict(self, tail: int, needed: int, limit: int, cause: int) -> int:
        """Advance ``tail`` over whole records until it reaches ``needed`` (<= ``limit``);
        count the records in the header word ``cause``."""
        arena_size = self.size
        evicted = 0
        while tail < needed:
            pos = tail % arena_size
            room = arena_size - pos
            if room < RECORD_SIZE:  # too short for any record: the writer padded here
                tail += room
                continue
            magic, size = MAGIC_SIZE.unpack(self._read(self._off + pos + RECORD_MAGIC_OFF, MAGIC_SIZE.size))
            if magic == PAD_MAGIC and size == room:
                tail += size
            elif magic == RECORD_MAGIC and MIN_RECORD <= size <= room and not size & 7:
                tail += size
                evicted += 1
            else:
                # Not a record boundary (corruption, or the log was reset): the bytes are
                # dead anyway. Skip to `needed`, or to the next lap if that comes first:
                # every lap starts with a record, so the walk (and its count) resyncs there.
                tail = min(needed, tail + room)
        if evicted:
            self._words[cause] += evicted
        return min(tail, limit)


def effective_cap(soft_cap: int, arena_size: int) -> int:
    """The span the live log may have under the header's soft cap word.

    0, a value at or above the arena, or one that no writer could have stored (not a
    multiple of 8, below the floor: a stray write) all mean the whole arena.
    """
    if soft_cap <= 0 or soft_cap >= arena_size or soft_cap & 7 or soft_cap < min_soft_cap(arena_size):
        return arena_size
    return soft_cap


def min_soft_cap(arena_size: int) -> int:
    """The smallest soft cap honoured: a stray write cannot shrink the cache to nothing."""
    return max(MIN_RECORD, arena_size // 64) + 7 & ~7


def _page_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _page_down(n: int) -> int:
    return n // PAGE * PAGE


def _find_entry(rec: bytes, key: bytes, end: int) -> int:
    """Offset of ``key``'s entry in a record's key table (which ends at ``end``), or -1."""
    q = rec.find(key, RECORD_SIZE, end)
    while q >= 0 and (q - RECORD_SIZE) % ENTRY_SIZE:
        q = rec.find(key, q + 1, end)
    return q


def write_record(
    mm: mmap.mmap | bytearray,
    start: int,
    lsn: int,
    size: int,
    link: Link | None,
    entries: Sequence[Entry],
    ids: bytes,
    n_ids: int,
    kind: int,
    flags: int,
    expiry: int,
    *,
    native: bool = True,
) -> None:
    """Write one record (see ``_layout``) holding ``n_ids`` stored ``ids``, check included, into
    ``mm[start : start + size]``: in place, in one C call when the extension is built
    (``native``); else built here in Python, which is the reference (the tests compare both)."""
    if link is None:
        link = Link(0, _ZERO_LINK_CHECK, 0, 0, 0, lsn)
    else:
        flags |= F_HAS_PARENT
    if native and _native is not None:
        _native.write_record(mm, start, size, lsn, link.lsn, link.check, link.n, link.base, n_ids, kind, flags,
                             expiry, link.size, link.floor, entries if type(entries) is list else list(entries), ids)
        return
    buf = bytearray(size)
    RECORD.pack_into(buf, 0, _ZERO_CHECK, RECORD_MAGIC, size, lsn, link.lsn, link.check, link.n, link.base, n_ids,
                     len(entries), kind, flags, expiry, link.size, link.floor)
    off = RECORD_SIZE
    for key, n, entry_kind, entry_expiry, first in entries:
        ENTRY.pack_into(buf, off, key, n, entry_expiry, entry_kind, first & 0xFFFF, first >> 16)
        off += ENTRY_SIZE
    buf[off : off + len(ids)] = ids
    buf[:CHECK_SIZE] = check_of(memoryview(buf)[CHECK_SIZE:])
    mm[start : start + size] = buf
