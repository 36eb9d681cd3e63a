"""Results a server process recently returned, so a client can be answered with a delta.

A growing conversation's ids share a long prefix with the previous turn's.
A client that still holds that turn's result (as a tuple of ints) names it in
``known_results``; the reply then carries only the ids past the shared
prefix. That saves the client most of the cost of a Tokenize it can see: the
``list[int]`` of 16k ids is built from ints it already has (~60 µs) instead
of unpacked (~200 µs), and 60 KB less crosses the socket.

Handles are random per process plus a counter: a handle from another worker
process (or an earlier life of this one) is simply unknown here, never
mistaken for another result. Entries are bytes objects the engine built
anyway; the memo holds references, bounded by their total size.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict

__all__ = ["MAX_KNOWN_RESULTS", "ResultMemo", "common_prefix_ids"]

MAX_KNOWN_RESULTS = 8
DEFAULT_MEMO_BYTES = 64 << 20
# Below this many shared ids a delta saves less than it costs the client to look up.
MIN_DELTA_IDS = 64
_CHUNK = 4096


def common_prefix_ids(a: bytes, b: bytes) -> int:
    """How many leading uint32 ids two packed id sequences share.

    Compares 4 KiB chunks (one memcmp each), then bisects the first chunk that
    differs: ~10 µs for 64 KB, where a byte-wise loop would take milliseconds.
    """
    n = min(len(a), len(b)) // 4 * 4
    lo = 0
    while lo < n:
        hi = min(lo + _CHUNK, n)
        if a[lo:hi] != b[lo:hi]:
            break
        lo = hi
    else:
        return n // 4
    hi = min(lo + _CHUNK, n)  # the prefix ends in [lo, hi)
    while hi - lo > 4:
        mid = (lo + hi) // 2 // 4 * 4
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo // 4


class ResultMemo:
    """Handle -> packed ids, least recently used out first; thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        self._max = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._prefix = os.urandom(8)
        self._counter = itertools.count(1)

    def put(self, ids: bytes) -> bytes:
        """Remember ``ids``; returns its new handle (empty when it is too big to keep)."""
        if len(ids) > self._max:
            return b""
        handle = self._prefix + next(self._counter).to_bytes(8, "little")
        with self._lock:
            self._entries[handle] = ids
            self._bytes += len(ids)
            while self._bytes > self._max:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped)
        return handle

    def get(self, handle: bytes) -> bytes | None:
        with self._lock:
            ids = self._entries.get(handle)
            if ids is not None:
                self._entries.move_to_end(handle)
            return ids

    def best_base(self, handles: list[bytes], ids: bytes) -> tuple[bytes, int]:
        """(handle, shared ids) of the known result sharing the longest prefix with
        ``ids``; (b"", 0) when none shares at least MIN_DELTA_IDS."""
        best, best_n = b"", MIN_DELTA_IDS - 1
        for handle in handles:
            known = self.get(handle)
            if known is not None:
                n = common_prefix_ids(known, ids)
                if n > best_n:
                    best, best_n = handle, n
        return (best, best_n) if best else (b"", 0)
