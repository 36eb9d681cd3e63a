"""Shared-memory token store: 16-byte keys -> token-id prefixes, crash-safe, lock-free reads.

One POSIX shared-memory segment per model fingerprint holds a header, an index and a
circular log of records (see ``_layout``). Entries chain to a parent record so a growing
conversation costs memory linear in its length; eviction is FIFO by bytes with hot chains
copied forward (approximate LRU), a TTL per entry kind, and a soft cap that memory
pressure lowers (``Store.shrink``: evict, and give the pages back to the kernel).

Ids go in and come out as packed little-endian uint32; a segment created with
``id_bytes=3`` (``id_bytes_for(vocab_size)``) stores them in 3 bytes each.

Typical use::

    # What /dev/shm can back (a page it cannot is SIGBUS): a smaller size and why, or SegmentFull.
    size, why = usable_size(segment_name("tokcache", fp_hex), 256 << 20)
    store = Store.open(prefix="tokcache", fingerprint=fp_hex, size=size, id_bytes=id_bytes_for(vocab))
    store.put(None, 0, ids, [(key_turn1, len(ids) // 4)], Kind.L1)
    store.get(key_turn1)  # -> ids, or None

Readers that must never write (a co-located client, ``tokcache-sidecar stats``)::

    reader = StoreReader.attach(prefix="tokcache", fingerprint=fp_hex)
    DirectLookup(prefix="tokcache", fingerprint=fp_hex).get_ids(text)   # L0 without RPC
    read_stats("tokcache")  # -> [{"name": ..., "used_bytes": ..., ...}, ...]
"""

from __future__ import annotations

from ._direct import DirectLookup, l0_key
from ._layout import F_SEGMENT, id_bytes_for
from ._log import Known, RecordRef, Walk
from ._names import segment_name
from ._reader import StoreReader, read_stats
from ._segment import usable_size
from ._stats import EVICTION_CAUSES, Kind, StoreStats
from ._store import Shrink, Store
from .errors import LockTimeout, SegmentError, SegmentFull, SegmentMismatch, StoreClosed, StoreError

__all__ = [
    "EVICTION_CAUSES",
    "F_SEGMENT",
    "DirectLookup",
    "Kind",
    "Known",
    "RecordRef",
    "LockTimeout",
    "SegmentError",
    "SegmentFull",
    "SegmentMismatch",
    "Shrink",
    "Store",
    "StoreClosed",
    "StoreError",
    "StoreReader",
    "StoreStats",
    "Walk",
    "id_bytes_for",
    "l0_key",
    "read_stats",
    "segment_name",
    "usable_size",
]
