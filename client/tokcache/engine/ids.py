"""How a process holds token ids: packed bytes (the sidecar) or ``list[int]`` (clients).

The lookup decides the same way in every process; only the container its answer is
built in differs. The sidecar answers gRPC, whose ``bytes`` field takes packed LE
uint32 as is; a client hands vLLM (or any caller) a ``list[int]``, and building a list
of 272k ints from bytes costs ~4.5 ms here, while copying a list costs ~0.75 ms. So a
client keeps lists — as :class:`Chunks`, slices of lists it already holds, so that
growing a conversation by a turn copies nothing — and copies once, into the list it
hands its caller (:meth:`IdFormat.result`). The sidecar keeps bytes.

Containers are never mutated: a memo entry refers to a prefix of one, and sharing is
free. The lists a client keeps are untracked by the cyclic garbage collector (:func:`untrack`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from itertools import islice
from typing import Any, Generic, TypeVar

from tokcache import native
from tokcache.ids import unpack_ids

__all__ = ["BYTES", "LISTS", "BytesFormat", "Chunks", "IdFormat", "Ids", "ListFormat", "Out", "intern_ids", "joined",
           "sliced", "unpack_interned"]

Ids = TypeVar("Ids", bytes, "Chunks")  # what a process keeps
Out = TypeVar("Out", bytes, list[int])  # what a caller gets

_native: Any = native.engine()


_L = TypeVar("_L", bound="list[Any]")


def untrack(ids: _L) -> _L:
    """``ids``, no longer tracked by the cyclic garbage collector (without the C extension:
    unchanged). A list of ints (or of tuples of ints: boundary spans) is in no cycle, and
    each collection of a process would visit every id of every list a reader keeps — ~1 M
    references for a few long conversations, each a memory access — so a client's memo
    chains and encodings cost every collection of the caller's process nothing. Only for
    lists no caller gets: it may put anything in its own."""
    return ids


if _native is not None:
    untrack = _native.untrack  # noqa: F811 - the same contract in C


# Ids below this get one int object per value in a client process (see intern_ids): every
# vocabulary shipped here is smaller (Qwen3 151,669, Llama 3 128,256); larger ids keep theirs.
INTERNED_IDS = 1 << 18
_table: list[Any] = []  # made on first use (2 MiB of slots): the sidecar keeps bytes, never needs it
_table_lock = threading.Lock()


def _interned() -> list[Any]:
    global _table
    if not _table:
        with _table_lock:
            if not _table:
                _table = [None] * INTERNED_IDS
    return _table


def intern_ids(ids: list[int]) -> list[int]:
    """``ids``, each int replaced in place by this process's one object for its value (without
    the C extension: unchanged). Equal values, the same list.

    An encoder makes a new int object per id, so a client's lists (memo chains, encodings,
    results: tens of thousands of ids per conversation) refer to ints scattered over its
    heap, and each copy or release of a list writes to every one of them (reference counts).
    With one object per id value the ints a process touches are the few thousand distinct
    ids its texts use, dense and warm in the CPU caches while requests come back to back
    (an encoder's output is short: its ints are few), and reading a long chain from the
    segment allocates no int (see :meth:`ListFormat.from_stored`).
    """
    if _native is None:
        return ids
    return _native.intern(ids, _interned())  # type: ignore[no-any-return]


def unpack_interned(data: bytes, width: int = 4) -> list[int]:
    """``unpack_ids(data)`` with the ints of :func:`intern_ids` (not made one per id); ``data``
    holds ``width`` (3 or 4) bytes per id."""
    if _native is None:
        return unpack_ids(data if width == 4 else _widen(data))
    return _native.unpack(data, _interned(), width)  # type: ignore[no-any-return]


def _widen(data: bytes) -> bytes:
    """3-byte LE ids as packed LE u32 (tokcache.store._layout.widen, without importing the store)."""
    out = bytearray(len(data) // 3 * 4)
    out[0::4] = data[0::3]
    out[1::4] = data[1::3]
    out[2::4] = data[2::3]
    return bytes(out)


class IdFormat(Generic[Ids, Out]):
    """Operations the lookup needs on one id container type (``Ids``) and its callers' (``Out``)."""

    name: str

    def from_stored(self, data: bytes, width: int) -> Ids:
        """A container of ``data``, ids ``width`` (3 or 4) bytes each, as a segment stores them."""
        return self.from_u32(data if width == 4 else _widen(data))

    def from_u32(self, data: bytes) -> Ids:
        """A new container holding packed LE uint32 ``data``."""
        raise NotImplementedError

    def from_list(self, ids: list[int]) -> Ids:
        """A new container holding ``ids`` (which it may keep: not to be mutated after)."""
        raise NotImplementedError

    def from_chunks(self, ids: Chunks) -> Ids:
        """A new container holding ``ids`` (whose lists it may keep: not to be mutated after)."""
        return self.from_list(joined(ids))

    def own(self, ids: list[int]) -> list[int]:
        """A list an encoder (or a record) just made, as this format keeps lists: as is (the
        sidecar packs them), or with :func:`intern_ids`' ints (a client keeps them)."""
        return ids

    def own_u32(self, data: bytes) -> list[int]:
        """``own(unpack_ids(data))``, without making ints only to replace them."""
        return unpack_ids(data)

    def count(self, ids: Ids) -> int:
        """How many ids ``ids`` holds."""
        raise NotImplementedError

    def grow(self, base: Ids, n: int, more: Ids) -> Ids:
        """A container holding ``base[:n] + more`` (``base`` is left as it is)."""
        raise NotImplementedError

    def result(self, ids: Ids, n: int, prefix: tuple[int, ...] = (), suffix: tuple[int, ...] = ()) -> Out:
        """What a caller gets: ``prefix + ids[:n] + suffix``, which it owns."""
        raise NotImplementedError

    def compact(self, ids: Ids) -> Ids:
        """``ids`` in the container cheapest to read from (for a memo entry; write path)."""
        return ids

    def to_u32(self, ids: Ids, n: int) -> bytes:
        """The first ``n`` ids as packed LE uint32."""
        raise NotImplementedError


class BytesFormat(IdFormat[bytes, bytes]):
    """Packed little-endian uint32 ``bytes`` (immutable: sharing is free)."""

    name = "bytes"

    def from_u32(self, data: bytes) -> bytes:
        return bytes(data)

    def from_list(self, ids: list[int]) -> bytes:
        from tokcache.ids import pack_ids

        return pack_ids(ids)

    def count(self, ids: bytes) -> int:
        return len(ids) // 4

    def grow(self, base: bytes, n: int, more: bytes) -> bytes:
        if not more:
            return base if len(base) == 4 * n else base[: 4 * n]
        return (base if len(base) == 4 * n else base[: 4 * n]) + more

    def result(self, ids: bytes, n: int, prefix: tuple[int, ...] = (), suffix: tuple[int, ...] = ()) -> bytes:
        body = ids if len(ids) == 4 * n else ids[: 4 * n]
        if not prefix and not suffix:
            return body
        from tokcache.ids import pack_ids

        return pack_ids(prefix) + body + pack_ids(suffix)

    def to_u32(self, ids: bytes, n: int) -> bytes:
        return ids if len(ids) == 4 * n else ids[: 4 * n]


class Chunks:
    """Ids as a chain of list slices: ``parts`` are (list, how many of its first ids), in order.

    Growing a conversation appends a part; taking a prefix drops or shortens parts — no
    id is copied until a caller gets its own list (:meth:`ListFormat.result`: one copy
    of each part). Parts are never mutated once in a Chunks, so sharing is free.
    """

    __slots__ = ("parts", "n")

    def __init__(self, parts: tuple[tuple[list[int], int], ...], n: int) -> None:
        self.parts = parts
        self.n = n

    def take(self, k: int) -> Chunks:
        """The first ``k`` ids (``k <= n``)."""
        if k >= self.n:
            return self
        out: list[tuple[list[int], int]] = []
        left = k
        for ref, ln in self.parts:
            if left <= 0:
                break
            out.append((ref, min(ln, left)))
            left -= ln
        return Chunks(tuple(out), k)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        for ref, ln in self.parts:
            yield from islice(ref, ln)


def joined(ids: Chunks) -> list[int]:
    """``ids`` as one new list."""
    return LISTS.result(ids, ids.n)


def sliced(ids: Chunks, lo: int, hi: int) -> list[int]:
    """``ids[lo:hi]`` as one new list (``0 <= lo <= hi <= ids.n``)."""
    out: list[int] = []
    pos = 0
    for ref, ln in ids.parts:
        if pos >= hi:
            break
        a, b = max(lo - pos, 0), min(hi - pos, ln)
        if a < b:
            out += ref[a:b]
        pos += ln
    return out


# Parts past which a container is flattened into one list (one copy, then short chains again).
MAX_PARTS = 64
# Parts past which a memo entry is flattened when it is stored (write path): a result copies
# a few parts about as fast as one, and flattening every turn copies the whole conversation.
COMPACT_PARTS = 8


class ListFormat(IdFormat["Chunks", list[int]]):
    """``list[int]`` for callers, kept as :class:`Chunks` (copied once, for each caller)."""

    name = "list"

    def from_u32(self, data: bytes) -> Chunks:
        return self.from_stored(data, 4)

    def from_stored(self, data: bytes, width: int) -> Chunks:
        # intern_ids' ints: a chain of a long conversation is tens of thousands of ids, and new
        # int objects for them would be megabytes of fresh memory per read, freed after it and
        # faulted in again by the next (the table's ints are already there).
        ids = untrack(unpack_interned(data, width))
        return Chunks(((ids, len(ids)),) if ids else (), len(ids))

    def own(self, ids: list[int]) -> list[int]:
        return intern_ids(ids)

    def own_u32(self, data: bytes) -> list[int]:
        return unpack_interned(data)

    def from_list(self, ids: list[int]) -> Chunks:
        """``ids`` (now this container's: untracked, see :func:`untrack`) as Chunks."""
        untrack(ids)
        return Chunks(((ids, len(ids)),) if ids else (), len(ids))

    def from_chunks(self, ids: Chunks) -> Chunks:
        """``ids`` itself: whoever made it untracked its lists (lookup._Tail.chunks)."""
        return ids

    def count(self, ids: Chunks) -> int:
        return ids.n

    def grow(self, base: Chunks, n: int, more: Chunks) -> Chunks:
        head = base.take(n)
        parts = head.parts + more.parts
        if len(parts) > MAX_PARTS:
            flat = untrack(self.result(Chunks(parts, head.n + more.n), head.n + more.n))
            return Chunks(((flat, len(flat)),), len(flat))
        return Chunks(parts, head.n + more.n)

    def result(self, ids: Chunks, n: int, prefix: tuple[int, ...] = (), suffix: tuple[int, ...] = ()) -> list[int]:
        if _native is not None:  # the same, allocated once at its final size (see _speedups.join)
            return _native.join(ids.parts, n, prefix, suffix)  # type: ignore[no-any-return]
        out = list(prefix)
        left = n
        for ref, ln in ids.parts:
            if left <= 0:
                break
            take = min(ln, left)
            extra = len(ref) - take
            if extra <= take:
                out += ref  # whole, then cut: one copy (a slice first would copy twice)
                if extra:
                    del out[-extra:]
            else:
                out += ref[:take]
            left -= take
        if suffix:
            out.extend(suffix)
        return out

    def compact(self, ids: Chunks) -> Chunks:
        """One list once ids are in more than COMPACT_PARTS parts: a result copies a few
        parts instead of one per turn the chain grew by (each a few µs of interpreter work
        when its caches are cold). Done when a memo entry is stored, after the reply."""
        if len(ids.parts) <= COMPACT_PARTS:
            return ids
        flat = untrack(self.result(ids, ids.n))
        return Chunks(((flat, len(flat)),), len(flat))

    def to_u32(self, ids: Chunks, n: int) -> bytes:
        from tokcache.ids import pack_ids

        return pack_ids(self.result(ids, n))


BYTES = BytesFormat()
LISTS = ListFormat()
