"""Client-side L0 lookups: a co-located process reads the sidecar's segment, no RPC.

The key of a whole text is computed exactly as the engine computes it
(:class:`tokcache.store.keys.KeyStream`: salt, mode, text, then the L0 suffix), and the
segment is mapped read-only (:class:`~tokcache.store._reader.StoreReader`), so a hit
costs a hash and a verified copy — no socket, no server CPU — and a miss costs the same
before the caller falls back to the RPC. What a hit returns is exactly what the sidecar
put for that text: a corrupt, evicted or expired entry is a miss.

Usage::

    lookup = DirectLookup(prefix="tokcache", fingerprint=model_info.fingerprint)
    ids = lookup.get_ids(text, salt=salt)        # list[int] or None: then call Tokenize
"""

from __future__ import annotations

import sys
import threading
import time
from array import array
from collections.abc import Callable

from ._names import segment_name
from ._reader import StoreReader
from .errors import StoreError
from .keys import l0_key

__all__ = ["DirectLookup", "l0_key"]

class DirectLookup:
    """L0 lookups in the segment of one tokenizer (``<prefix>-<fingerprint>``).

    The ids are the sidecar's *raw* ids for the text: what Tokenize returns with
    ``add_special_tokens=False`` (the chat default), and with ``add_special_tokens=True``
    for tokenizers that add no BOS/EOS (Qwen). Thread-safe. Attaches lazily and again
    (at most every ``retry_interval`` seconds) when the segment is missing or replaced;
    until then every lookup is a miss. Never writes to shared memory.
    """

    def __init__(
        self,
        *,
        prefix: str,
        fingerprint: str,
        retry_interval: float = 1.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.name = segment_name(prefix, fingerprint)  # ValueError for bad names, now
        self._prefix = prefix
        self._fingerprint = fingerprint
        self._retry = retry_interval
        self._clock = clock
        # Guards _reader/_checked/_old. Lookups read _reader without it: a replaced reader
        # is kept open (in _old) until close(), so a racing get never sees an unmapped one.
        self._lock = threading.Lock()
        self._reader: StoreReader | None = None
        self._old: list[StoreReader] = []
        self._checked = -float("inf")

    def get(self, text: str, *, salt: str = "", mode: str = "kv-stable") -> bytes | None:
        """The raw ids (packed little-endian uint32, whatever width the segment stores them
        in) the sidecar stored for ``text``, or None."""
        reader = self._current()
        if reader is None:
            return None
        try:
            key = l0_key(text, salt=salt, mode=mode)
        except UnicodeEncodeError:
            return None  # the server refuses such text too
        try:
            return reader.get(key)
        except StoreError:
            return None

    def get_ids(self, text: str, *, salt: str = "", mode: str = "kv-stable") -> list[int] | None:
        """Like :meth:`get`, as a list of ints."""
        data = self.get(text, salt=salt, mode=mode)
        if data is None:
            return None
        ids = array("I")
        ids.frombytes(data)
        if sys.byteorder != "little":  # pragma: no cover
            ids.byteswap()
        return ids.tolist()

    def _current(self) -> StoreReader | None:
        reader = self._reader
        now = time.monotonic()
        if reader is not None and now - self._checked < self._retry:
            return reader
        with self._lock:
            if now - self._checked < self._retry:
                return self._reader
            self._checked = now
            if self._reader is not None and not self._reader.replaced:
                return self._reader
            try:
                fresh: StoreReader | None = StoreReader.attach(
                    prefix=self._prefix, fingerprint=self._fingerprint, clock=self._clock
                )
            except StoreError:
                fresh = None
            if self._reader is not None:
                self._old.append(self._reader)
            self._reader = fresh
            return fresh

    def close(self) -> None:
        """Unmap everything. Idempotent; no lookup may run concurrently."""
        with self._lock:
            for reader in [*self._old, *([self._reader] if self._reader else [])]:
                reader.close()
            self._old.clear()
            self._reader = None

    def __enter__(self) -> DirectLookup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
