"""The index: 16-byte keys -> slots (record LSN and kind, expiry, last access).

Open addressing over fixed buckets, two choices per key (see ``_layout`` for the bucket
format). Lookups are lock-free; every other method needs the writer lock. Slots are hints:
a reader proves a hit against the record a slot points to, so this module never has to
make a slot write atomic, only to keep a torn one from pointing anywhere valid for
another key (which the record's key list rules out).
"""

from __future__ import annotations

import mmap
from typing import Any

from tokcache import native

from ._layout import (
    BUCKET_SIZE,
    BUCKET_SLOTS,
    KEY_SIZE,
    LSN_BITS,
    LSN_MASK,
    SLOT,
    SLOT_ACCESS_OFF,
    SLOT_SIZE,
    SLOT_TAIL,
    SLOTS_OFF,
    U32,
    W_INDEX_EVICTIONS,
    tag_of,
)

__all__ = ["NATIVE", "STATS_SAMPLE_BUCKETS", "Index"]

# The probes in C (``_speedups.c``) when the extension was built, else the loops below;
# TOKCACHE_PURE_PYTHON=1 forces the loops (the tests compare both).
def _load_native() -> Any:  # noqa: ANN401 - the extension module, or None
    return native.store()


_native: Any = _load_native()
NATIVE: bool = _native is not None

STATS_SAMPLE_BUCKETS = 4096  # buckets ``live_entries`` reads at most (then extrapolates)


class Index:
    """The index region of a mapped segment. Holds no state beyond the mapping."""

    def __init__(self, mm: mmap.mmap, index_off: int, n_buckets: int, words: memoryview,
                 *, native: bool = NATIVE) -> None:
        self._mm = mm
        self._off = index_off
        self._n_buckets = n_buckets
        self._words = words
        self.slots = n_buckets * BUCKET_SLOTS
        if native and _native is not None:  # same answers, ~50x cheaper per probe
            self.find = self._find_native  # type: ignore[method-assign]
            self.last_live = self._last_live_native  # type: ignore[method-assign]
            self.set = self._set_native  # type: ignore[method-assign]
            self.set_all = self._set_all_native  # type: ignore[method-assign]

    def region(self) -> tuple[mmap.mmap, int, int]:
        """(mapping, index offset, buckets): where a native reader probes (``_index.h``)."""
        return self._mm, self._off, self._n_buckets

    def _find_native(self, key: bytes) -> int:
        return int(_native.find(self._mm, self._off, self._n_buckets, key))

    def _last_live_native(self, keys: list[bytes], lo: int, hi: int, now: float, tail: int) -> int:
        return int(_native.last_live(self._mm, self._off, self._n_buckets, keys, lo, hi, now, tail))

    def _set_native(self, key: bytes, lsn_kind: int, expiry: int, access: int, tail: int, head: int,
                    now: float) -> None:
        if _native.set_slot(self._mm, self._off, self._n_buckets, key, lsn_kind, expiry, access, tail, head, now):
            self._words[W_INDEX_EVICTIONS] += 1

    def _set_all_native(self, entries: list[tuple[bytes, int, int, int, int]], lsn: int, access: int, tail: int,
                        head: int, now: float) -> None:
        evicted = _native.set_slots(self._mm, self._off, self._n_buckets, entries, lsn, access, tail, head, now)
        if evicted:
            self._words[W_INDEX_EVICTIONS] += evicted

    def find(self, key: bytes) -> int:
        """Absolute offset of ``key``'s slot, or -1. Lock-free."""
        mm = self._mm
        h = int.from_bytes(key, "little")
        tag = key[7] ^ key[15] or 1  # tag_of(key), inlined: this is the miss path
        for boff in (
            self._off + h % self._n_buckets * BUCKET_SIZE,
            self._off + (h >> 64) % self._n_buckets * BUCKET_SIZE,
        ):
            tags = mm[boff : boff + BUCKET_SLOTS]
            i = tags.find(tag)
            while i >= 0:
                soff = boff + SLOTS_OFF + i * SLOT_SIZE
                if mm[soff : soff + KEY_SIZE] == key:
                    return soff
                i = tags.find(tag, i + 1)
        return -1

    def last_live(self, keys: list[bytes], lo: int, hi: int, now: float, tail: int) -> int:
        """The highest ``i`` in ``[lo, hi)`` whose ``keys[i]`` has an unexpired slot pointing at
        or above ``tail``, or -1. Lock-free.

        :meth:`find` and the slot checks inlined in one loop: the longest-prefix search of
        a growing conversation probes every new cut of a turn (~4-12), and a method call
        per probe is most of a probe's cost when the interpreter's caches are cold.
        """
        mm = self._mm
        off = self._off
        nb = self._n_buckets
        unpack = SLOT_TAIL.unpack_from
        for i in range(hi - 1, lo - 1, -1):
            key = keys[i]
            h = int.from_bytes(key, "little")
            tag = key[7] ^ key[15] or 1
            for boff in (off + h % nb * BUCKET_SIZE, off + (h >> 64) % nb * BUCKET_SIZE):
                tags = mm[boff : boff + BUCKET_SLOTS]
                j = tags.find(tag)
                while j >= 0:
                    soff = boff + SLOTS_OFF + j * SLOT_SIZE
                    if mm[soff : soff + KEY_SIZE] == key:
                        lsn_kind, expiry, _ = unpack(mm, soff + KEY_SIZE)
                        if (not expiry or now < expiry) and lsn_kind & LSN_MASK >= tail:
                            return i
                        break
                    j = tags.find(tag, j + 1)
                else:
                    continue
                break  # the key's slot (dead): a key has one slot
        return -1

    def read(self, soff: int) -> tuple[int, int, int]:
        """(lsn_kind, expiry, access) of the slot at ``soff``."""
        lsn_kind, expiry, access = SLOT_TAIL.unpack_from(self._mm, soff + KEY_SIZE)
        return lsn_kind, expiry, access

    def touch(self, soff: int, second: int) -> None:
        """Record a read for bucket LRU. Lock-free: racing a writer that reuses the slot
        only leaves a wrong access time on a hint."""
        U32.pack_into(self._mm, soff + SLOT_ACCESS_OFF, second)

    def lookup(self, key: bytes) -> int:
        """``key``'s lsn_kind, or -1."""
        soff = self.find(key)
        return -1 if soff < 0 else self.read(soff)[0]

    def set(self, key: bytes, lsn_kind: int, expiry: int, access: int, tail: int, head: int, now: float) -> None:
        """Point ``key`` at a record. Lock held.

        Its existing slot in either bucket, else a free slot, else a dead one (below tail,
        at or above head, expired), first bucket first; else the least recently read slot
        of both buckets (counted in W_INDEX_EVICTIONS).
        """
        mm = self._mm
        slot = SLOT.pack(key, lsn_kind, expiry, access)
        soff = self.find(key)
        if soff >= 0:
            mm[soff : soff + SLOT_SIZE] = slot  # same key, same tag
            return
        offs = self._bucket_offs(key)
        target = (0, 0)
        for boff in offs:
            i = mm[boff : boff + BUCKET_SLOTS].find(0)
            if i >= 0:
                target = boff, i
                break
        else:
            best: tuple[int, int] | None = None
            for boff in offs:
                i, rank = _victim(mm[boff + SLOTS_OFF : boff + BUCKET_SIZE], tail, head, now)
                if rank is None:
                    target = boff, i
                    break
                if best is None or rank < best:
                    best, target = rank, (boff, i)
            else:
                self._words[W_INDEX_EVICTIONS] += 1
        boff, i = target
        soff = boff + SLOTS_OFF + i * SLOT_SIZE
        # Slot before tag: a reader that matches the new tag finds the new slot. Readers
        # that see the old tag compare keys and miss.
        mm[soff : soff + SLOT_SIZE] = slot
        mm[boff + i] = tag_of(key)

    def set_all(self, entries: list[tuple[bytes, int, int, int, int]], lsn: int, access: int, tail: int, head: int,
                now: float) -> None:
        """:meth:`set` for each (key, n, kind, expiry, start) of a record's ``entries``, in order:
        the key points at record ``lsn`` as ``kind``, with its expiry. Lock held. (One C call
        for all of them when the extension is built.)"""
        for key, _n, kind, expiry, _start in entries:
            self.set(key, kind << LSN_BITS | lsn, expiry, access, tail, head, now)

    def live_entries(self, head: int, tail: int, now: float) -> dict[int, int]:
        """Unexpired slots pointing into ``[tail, head)``, by kind value (extrapolated from
        at most STATS_SAMPLE_BUCKETS buckets)."""
        counts: dict[int, int] = {}
        step = max(1, self._n_buckets // STATS_SAMPLE_BUCKETS)
        sampled = 0
        for b in range(0, self._n_buckets, step):
            off = self._off + b * BUCKET_SIZE
            bucket = self._mm[off : off + BUCKET_SIZE]
            for i, (_key, lsn_kind, expiry, _access) in enumerate(SLOT.iter_unpack(bucket[SLOTS_OFF:])):
                if bucket[i] and tail <= lsn_kind & LSN_MASK < head and not (expiry and now >= expiry):
                    kind = lsn_kind >> LSN_BITS
                    counts[kind] = counts.get(kind, 0) + 1
            sampled += 1
        scale = self._n_buckets / sampled
        return {kind: round(count * scale) for kind, count in counts.items()}

    def _bucket_offs(self, key: bytes) -> tuple[int, ...]:
        """The key's two bucket offsets (one if both hashes pick the same bucket)."""
        h = int.from_bytes(key, "little")
        first = self._off + h % self._n_buckets * BUCKET_SIZE
        second = self._off + (h >> 64) % self._n_buckets * BUCKET_SIZE
        return (first,) if first == second else (first, second)


def _victim(slots: bytes, tail: int, head: int, now: float) -> tuple[int, tuple[int, int] | None]:
    """(index, None) of a dead slot in a full bucket, else (index, rank) of its LRU slot."""
    best = 0
    best_rank: tuple[int, int] | None = None
    for i, (_key, lsn_kind, expiry, access) in enumerate(SLOT.iter_unpack(slots)):
        lsn = lsn_kind & LSN_MASK
        if lsn < tail or lsn >= head or (expiry and now >= expiry):
            return i, None
        rank = (access, lsn)  # least recently read, then oldest
        if best_rank is None or rank < best_rank:
            best, best_rank = i, rank
    return best, best_rank
