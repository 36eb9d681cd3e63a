"""A per-process memo of full id sequences the store holds, validated by record version.

Reading a 40-link chain out of shared memory (copy + verify every link) is
the largest fixed cost of a warm Tokenize (~120 µs for 16k ids). The keys a
process just stored are the ones its next request for the same conversation
looks up, so it keeps their full ids, and reuses them only while
``store.version(key)`` still names the same record — records are immutable
and never reuse a position, so an unchanged version means unchanged ids.
Anything else (evicted, replaced, consolidated) is a memo miss and the chain
is read from the store as usual.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from tokcache.store import Store

__all__ = ["ChainMemo"]

DEFAULT_MEMO_BYTES = 64 << 20


class ChainMemo:
    """LRU by bytes; thread-safe (one lock guards the dict and the byte count)."""

    def __init__(self, max_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        self._max = max_bytes
        self._bytes = 0
        # key -> (record version, buffer, bytes of the buffer that are key's ids)
        self._entries: OrderedDict[bytes, tuple[int, bytes, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, store: Store, key: bytes) -> bytes | None:
        """The memoized ids of ``key`` if the store still maps it to the same record."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        if store.version(key) != entry[0]:
            self.drop(key)
            return None
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
        _, buf, n = entry
        return buf if n == len(buf) else buf[:n]

    def put(self, store: Store, key: bytes, ids: bytes, n: int | None = None) -> None:
        """Remember ``ids[:n]`` for ``key`` as stored now (call right after the store put).

        Several keys may share one buffer; the byte budget counts each entry's share.
        """
        n = len(ids) if n is None else n
        version = store.version(key)
        if version is None or n > self._max:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[2]
            self._entries[key] = (version, ids, n)
            self._bytes += n
            while self._bytes > self._max:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    def drop(self, key: bytes) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[2]
