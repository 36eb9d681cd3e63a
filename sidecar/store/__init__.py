"""Shared-memory token store: 16-byte keys -> token-id prefixes, crash-safe, lock-free reads.

One POSIX shared-memory segment per model fingerprint holds a header, an index and a
circular log of records (see ``_layout``). Entries chain to a parent record so a growing
conversation costs memory linear in its length; eviction is FIFO by bytes with hot chains
copied forward (approximate LRU), plus a TTL per entry kind.

Typical use::

    store = Store.open(prefix="tokcache", fingerprint=fp_hex, size=256 << 20)
    store.put(None, 0, ids, [(key_turn1, len(ids) // 4)], Kind.L1)
    store.get(key_turn1)  # -> ids, or None
"""

from __future__ import annotations

from ._store import Kind, Store, StoreStats, segment_name
from .errors import LockTimeout, SegmentError, SegmentMismatch, StoreClosed, StoreError

__all__ = [
    "Kind",
    "LockTimeout",
    "SegmentError",
    "SegmentMismatch",
    "Store",
    "StoreClosed",
    "StoreError",
    "StoreStats",
    "segment_name",
]
