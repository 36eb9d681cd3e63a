"""The binary format of a store segment: header page, index, arena.

Everything here is a constant, a ``struct.Struct`` or a pure function of bytes, so the
format can be read in one place and bumped with :data:`LAYOUT_VERSION`.

Segment (all integers little-endian)::

    0            HEADER_SIZE (one 4 KiB page)
    | header     | index: n_buckets x BUCKET_SIZE   | pad to page | arena: arena_size bytes |

Header page
    ``[0, STATIC.size)``     static part, written once at creation (magic, version,
                             fingerprint, size, geometry, id width), covered by the 16-byte
                             check at ``STATIC_CHECK_OFF``.
    u64 words (index = byte offset / 8), each on a cache line by who writes it:
        W_HEAD, W_TAIL       the arena log, written by the lock holder only;
        W_RETIRED            RETIRED_MARK once the segment was replaced under its name;
        W_LOCK_*             the writer lock holder (see ``_lock``);
        W_HITS..W_CORRUPT    reader counters (lock-free read-modify-write: lossy);
        W_PUTS..             writer counters (updated under the lock: exact), evictions by
                             cause (capacity, TTL sweep, pressure), AR puts (while 0, no
                             AR entry exists and readers skip AR lookups), marks (while 0,
                             no pending-record mark exists: ``Store.mark``);
        W_SOFT_CAP           the arena bytes writers may use (0: all), set under memory
                             pressure; W_RELEASE_* track pages given back to the kernel.

Index
    Buckets of BUCKET_SIZE (512) bytes: BUCKET_SLOTS one-byte tags, padding to SLOTS_OFF,
    then BUCKET_SLOTS slots of SLOT_SIZE bytes.
    Slot = key (16) | lsn_kind u64 (kind << LSN_BITS | lsn) | expiry u32 | access u32.
    Tag = a nonzero byte of the key (see ``tag_of``); tag 0 marks a free slot. A probe is
    ``tags.find(tag)`` (memchr) and one 16-byte key compare per candidate: scanning the
    slots themselves with ``bytes.find`` degrades badly on zero-filled buckets.
    A key lives in one of two buckets (two-choice hashing: the low and the high 64 bits of
    the key pick them), which keeps buckets from overflowing at high load.
    Slots carry no checksum: a slot is only a hint, every hit is proven by the record it
    points to (the record lists its keys), so a torn slot or tag costs a miss at most.

Arena
    A circular log addressed by a monotonic byte position, the LSN; position = lsn % size.
    The live region is ``[tail, head)``; a record never wraps (the writer pads to the start).
    Record = RECORD header | entries: n_entries x ENTRY | ids | pad to 8.
    Ids are n_ids little-endian unsigned integers of the segment's id width (``id_bytes``
    in the static header, one of ID_WIDTHS): 3 when the tokenizer's vocabulary fits in 24
    bits (every real one so far; ids are most of a record's bytes), else 4. The width is
    fixed when the segment is created; the API always speaks packed u32 (``narrow`` on the
    way in refuses ids that do not fit, ``widen`` on the way out). Counts (n_ids, parent_n,
    an entry's n, base_tokens) are in ids, never bytes, so they do not depend on the width.
    ENTRY = key (16) | n u32 (ids of the record the key uses) | expiry u32 | kind u8 | start u24:
    every key has its own kind and expiry (an L0 key shares a record with the L1 keys of
    the same request), and the record's header ``expiry`` is the latest of its entries'
    (0 if any entry never expires): the TTL sweep reclaims a record at the tail once every
    key in it has expired. A key maps to its chain's ids up to the record's first ``n``; with
    ``start`` > 0 (only in a record without a parent) to the record's own ids [start:n]
    instead: the segment entries of one recorded output (its variants) share its ids.
    The gap a writer skips at the end of the arena starts with (PAD_MAGIC, gap size) at
    RECORD_MAGIC_OFF when it has room for a record header, so the evicting writer can step
    over whole records from tail (to count them); a gap too short for that is implied.
    ``check`` = first 16 bytes of SHA-256 over the record from byte 16 to its end, so it covers
    the record's own LSN: two different records never share (lsn, check).
    A record may link to a parent record by (parent_lsn, first 8 bytes of the parent's check,
    ids used from the parent); the chain is therefore immutable and verifiable link by link.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Final

from tokcache import native

from . import _hash

LAYOUT_VERSION: Final = 6  # 3: the id width joined the static header; 4: generation, manifest;
# 5: keys and checks are SHA-256 (were BLAKE3)
MAGIC: Final = b"TOKCACHE"
PAGE: Final = 4096
HEADER_SIZE: Final = PAGE
KEY_SIZE: Final = 16
FINGERPRINT_SIZE: Final = 16
CHECK_SIZE: Final = 16
LINK_CHECK_SIZE: Final = 8
ZERO_KEY: Final = bytes(KEY_SIZE)

# --- header -----------------------------------------------------------------------------
# magic | version | header_size | fingerprint | size | index_off | n_buckets | arena_off |
# arena_size | slot_size | bucket_slots | created (epoch s) | id_bytes | generation (random,
# fixed at creation: tells a reader that a segment under the same name is another one)
STATIC: Final = struct.Struct("<8sII16sQQQQQIIQIQ")
STATIC_CHECK_OFF: Final = 112
assert STATIC.size <= STATIC_CHECK_OFF

W_HEAD: Final = 32  # byte 256
W_TAIL: Final = 33
W_RETIRED: Final = 34
W_LOCK_PID: Final = 40  # byte 320
W_LOCK_START: Final = 41
W_LOCK_PIDNS: Final = 42
W_LOCK_EPOCH: Final = 43
W_LOCK_RECOVERIES: Final = 44
W_HITS: Final = 48  # byte 384: counters readers bump without the lock
W_MISSES: Final = 49
W_EXPIRED: Final = 50
W_CORRUPT: Final = 51
W_PUTS: Final = 56  # byte 448: counters only the lock holder bumps
W_EVICT_CAP: Final = 57  # records evicted to make room within the byte cap
W_INDEX_EVICTIONS: Final = 58
W_CONSOLIDATIONS: Final = 59
W_EVICT_TTL: Final = 60  # records swept off the tail because every key in them expired
W_EVICT_PRESSURE: Final = 61  # records evicted to honour the soft cap (memory pressure)
W_AR_PUTS: Final = 62  # records put with an AR entry: while 0, AR lookups can be skipped
W_MARKS: Final = 63  # pending-record marks put (Store.mark): while 0, readers probe for none
W_SOFT_CAP: Final = 64  # byte 512: arena bytes writers may use; 0 = the whole arena
W_RELEASE_TAIL: Final = 65  # tail when arena pages were last given back
W_RELEASED: Final = 66  # bytes of arena pages given back (madvise MADV_REMOVE), cumulative
W_MARKS_UNTIL: Final = 67  # the latest expiry (Unix s) of a mark put: none can be live from then on
W_MARKS_AT: Final = 68  # W_MARKS when W_MARKS_UNTIL was last set (else: a mark not in it, e.g. an older writer's)
# The manifest: what a reader needs to use the segment without asking the sidecar
# (tokenizer facts the sidecar proved: encoder backend, boundary tokens, affixes...), as
# JSON, published by the sidecar under the writer lock and read with a sequence lock:
# seq u64 (odd while being written) | length u32 | pad u32 | check (16) | body.
MANIFEST_OFF: Final = 1024
MANIFEST_HEAD: Final = struct.Struct("<QII16s")
MANIFEST_MAX: Final = HEADER_SIZE - MANIFEST_OFF - MANIFEST_HEAD.size
assert MANIFEST_OFF >= (W_MARKS_AT + 1) * 8


def marks_may_live(words: Any, now: float) -> bool:
    """Whether a pending-record mark (``Store.mark``) may be live at ``now`` (Unix s) in the
    segment whose header ``words`` (u64) are: one was put and not every mark's expiry has
    passed. False once the latest expiry is a second behind (a withdrawal is a mark too). A
    mark its writer did not record in W_MARKS_UNTIL (W_MARKS_AT behind W_MARKS: an older
    writer, or one between the two words) may live forever. Lock-free: the writer bumps
    W_MARKS, then sets W_MARKS_UNTIL, then W_MARKS_AT."""
    n = words[W_MARKS]
    if n == 0:
        return False
    return bool(words[W_MARKS_AT] != n or now < words[W_MARKS_UNTIL] + 1)


# Eight arbitrary bytes: a random write landing on W_RETIRED must not retire a segment.
RETIRED_MARK: Final = int.from_bytes(b"RETIRED!", "little")

# --- index ------------------------------------------------------------------------------
SLOT: Final = struct.Struct("<16sQII")
SLOT_SIZE: Final = SLOT.size
SLOT_TAIL: Final = struct.Struct("<QII")  # the slot after its key
SLOT_ACCESS_OFF: Final = 28
BUCKET_SLOTS: Final = 15
SLOTS_OFF: Final = 32  # tags, then slots from here (32-byte aligned)
BUCKET_SIZE: Final = SLOTS_OFF + SLOT_SIZE * BUCKET_SLOTS
assert BUCKET_SIZE == 512
# One slot per this many arena bytes. A request's record is ~1-4 KB carrying 4-10 keys, so
# ~190 bytes per key: at this ratio the index and the arena fill at about the same pace
# (index = 14% of the segment).
ARENA_BYTES_PER_SLOT: Final = 192

LSN_BITS: Final = 56
LSN_MASK: Final = (1 << LSN_BITS) - 1
# Past this the writer restarts the log at 0 (after 32 PiB written): old slots then point
# beyond head and record identity (lsn in the check) keeps reused positions apart.
LSN_SOFT_LIMIT: Final = 1 << 55

# --- records ----------------------------------------------------------------------------
# check | magic | size | lsn | parent_lsn | parent_check | parent_n | base_tokens | n_ids |
# n_entries | kind | flags | expiry (epoch s, 0 = never) | parent_size | floor
# ``parent_size`` lets a reader copy the parent in one slice. ``floor`` is the LSN of the
# oldest record of the chain (own LSN without a parent): the chain is unreadable once tail
# passes it, which readers and the writer test in O(1).
RECORD: Final = struct.Struct("<16sIIQQ8sIIIHBBIIQ")
RECORD_SIZE: Final = RECORD.size
# key | n | expiry | kind | start (u24 as its low 16 bits, then its high 8)
ENTRY: Final = struct.Struct("<16sIIBHB")
ENTRY_SIZE: Final = ENTRY.size
ENTRY_TAIL: Final = struct.Struct("<IIBHB")  # the entry after its key: n, expiry, kind, start
MAX_ENTRY_START: Final = (1 << 24) - 1
RECORD_MAGIC: Final = int.from_bytes(b"TKR1", "little")
PAD_MAGIC: Final = int.from_bytes(b"TKP1", "little")
MAGIC_SIZE: Final = struct.Struct("<II")  # (magic, size) at RECORD_MAGIC_OFF
U64: Final = struct.Struct("<Q")
RECORD_MAGIC_OFF: Final = 16
RECORD_SIZE_OFF: Final = 20
RECORD_LSN_OFF: Final = struct.calcsize("<16sII")  # the record's own LSN (u64)
RECORD_EXPIRY_OFF: Final = struct.calcsize("<16sIIQQ8sIIIHBB")  # latest expiry of its keys (u32)
RECORD_ALIGN: Final = 8
MIN_RECORD: Final = (RECORD_SIZE + ENTRY_SIZE + RECORD_ALIGN - 1) & ~(RECORD_ALIGN - 1)
F_HAS_PARENT: Final = 1
F_CONSOLIDATED: Final = 2
# A recorded output's segment entries (tokcache.engine.record): what the cluster tier shares,
# found by following the log (Store.follow). Nothing else about the record differs.
F_SEGMENT: Final = 4
U32: Final = struct.Struct("<I")
U32_MAX: Final = 0xFFFFFFFF
MAX_ENTRIES: Final = 0xFFFF

ID_WIDTHS: Final = (3, 4)  # bytes per stored id
ID_BYTES_MAX: Final = 4  # the API's width: packed u32

MIN_ARENA: Final = 16 * 1024
MIN_SIZE: Final = HEADER_SIZE + BUCKET_SIZE + PAGE + MIN_ARENA
MAX_SIZE: Final = 1 << 44  # 16 TiB: far beyond any cap, keeps every offset small


def check_of(data: bytes | bytearray | memoryview) -> bytes:
    """The 16-byte SHA-256 check of ``data`` (record body or static header)."""
    return _hash.digest(data, CHECK_SIZE)


def tag_of(key: bytes) -> int:
    """The key's bucket tag: bytes 7 and 15 mixed (the bucket hashes use the full halves), never 0."""
    return key[7] ^ key[15] or 1


def record_size(n_entries: int, ids_bytes: int) -> int:
    """Bytes a record with ``n_entries`` keys and ``ids_bytes`` of stored ids occupies, padded."""
    raw = RECORD_SIZE + ENTRY_SIZE * n_entries + ids_bytes
    return (raw + RECORD_ALIGN - 1) & ~(RECORD_ALIGN - 1)


def id_bytes_for(vocab_size: int) -> int:
    """The narrowest id width that holds every id of a ``vocab_size`` vocabulary (ids < vocab_size).

    Only an optimisation: an id past the width is refused by ``Store.put``, never truncated.
    """
    return 3 if vocab_size <= 1 << 24 else 4


def check_id_bytes(id_bytes: int) -> int:
    """``id_bytes`` if it is one of ID_WIDTHS; ValueError otherwise."""
    if isinstance(id_bytes, bool) or not isinstance(id_bytes, int) or id_bytes not in ID_WIDTHS:
        raise ValueError(f"id_bytes must be one of {ID_WIDTHS}, got {id_bytes!r}")
    return id_bytes


_native: Any = native.store()  # TOKCACHE_PURE_PYTHON=1: the reference below (the tests compare both)


def narrow(ids: bytes, id_bytes: int) -> bytes | None:
    """Packed LE u32 ``ids`` as ``id_bytes``-wide LE ids, or None if one does not fit.

    Never truncates: an id >= 2**(8 * id_bytes) makes the whole result None. One pass in C
    when the extension is built (``_speedups.narrow``; this is the reference), else extended
    slices, which copy in C too but five times over (~15 µs per 1000 ids), not a Python
    loop per id.
    """
    if _native is not None and id_bytes != ID_BYTES_MAX:
        return _native.narrow(ids, id_bytes)  # type: ignore[no-any-return]
    return _narrow(ids, id_bytes)


def _narrow(ids: bytes, id_bytes: int) -> bytes | None:
    """:func:`narrow` without the extension."""
    if id_bytes == ID_BYTES_MAX:
        return ids
    n = len(ids) // ID_BYTES_MAX
    if ids[3::4] != bytes(n):  # every high byte zero (compare: faster than .count(0))
        return None
    out = bytearray(3 * n)
    out[0::3] = ids[0::4]
    out[1::3] = ids[1::4]
    out[2::3] = ids[2::4]
    return bytes(out)


def widen(data: bytes, id_bytes: int) -> bytes:
    """``id_bytes``-wide LE ids as packed LE u32 (the inverse of :func:`narrow`)."""
    if id_bytes == ID_BYTES_MAX:
        return data
    out = bytearray(len(data) // 3 * 4)  # zero-filled: the high bytes stay 0
    out[0::4] = data[0::3]
    out[1::4] = data[1::3]
    out[2::4] = data[2::3]
    return bytes(out)


@dataclass(frozen=True)
class Geometry:
    """Where the index and the arena live in a segment of ``size`` bytes."""

    size: int
    index_off: int
    n_buckets: int
    arena_off: int
    arena_size: int

    @property
    def index_slots(self) -> int:
        return self.n_buckets * BUCKET_SLOTS


def geometry_for(size: int) -> Geometry:
    """The one geometry a segment of ``size`` bytes has (a pure function of the size).

    Raises ValueError when ``size`` is outside ``[MIN_SIZE, MAX_SIZE]``.
    """
    if not MIN_SIZE <= size <= MAX_SIZE:
        raise ValueError(f"size must be in [{MIN_SIZE}, {MAX_SIZE}] bytes, got {size}")
    usable = size - HEADER_SIZE - PAGE
    n_buckets = max(1, usable // (ARENA_BYTES_PER_SLOT + SLOT_SIZE) // BUCKET_SLOTS)
    index_off = HEADER_SIZE
    # The arena starts on a page so its pages can later be given back independently.
    arena_off = (index_off + n_buckets * BUCKET_SIZE + PAGE - 1) // PAGE * PAGE
    arena_size = (size - arena_off) // RECORD_ALIGN * RECORD_ALIGN
    return Geometry(size, index_off, n_buckets, arena_off, arena_size)


def pack_static(geometry: Geometry, fingerprint: bytes, created: int, id_bytes: int) -> bytes:
    """The static header part followed by its check (``STATIC_CHECK_OFF + CHECK_SIZE`` bytes)."""
    static = STATIC.pack(
        MAGIC,
        LAYOUT_VERSION,
        HEADER_SIZE,
        fingerprint,
        geometry.size,
        geometry.index_off,
        geometry.n_buckets,
        geometry.arena_off,
        geometry.arena_size,
        SLOT_SIZE,
        BUCKET_SLOTS,
        created,
        id_bytes,
        int.from_bytes(os.urandom(8), "little") or 1,
    ).ljust(STATIC_CHECK_OFF, b"\0")
    return static + check_of(static)


@dataclass(frozen=True)
class StaticHeader:
    """The decoded static header of an existing segment (not yet validated)."""

    magic: bytes
    version: int
    header_size: int
    fingerprint: bytes
    geometry: Geometry
    slot_size: int
    bucket_slots: int
    created: int
    id_bytes: int
    generation: int
    check_ok: bool


def unpack_static(page: bytes) -> StaticHeader:
    """Decode the static part of a header page (``page`` holds at least its first bytes)."""
    (
        magic,
        version,
        header_size,
        fingerprint,
        size,
        index_off,
        n_buckets,
        arena_off,
        arena_size,
        slot_size,
        bucket_slots,
        created,
        id_bytes,
        generation,
    ) = STATIC.unpack_from(page)
    check_ok = page[STATIC_CHECK_OFF : STATIC_CHECK_OFF + CHECK_SIZE] == check_of(page[:STATIC_CHECK_OFF])
    return StaticHeader(
        magic=magic,
        version=version,
        header_size=header_size,
        fingerprint=fingerprint,
        geometry=Geometry(size, index_off, n_buckets, arena_off, arena_size),
        slot_size=slot_size,
        bucket_slots=bucket_slots,
        created=created,
        id_bytes=id_bytes,
        generation=generation,
        check_ok=check_ok,
    )
