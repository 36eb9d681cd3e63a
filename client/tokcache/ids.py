"""Token ids as packed little-endian uint32: the one format ids cross a boundary in.

The wire (``bytes`` fields of ``tokcache.v1``), the store's API and the encoders all
speak it; these are its encoder and decoder (``tokcache.engine.ids.unpack_interned`` decodes
it too, into a client's shared int objects, with ``unpack_ids`` as its reference).
:func:`common_prefix` measures what two id sequences share, as a prefix cache sees it.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from tokcache import native

__all__ = ["common_prefix", "le_bytes", "pack_ids", "unpack_ids"]

_native: Any = native.engine()  # TOKCACHE_PURE_PYTHON=1: array below


def le_bytes(ids: array[int]) -> bytes:
    """An ``array('I')`` as little-endian uint32 bytes."""
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        ids = array("I", ids)
        ids.byteswap()
    return ids.tobytes()


def pack_ids(ids: Iterable[int]) -> bytes:
    """``ids`` as packed little-endian uint32. OverflowError/TypeError for a value that is not one.

    A list is packed in one C pass when the extension is built (a write's ~5000 ids: ~100 µs
    through ``array``); ``array`` stays the reference (the tests compare both).
    """
    if _native is not None and type(ids) is list:
        return _native.pack(ids)  # type: ignore[no-any-return]
    return le_bytes(array("I", ids))


def unpack_ids(data: bytes) -> list[int]:
    """Packed little-endian uint32 ``data`` as a list of ints (``len(data) % 4`` must be 0)."""
    ids = array("I")
    ids.frombytes(data)
    if sys.byteorder != "little":  # pragma: no cover
        ids.byteswap()
    return ids.tolist()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share: the tokens of ``a`` a prefix cache holding
    ``b`` reuses (before rounding down to its blocks)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
