"""The arena: a circular log of immutable records, and chains of them.

Positions are LSNs, monotonic byte offsets (position = lsn % arena size); the live log is
``[tail, head)`` (header words W_TAIL, W_HEAD). Appending past the end advances tail, which
evicts everything below it at once: no per-record bookkeeping, nothing to repair after a
crash. Records never wrap; the writer pads to the start of the arena instead.

Writer order, under the writer lock: advance tail (evict) -> write the record -> publish
head -> (the caller) write index slots. A writer that dies at any step leaves only bytes
that nothing references yet.

A reader copies each record of a chain out of the mapping, verifies it (magic, own LSN,
blake3 check, link to its parent), and only then re-reads tail. The writer moves tail past
a record before overwriting any of it, so a record still at or above tail after the copy
was not being overwritten during it: a torn copy always ends as a miss, and the checks
also turn any stray write into a miss.
"""

from __future__ import annotations

import logging
import mmap
from typing import Final, NamedTuple

from blake3 import blake3

from ._layout import (
    CHECK_SIZE,
    ENTRY,
    ENTRY_SIZE,
    F_HAS_PARENT,
    KEY_SIZE,
    LINK_CHECK_SIZE,
    LSN_BITS,
    LSN_MASK,
    LSN_SOFT_LIMIT,
    MAGIC_SIZE,
    MIN_RECORD,
    PAD_MAGIC,
    RECORD,
    RECORD_MAGIC,
    RECORD_MAGIC_OFF,
    RECORD_SIZE,
    RECORD_SIZE_OFF,
    U32,
    W_CORRUPT,
    W_EVICTIONS,
    W_HEAD,
    W_TAIL,
)

__all__ = ["CORRUPT", "EVICTED", "MAX_CHAIN", "Chain", "Link", "Log", "ParentRef"]

log = logging.getLogger(__name__)

MAX_CHAIN: Final = 4096  # links a reader follows; a longer chain is treated as corrupt
# Why a walk failed.
EVICTED: Final = 1
CORRUPT: Final = 2

_ZERO_CHECK: Final = bytes(CHECK_SIZE)
_ZERO_LINK_CHECK: Final = bytes(LINK_CHECK_SIZE)

Chain = tuple[bytes, int, int, int]
"""A verified chain: (ids, LSN of its oldest record, number of records, key's expiry)."""


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
    """The arena region of a mapped segment."""

    def __init__(self, mm: mmap.mmap, arena_off: int, arena_size: int, words: memoryview, name: str) -> None:
        self._mm = mm
        self._off = arena_off
        self.size = arena_size
        self._words = words
        self._name = name

    # --- readers (lock-free) --------------------------------------------------------------

    def walk(self, key: bytes, lsn_kind: int) -> Chain | int:
        """Read and verify ``key``'s chain from the record at ``lsn_kind``.

        The key's own record must list ``key`` (with how many of its ids the key uses):
        that is what makes a stale or torn index slot harmless. Each parent is bound by
        its LSN, the first bytes of its check and the token count before it. Returns the
        Chain, or EVICTED / CORRUPT.
        """
        mm = self._mm
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
        depth = 0
        pos = cur % arena_size
        if pos + MIN_RECORD > arena_size:
            return self._failed(cur)
        size = U32.unpack_from(mm, arena_off + pos + RECORD_SIZE_OFF)[0]
        while True:
            if cur < tail:
                return EVICTED
            depth += 1
            pos = cur % arena_size
            if depth > MAX_CHAIN or size < MIN_RECORD or pos + size > arena_size:
                return self._failed(cur)
            off = arena_off + pos
            rec = mm[off : off + size]
            (
                _check,
                magic,
                size2,
                own,
                parent_lsn,
                parent_check,
                parent_n,
                base,
                n_ids,
                n_entries,
                rec_kind,
                flags,
                expiry,
                parent_size,
                floor,
            ) = RECORD.unpack_from(rec)
            if (
                magic != RECORD_MAGIC
                or own != cur
                or size2 != size
                or not rec.startswith(blake3(rec[CHECK_SIZE:]).digest(CHECK_SIZE))
            ):
                return self._failed(cur)
            ids_off = RECORD_SIZE + ENTRY_SIZE * n_entries
            if ids_off + 4 * n_ids > size:
                return self._failed(cur)
            if n < 0:
                q = _find_entry(rec, key, ids_off)
                if q < 0 or rec_kind != kind:
                    return self._failed(cur)
                n = U32.unpack_from(rec, q + KEY_SIZE)[0]
                if floor < tail:
                    return EVICTED  # its oldest link is gone: do not bother walking
                end = cur + size
                key_expiry = expiry
            elif base + n != expect_base or not rec.startswith(expect_check):
                return self._failed(cur)
            if n > n_ids:
                return self._failed(cur)
            if n:
                parts.append(rec[ids_off : ids_off + 4 * n])
            if not flags & F_HAS_PARENT:
                if base:
                    return self._failed(cur)
                break
            if parent_lsn >= cur:  # links only point backwards: no cycles
                return self._failed(cur)
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
        return data, cur, depth, key_expiry

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

    def needed(self, head: int, size: int) -> int:
        """The tail that appending ``size`` bytes at ``head`` requires (all below dies)."""
        pos = head % self.size
        pad = self.size - pos if pos + size > self.size else 0
        return head + pad + size - self.size

    def parent(self, lsn_kind: int, key: bytes, tokens: int, head: int, tail: int) -> ParentRef | None:
        """The prefix ``key`` maps to via the record at ``lsn_kind``, if it is live, lists
        ``key`` and has exactly ``tokens`` tokens; else None.

        Reads the header and key table only: the reader verifies the whole chain anyway,
        so a corrupt parent costs an unreadable record, never wrong ids.
        """
        lsn = lsn_kind & LSN_MASK
        pos = lsn % self.size
        if lsn < tail or pos + MIN_RECORD > self.size:
            return None
        off = self._off + pos
        (check, magic, size, own, _pl, _pc, _pn, base, n_ids, n_entries, _k, flags, _e, _ps, floor) = (
            RECORD.unpack_from(self._mm, off)
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
        q = _find_entry(self._mm[off : off + ids_off], key, ids_off)
        if q < 0:
            return None
        n = U32.unpack_from(self._mm, off + q + KEY_SIZE)[0]
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
        entries: list[tuple[bytes, int]],
        kind: int,
        expiry: int,
        flags: int,
    ) -> tuple[int, int, int]:
        """Write one record of ``size`` bytes at head, evicting as needed.

        Returns (its LSN, new tail, new head); the caller then points index slots at it.
        """
        mm = self._mm
        words = self._words
        pos = head % self.size
        pad = self.size - pos if pos + size > self.size else 0
        lsn = head + pad
        if lsn + size >= LSN_SOFT_LIMIT:
            # Restart at 0 (after 32 PiB): head first, so no reader sees an old record live.
            words[W_HEAD] = 0
            words[W_TAIL] = 0
            tail = lsn = pos = pad = 0
        needed = lsn + size - self.size
        if tail < needed:
            tail = self._evict(tail, needed, lsn)
            words[W_TAIL] = tail  # published before any byte below it is overwritten
        if pad >= RECORD_SIZE:
            MAGIC_SIZE.pack_into(mm, self._off + pos + RECORD_MAGIC_OFF, PAD_MAGIC, pad)
        start = self._off + lsn % self.size
        mm[start : start + size] = _build(lsn, size, link, entries, ids, kind, flags, expiry)
        head = lsn + size
        words[W_HEAD] = head  # the record is complete before any slot can point at it
        return lsn, tail, head

    def _evict(self, tail: int, needed: int, limit: int) -> int:
        """Advance ``tail`` over whole records until it reaches ``needed`` (<= ``limit``)."""
        mm = self._mm
        arena_size = self.size
        evicted = 0
        while tail < needed:
            pos = tail % arena_size
            room = arena_size - pos
            if room < RECORD_SIZE:  # too short for any record: the writer padded here
                tail += room
                continue
            magic, size = MAGIC_SIZE.unpack_from(mm, self._off + pos + RECORD_MAGIC_OFF)
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
            self._words[W_EVICTIONS] += evicted
        return min(tail, limit)


def _find_entry(rec: bytes, key: bytes, end: int) -> int:
    """Offset of ``key``'s entry in a record's key table (which ends at ``end``), or -1."""
    q = rec.find(key, RECORD_SIZE, end)
    while q >= 0 and (q - RECORD_SIZE) % ENTRY_SIZE:
        q = rec.find(key, q + 1, end)
    return q


def _build(
    lsn: int,
    size: int,
    link: Link | None,
    entries: list[tuple[bytes, int]],
    ids: bytes,
    kind: int,
    flags: int,
    expiry: int,
) -> bytearray:
    """The bytes of one record (see ``_layout``), check included."""
    if link is None:
        link = Link(0, _ZERO_LINK_CHECK, 0, 0, 0, lsn)
    else:
        flags |= F_HAS_PARENT
    buf = bytearray(size)
    RECORD.pack_into(
        buf,
        0,
        _ZERO_CHECK,
        RECORD_MAGIC,
        size,
        lsn,
        link.lsn,
        link.check,
        link.n,
        link.base,
        len(ids) // 4,
        len(entries),
        kind,
        flags,
        expiry,
        link.size,
        link.floor,
    )
    off = RECORD_SIZE
    for key, n in entries:
        ENTRY.pack_into(buf, off, key, n)
        off += ENTRY_SIZE
    buf[off : off + len(ids)] = ids
    buf[:CHECK_SIZE] = blake3(memoryview(buf)[CHECK_SIZE:]).digest(CHECK_SIZE)
    return buf
