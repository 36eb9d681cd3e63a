"""Read-only access to a live segment: lookups without the server, and ``stats``.

A :class:`StoreReader` maps a segment ``PROT_READ``: it can never write a byte of it, so
it bumps no counter, touches no LRU stamp and copies nothing forward; its ``get`` proves
every hit exactly like :meth:`Store.get` (record checks, chain links, tail re-read), so it
returns the ids put for the key or None, whatever the writers are doing meanwhile.

:func:`read_stats` enumerates the segments under a prefix for ``tokcache-sidecar stats``.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from typing import Any, Final

from ._index import Index
from ._layout import (
    HEADER_SIZE,
    KEY_SIZE,
    LSN_MASK,
    RETIRED_MARK,
    W_AR_PUTS,
    W_MARKS,
    W_RETIRED,
    W_TAIL,
    ZERO_KEY,
    marks_may_live,
    unpack_static,
    widen,
)
from ._log import Known, Log, Walk
from ._manifest import read_manifest
from ._names import segment_name
from ._segment import SHM_DIR, Segment, attach_readonly, shm_path
from ._stats import StoreStats, stats_of
from .errors import SegmentMismatch, StoreClosed, StoreError

__all__ = ["StoreReader", "read_stats"]

_SEGMENT_RE: Final = re.compile(r"(?P<prefix>.+)-(?P<fingerprint>[0-9a-f]{32})")


class StoreReader:
    """A read-only mapping of one segment. ``get`` is lock-free and thread-safe.

    Create with :meth:`attach`. The mapping keeps the
    segment it found: when a sidecar replaces the segment (another size or layout),
    :attr:`replaced` turns True and the caller should attach again. ``id_bytes`` is the
    segment's stored id width (from its header); ``get`` returns u32 ids regardless.
    """

    name: str
    size: int
    fingerprint: str
    id_bytes: int

    def __init__(self, segment: Segment, clock: Callable[[], float]) -> None:
        geometry = segment.geometry
        self.name = segment.name
        self.size = geometry.size
        self.fingerprint = unpack_static(segment.mm[:HEADER_SIZE]).fingerprint.hex()
        self.id_bytes = segment.id_bytes
        self._segment = segment
        self._clock = clock
        self._view = memoryview(segment.mm)
        self._words = self._view[:HEADER_SIZE].cast("Q")
        self._index = Index(segment.mm, geometry.index_off, geometry.n_buckets, self._words)
        self._log = Log(segment.mm, geometry.arena_off, geometry.arena_size, self._words, self.name, self.id_bytes,
                        fd=segment.fd)
        self._closed = False

    @classmethod
    def attach(cls, *, prefix: str, fingerprint: str, clock: Callable[[], float] | None = None) -> StoreReader:
        """Map ``<prefix>-<fingerprint>`` read-only (its size is read from the segment).

        Raises ValueError for a bad prefix or fingerprint, SegmentError when the segment
        does not exist (yet), SegmentMismatch when it has another layout or is corrupt.
        """
        name = segment_name(prefix, fingerprint)
        return cls(attach_readonly(name, bytes.fromhex(fingerprint)), clock or time.time)

    @classmethod
    def attach_name(cls, name: str, clock: Callable[[], float] | None = None) -> StoreReader:
        """Map the segment called ``name`` ("/prefix-fingerprint") read-only, any fingerprint."""
        return cls(attach_readonly(name), clock or time.time)

    def read(self, key: bytes, known: Known | None = None, *, widened: bool = True) -> Walk | None:
        """:meth:`Store.read` without writing anything (no counters, no LRU stamp, no copy)."""
        if self._closed:
            raise StoreClosed(f"{self.name} is closed")
        if len(key) != KEY_SIZE or key == ZERO_KEY:
            raise ValueError("key must be 16 bytes, not all zero")
        soff = self._index.find(key)
        if soff < 0:
            return None
        lsn_kind, expiry, _access = self._index.read(soff)
        now = self._clock()
        if expiry and now >= expiry:
            return None
        found = self._log.walk_known(key, lsn_kind, known)
        if isinstance(found, int) or (found.key_expiry and now >= found.key_expiry):
            return None
        return found._replace(rest=widen(found.rest, self.id_bytes)) if widened else found

    def slot(self, key: bytes) -> tuple[int, int] | None:
        """(record LSN, tail) of ``key``'s live, unexpired slot, or None (see ``Store.slot``)."""
        if self._closed:
            raise StoreClosed(f"{self.name} is closed")
        soff = self._index.find(key)
        if soff < 0:
            return None
        lsn_kind, expiry, _ = self._index.read(soff)
        if expiry and self._clock() >= expiry:
            return None
        tail = int(self._words[W_TAIL])
        lsn = lsn_kind & LSN_MASK
        return (lsn, tail) if lsn >= tail else None

    def probe(self, key: bytes) -> bool:
        """:meth:`contains` for a key the caller made (16 bytes, from ``tokcache.store.keys``):
        the lookup's longest-prefix search calls it ~10 times per request."""
        soff = self._index.find(key)
        if soff < 0:
            return False
        lsn_kind, expiry, _ = self._index.read(soff)
        return (not expiry or self._clock() < expiry) and lsn_kind & LSN_MASK >= self._words[W_TAIL]

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` has a live, unexpired slot (see :meth:`Store.contains`)."""
        if self._closed:
            raise StoreClosed(f"{self.name} is closed")
        if len(key) != KEY_SIZE or key == ZERO_KEY:
            raise ValueError("key must be 16 bytes, not all zero")
        soff = self._index.find(key)
        if soff < 0:
            return False
        lsn_kind, expiry, _ = self._index.read(soff)
        if expiry and self._clock() >= expiry:
            return False
        return lsn_kind & LSN_MASK >= self._words[W_TAIL]

    def last_present(self, keys: list[bytes], lo: int, hi: int) -> int:
        """See :meth:`Store.last_present`."""
        return self._index.last_live(keys, lo, hi, self._clock(), self._words[W_TAIL])

    def tail(self) -> int:
        """The log's tail now: records below it are evicted (a slot pointing under it is dead)."""
        if self._closed:
            raise StoreClosed(f"{self.name} is closed")
        return int(self._words[W_TAIL])

    def native_region(self) -> tuple[Any, int, int] | None:
        """(mapping, index offset, buckets): the index as a native reader probes it, while this
        stays open (see ``tokcache/store/_index.h``)."""
        if self._closed:
            raise StoreClosed(f"{self.name} is closed")
        return self._index.region()

    def holds_ar(self) -> bool:
        """Whether an AR record was ever put in this segment (see :meth:`Store.holds_ar`)."""
        if self._closed:
            raise StoreClosed(f"{self.name} is closed")
        return self._words[W_AR_PUTS] > 0

    def marks(self) -> bool:
        """Whether a pending-record mark was ever put in this segment (see :meth:`Store.marks`)."""
        if self._closed:
            raise StoreClosed(f"{self.name} is closed")
        return self._words[W_MARKS] > 0

    def marks_live(self, now: float) -> bool:
        """Whether a mark put in this segment may be live at ``now`` (see :meth:`Store.marks_live`)."""
        if self._closed:
            raise StoreClosed(f"{self.name} is closed")
        return marks_may_live(self._words, now)

    def get(self, key: bytes) -> bytes | None:
        """The ids stored for ``key`` (packed LE uint32), or None; see :meth:`Store.get`.

        Never returns bytes other than ones put for this key, never waits, never writes.
        Raises ValueError for a key that is not 16 bytes or is all zero.
        """
        if self._closed:
            raise StoreClosed(f"{self.name} is closed")
        if len(key) != KEY_SIZE or key == ZERO_KEY:
            raise ValueError("key must be 16 bytes, not all zero")
        soff = self._index.find(key)
        if soff < 0:
            return None
        lsn_kind, expiry, _access = self._index.read(soff)
        now = self._clock()
        if expiry and now >= expiry:
            return None
        found = self._log.walk(key, lsn_kind)
        if isinstance(found, int):
            return None
        data, _oldest, _depth, key_expiry, _chain_expiry = found
        if key_expiry and now >= key_expiry:
            return None
        return widen(data, self.id_bytes)

    def manifest(self) -> bytes | None:
        """The published manifest bytes, or None (see ``Store.publish``)."""
        if self._closed:
            raise StoreClosed(f"{self.name} is closed")
        return read_manifest(self._segment.mm)

    @property
    def generation(self) -> int:
        """The segment's random identity (see ``Store.generation``)."""
        return self._segment.generation

    @property
    def replaced(self) -> bool:
        """True when this segment was retired, or its name now refers to another file."""
        if self._closed:
            return True
        if self._words[W_RETIRED] == RETIRED_MARK:
            return True
        try:
            return os.stat(shm_path(self.name)).st_ino != self._segment.inode
        except FileNotFoundError:
            return True

    def stats(self) -> StoreStats:
        """The segment's counters and sizes (see StoreStats), read without the lock."""
        if self._closed:
            raise StoreClosed(f"{self.name} is closed")
        return stats_of(self._words, self._index, self._log, self.size, self._segment.fd, self._clock())

    def close(self) -> None:
        """Unmap. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._words.release()
        self._view.release()
        self._segment.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<StoreReader {self.name} {'closed' if self._closed else f'{self.size} bytes'}>"


def read_stats(prefix: str) -> list[dict[str, Any]]:
    """Stats of every live segment named ``<prefix>-<32 hex>`` in /dev/shm, as JSON-able dicts.

    Skips semaphores, creators' temporaries and other prefixes that merely start with
    ``prefix``. Each dict has ``name``, ``fingerprint``, ``path`` and every StoreStats
    field (``live_entries`` keyed by kind name); a segment that cannot be read (another
    layout version, corrupt header) is reported with an ``error`` instead. Read-only:
    never changes a segment. Sorted by name.
    """
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    out: list[dict[str, Any]] = []
    for entry in entries:
        m = _SEGMENT_RE.fullmatch(entry)
        if m is None or m["prefix"] != prefix:
            continue
        item: dict[str, Any] = {"name": entry, "fingerprint": m["fingerprint"], "path": os.path.join(SHM_DIR, entry)}
        try:
            with StoreReader.attach_name("/" + entry) as reader:
                item.update(_published(reader.manifest()))
                item.update(reader.stats().as_dict())
        except SegmentMismatch as exc:
            item["error"] = f"not readable by this version: {exc}"
        except StoreError as exc:
            item["error"] = str(exc)
        out.append(item)
    return out


def _published(manifest: bytes | None) -> dict[str, Any]:
    """Who publishes a segment, from its manifest: the models served from it, their
    directories and the encoder (empty when there is no manifest or it is not JSON)."""
    if not manifest:
        return {}
    try:
        data = json.loads(manifest)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: data[k] for k in ("models", "model_dirs", "backend") if k in data}
