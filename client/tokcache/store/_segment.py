"""POSIX shared-memory segments: create, attach, validate, replace.

A segment's name only ever refers to a fully initialised segment or to nothing:

* **create** builds the segment under a temporary name, writes the header, then publishes it
  with ``link(2)``, which fails if the name exists (atomic create-if-absent). POSIX shm has
  no rename or link call, so this uses the tmpfs that backs it on Linux (``/dev/shm``).
* **attach** opens the name, checks the file size and the header (magic, layout version,
  header check, fingerprint, geometry, id width) and maps it. The id width is the one the
  creator chose: an attacher's own choice only applies to segments it creates.
* **attach read-only** (``attach_readonly``) maps an existing segment ``PROT_READ`` with
  the size it has, for readers that must never write (co-located clients, ``stats``).
* **replace** happens when attach finds a segment this opener cannot use. Under an
  ``flock`` on that segment's file, the replacer re-checks that the name still refers to the
  same inode, marks the old segment retired (so processes still attached stop writing to it)
  and unlinks it; then it creates a new one. Concurrent replacers of one inode serialise on
  the flock and the second finds the name changed, so no one unlinks a fresh segment.

**Backing.** A store into a mapped tmpfs page the filesystem cannot allocate (``/dev/shm``
smaller than the segment, or filled by someone else) is SIGBUS, and so is a *read* of a
page that is a hole (shmem allocates on any fault). So pages are allocated with
``posix_fallocate``, which fails with ENOSPC (:class:`SegmentFull`) instead: the whole
segment at creation, the header and index again at attach (a segment written by an older
version may be sparse), and each arena range right before the writer stores into it
(:func:`reserve`; released pages are holes again). :func:`usable_size` sizes a segment to
what the tmpfs can back before it is created. Nothing here ever truncates a segment:
replacement unlinks, so an existing mapping keeps its file and stays valid.

Linux only: the flock, ``/dev/shm`` (a tmpfs) and ``/proc`` are assumed.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import posix_ipc

from . import _layout, _proc
from ._layout import HEADER_SIZE, MAGIC, PAGE, RETIRED_MARK, W_RETIRED, Geometry
from .errors import SegmentError, SegmentFull, SegmentMismatch

__all__ = [
    "SHM_DIR",
    "Segment",
    "attach_existing",
    "attach_readonly",
    "flocked",
    "open_segment",
    "reserve",
    "shm_path",
    "temp_name",
    "unlink_segment",
    "usable_size",
]

log = logging.getLogger(__name__)

SHM_DIR: Final = "/dev/shm"
MODE: Final = 0o600
_OPEN_ATTEMPTS: Final = 16
# A creator publishes its temporary within milliseconds; older leftovers come from a crash.
_STALE_TEMP_SECONDS: Final = 60.0
# Kept free beside a segment that fits as asked: the writer lock's semaphore (a page) and
# small objects of other users.
_SLACK: Final = 64 * 1024
# A segment that does not fit as asked leaves this share (1/n) of what is available to the
# other users of /dev/shm (vLLM's own shared memory, NCCL) rather than taking all of it.
_HEADROOM_SHARE: Final = 8


def shm_path(name: str) -> str:
    """The tmpfs path behind the POSIX shm ``name`` ("/x" -> "/dev/shm/x")."""
    return os.path.join(SHM_DIR, name.lstrip("/"))


@contextmanager
def flocked(fd: int) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``fd`` for the block.

    Guards rare maintenance on one segment inode (replacement, writer-lock recovery). The
    kernel drops it when the holder dies, so it cannot be left stuck the way the semaphore
    can. Blocking is fine: every holder does a few syscalls and lets go.
    """
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


@dataclass(eq=False)
class Segment:
    """One mapped segment. Owns the mapping and the shm file descriptor."""

    name: str
    geometry: Geometry
    mm: mmap.mmap
    inode: int
    attached_existing: bool
    id_bytes: int  # from the static header: fixed for the segment's life
    _shm: Any = field(repr=False)
    _closed: bool = field(default=False, repr=False)

    @property
    def fd(self) -> int:
        return int(self._shm.fd)

    @property
    def generation(self) -> int:
        """The random identity written into the static header at creation."""
        return _layout.unpack_static(self.mm[:HEADER_SIZE]).generation

    def close(self) -> None:
        """Unmap and close the descriptor. Idempotent. No view of ``mm`` may remain."""
        if self._closed:
            return
        self.mm.close()
        self._shm.close_fd()
        self._closed = True


# madvise(2) MADV_POPULATE_READ (Linux 5.14): map a range's pages into this process now.
_MADV_POPULATE_READ: Final = 22
_MADV_POPULATE_WRITE: Final = 23


def populate(mm: mmap.mmap, length: int, writable: bool = False) -> bool:
    """Map the first ``length`` bytes (header and index) into this process's page tables,
    writable where the mapping is (``writable``).

    Index probes land on random pages of an index of tens of MiB: unpopulated, nearly
    every probe of a fresh process is a page fault (several µs each in a VM), which is
    most of a lookup's cost until the whole index has been touched. A writer's slot writes
    land on random pages too, and a page populated for reading faults again on its first
    write: a process that records outputs had ~3 such faults per request until it had
    written to every page of the index. Populating costs ~1 ms per 40 MiB once, at attach.
    A populate that fails (older kernel, a page the tmpfs cannot back) is harmless: it
    reports an error instead of faulting, and pages then fault in one by one as before.
    Returns whether it succeeded.
    """
    try:
        mm.madvise(_MADV_POPULATE_WRITE if writable else _MADV_POPULATE_READ, 0, length)
    except (OSError, ValueError, AttributeError):
        return False
    return True


def open_segment(name: str, fingerprint: bytes, size: int, id_bytes: int) -> Segment:
    """Attach to ``name`` if it holds a valid segment for (fingerprint, size), else replace it.

    ``id_bytes`` is the id width of a segment this call creates; an attached segment keeps
    the width in its header (same fingerprint: same vocabulary, so either width is valid).
    A created segment is backed whole, an attached one in its header and index (the arena
    is backed range by range as it is written). Raises SegmentFull when the tmpfs cannot
    back that, SegmentError on OS failures (the caller translates posix_ipc/OS errors) and
    ValueError for an unusable size or width.
    """
    if len(fingerprint) != _layout.FINGERPRINT_SIZE:
        raise ValueError(f"fingerprint must be {_layout.FINGERPRINT_SIZE} bytes")
    _layout.check_id_bytes(id_bytes)
    geometry = _layout.geometry_for(size)
    _remove_stale_temporaries(name)
    for _ in range(_OPEN_ATTEMPTS):
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            shm = None
        if shm is not None:
            try:
                segment = _attach(shm, name, fingerprint, geometry)
            except SegmentMismatch as exc:
                log.warning("replacing shared-memory segment %s: %s", name, exc)
                _retire(shm, name)
            else:
                try:
                    # Readers and writers store into the header and index without further
                    # checks; an older writer may have left them sparse.
                    reserve(segment.fd, 0, geometry.arena_off, name)
                except BaseException:
                    segment.close()
                    raise
                populate(segment.mm, geometry.arena_off, True)
                return segment
        created = _create(name, fingerprint, geometry, id_bytes)
        if created is not None:
            return created
    raise SegmentError(f"open {name}: lost the create/replace race {_OPEN_ATTEMPTS} times")


def attach_readonly(name: str, fingerprint: bytes | None = None) -> Segment:
    """Map the existing segment ``name`` read-only, whatever its size.

    Validates the header (magic, layout version, check, geometry of its own size, and
    ``fingerprint`` if given). Raises SegmentError when there is no such segment or on OS
    errors, SegmentMismatch when it is not a segment this code can read. A retired
    segment is refused too (its name already points elsewhere).
    """
    return attach_existing(name, fingerprint, writable=False)


def attach_existing(name: str, fingerprint: bytes | None = None, *, writable: bool) -> Segment:
    """Map the existing segment ``name`` as it is (its own size), never creating or replacing it.

    :func:`attach_readonly`'s checks; with ``writable`` the mapping may be written (a
    co-located client storing what its reads learned, under the writer lock) and
    needs write permission on the segment (SegmentError otherwise).
    """
    try:
        shm = posix_ipc.SharedMemory(name, 0, read_only=not writable)
    except posix_ipc.ExistentialError as exc:
        raise SegmentError(f"attach {name}: no such segment") from exc
    except (posix_ipc.Error, OSError) as exc:
        raise SegmentError(f"attach {name}: {exc}") from exc
    fd = int(shm.fd)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    try:
        stat = os.fstat(fd)
        if stat.st_size < _layout.MIN_SIZE:
            raise SegmentMismatch(f"size {stat.st_size} is below the minimum {_layout.MIN_SIZE}")
        geometry = _layout.geometry_for(min(stat.st_size, _layout.MAX_SIZE))
        mm = mmap.mmap(fd, geometry.size, flags=mmap.MAP_SHARED, prot=prot)
    except SegmentMismatch:
        shm.close_fd()
        raise
    except (OSError, ValueError) as exc:
        shm.close_fd()
        raise SegmentError(f"attach {name}: {exc}") from exc
    try:
        page = mm[:HEADER_SIZE]
        id_bytes = validate(page, fingerprint or _layout.unpack_static(page).fingerprint, geometry)
    except BaseException:
        mm.close()
        shm.close_fd()
        raise
    populate(mm, geometry.arena_off, writable)
    return Segment(name, geometry, mm, stat.st_ino, True, id_bytes, shm)


def validate(page: bytes, fingerprint: bytes, geometry: Geometry) -> int:
    """The segment's id width; raise SegmentMismatch unless the header ``page`` is ours and
    matches the request."""
    header = _layout.unpack_static(page)
    if header.magic != MAGIC:
        raise SegmentMismatch(f"bad magic {header.magic!r}")
    if header.version != _layout.LAYOUT_VERSION:
        raise SegmentMismatch(f"layout version {header.version}, this code writes {_layout.LAYOUT_VERSION}")
    if not header.check_ok:
        raise SegmentMismatch("header check failed (corrupted header)")
    if header.fingerprint != fingerprint:
        raise SegmentMismatch(f"fingerprint {header.fingerprint.hex()} != {fingerprint.hex()}")
    if (
        header.header_size != HEADER_SIZE
        or header.slot_size != _layout.SLOT_SIZE
        or header.bucket_slots != _layout.BUCKET_SLOTS
        or header.geometry != geometry
    ):
        raise SegmentMismatch(f"geometry {header.geometry} != requested {geometry}")
    if header.id_bytes not in _layout.ID_WIDTHS:  # the check passed: a writer's bug, not a stray write
        raise SegmentMismatch(f"id width {header.id_bytes} not in {_layout.ID_WIDTHS}")
    retired = int.from_bytes(page[W_RETIRED * 8 : W_RETIRED * 8 + 8], "little")
    if retired == RETIRED_MARK:
        raise SegmentMismatch("segment was retired")
    return header.id_bytes


def _attach(shm: Any, name: str, fingerprint: bytes, geometry: Geometry) -> Segment:
    """Map and validate an existing segment; on SegmentMismatch ``shm`` stays open."""
    fd = int(shm.fd)
    try:
        stat = os.fstat(fd)
        if stat.st_size != geometry.size:
            raise SegmentMismatch(f"size {stat.st_size} != requested {geometry.size}")
        mm = mmap.mmap(fd, geometry.size)
    except SegmentMismatch:
        raise
    except BaseException:
        shm.close_fd()
        raise
    try:
        id_bytes = validate(mm[:HEADER_SIZE], fingerprint, geometry)
    except SegmentMismatch:
        mm.close()
        raise
    except BaseException:
        mm.close()
        shm.close_fd()
        raise
    return Segment(name, geometry, mm, stat.st_ino, True, id_bytes, shm)


def _retire(shm: Any, name: str) -> None:
    """Unlink ``name`` if it still refers to ``shm``'s inode, marking the segment retired."""
    fd = int(shm.fd)
    try:
        with flocked(fd):
            try:
                current = os.stat(shm_path(name)).st_ino
            except FileNotFoundError:
                return
            if current != os.fstat(fd).st_ino:
                return  # someone replaced it while we waited for the flock
            _mark_retired(fd)
            os.unlink(shm_path(name))
    finally:
        shm.close_fd()


def _mark_retired(fd: int) -> None:
    """Set W_RETIRED in a segment of our layout version (other layouts are left untouched)."""
    if os.fstat(fd).st_size < HEADER_SIZE:
        return
    with mmap.mmap(fd, HEADER_SIZE) as mm:
        header = _layout.unpack_static(mm[:HEADER_SIZE])
        if header.magic == MAGIC and header.version == _layout.LAYOUT_VERSION:
            mm[W_RETIRED * 8 : W_RETIRED * 8 + 8] = RETIRED_MARK.to_bytes(8, "little")


def _create(name: str, fingerprint: bytes, geometry: Geometry, id_bytes: int) -> Segment | None:
    """Create, initialise and publish a segment; None if another process published first."""
    tmp = temp_name(name)
    shm = posix_ipc.SharedMemory(tmp, posix_ipc.O_CREX, mode=MODE, size=geometry.size)
    mm: mmap.mmap | None = None
    published = False
    try:
        # Every page now, before it is published: a tmpfs too small fails here, never later.
        reserve(int(shm.fd), 0, geometry.size, name)
        mm = mmap.mmap(int(shm.fd), geometry.size)
        # Fresh tmpfs pages are zero: head = tail = 0, empty index, no lock holder.
        static = _layout.pack_static(geometry, fingerprint, int(time.time()), id_bytes)
        mm[: len(static)] = static
        try:
            os.link(shm_path(tmp), shm_path(name))
        except FileExistsError:
            return None
        published = True
        populate(mm, geometry.arena_off, True)
        return Segment(name, geometry, mm, os.fstat(int(shm.fd)).st_ino, False, id_bytes, shm)
    finally:
        _unlink_quietly(tmp)
        if not published:
            if mm is not None:
                mm.close()
            shm.close_fd()


def reserve(fd: int, offset: int, length: int, name: str) -> None:
    """Allocate the tmpfs pages of ``[offset, offset + length)`` of segment file ``fd``.

    After it returns, storing into (or reading) those pages through a mapping cannot
    SIGBUS until they are given back (``madvise(MADV_REMOVE)``). Cheap when they already
    are allocated (~0.4 µs for a few pages). The range must lie within the file: the
    file never grows. Raises SegmentFull on ENOSPC (nothing is allocated then: tmpfs
    undoes a partial fallocate), SegmentError on other OS errors. ``name`` is for messages.
    """
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise SegmentFull(
                f"{name}: {SHM_DIR} has no room for {length} more bytes ({_free_bytes()} free)"
            ) from exc
        raise SegmentError(f"{name}: allocating {length} bytes at {offset}: {exc}") from exc


def usable_size(name: str, requested: int, *, minimum: int = _layout.MIN_SIZE) -> tuple[int, str]:
    """The size to open segment ``name`` with: ``(size, reason)``, reason "" if as requested.

    What the tmpfs behind /dev/shm can back is its free space plus the pages the existing
    segment ``name`` already holds (replacing it frees them). When ``requested`` fits,
    returns it. Otherwise, the existing segment's own size when that is smaller than
    requested and still fits (a restarted server, or the other processes of one, then
    re-attach instead of replacing it); else what can be backed less a share (1/8) left to
    the other users of /dev/shm, down to a page and not below ``minimum``, and ``reason``
    says how much was available. Raises SegmentFull when not even ``minimum`` bytes (and
    a little slack) fit; the message says what is available. ValueError for a size
    outside the layout's range. A tmpfs without a size limit, or a filesystem ``statvfs``
    cannot read, never clamps. A snapshot: space taken after it makes creation fail with
    SegmentFull, and writes evict or fail the same way.
    """
    _layout.geometry_for(requested)  # ValueError for a size no segment can have
    minimum = max(minimum, _layout.MIN_SIZE)
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return requested, ""
    if st.f_blocks == 0:  # tmpfs mounted without a size limit reports 0 blocks
        return requested, ""
    free = st.f_bavail * st.f_frsize
    try:
        existing = os.stat(shm_path(name))
        own, existing_size = existing.st_blocks * 512, existing.st_size
    except FileNotFoundError:
        own = existing_size = 0
    available = free + own
    if requested + _SLACK <= available:
        return requested, ""
    backs = f"{SHM_DIR} can back {available} bytes ({free} free + {own} held by {name})"
    if minimum <= existing_size < requested and existing_size <= available:
        return existing_size, f"{backs}; keeping the existing {existing_size}-byte segment"
    size = min(requested, (available - max(_SLACK, available // _HEADROOM_SHARE)) // PAGE * PAGE)
    if size < minimum:
        if minimum + _SLACK > available:
            raise SegmentFull(f"{backs}: not enough for the minimum of {minimum} bytes and {_SLACK} kept free")
        size = minimum  # the headroom is a courtesy; the minimum fits
    return size, f"{backs}; leaving {available - size} to its other users"


def _free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def _unlink_quietly(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def temp_name(name: str) -> str:
    """A creator's temporary name for ``name``: ``<name>.new-<pidns>-<pid>-<random>``."""
    me = _proc.current()
    return f"{name}.new-{me.pidns}-{me.pid}-{secrets.token_hex(4)}"


def _remove_stale_temporaries(name: str) -> None:
    """Remove temporaries of ``name`` left by creators that crashed before publishing.

    At once when the creator named in it is dead (same pid namespace only: containers
    of a pod share /dev/shm, not necessarily pids), else once older than a minute.
    """
    stem = name.lstrip("/") + ".new-"
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return
    now = time.time()
    for entry in entries:
        if not entry.startswith(stem):
            continue
        path = os.path.join(SHM_DIR, entry)
        try:
            if _creator_dead(entry[len(stem) :]) or now - os.stat(path).st_mtime > _STALE_TEMP_SECONDS:
                os.unlink(path)
        except FileNotFoundError:
            pass


def _creator_dead(suffix: str) -> bool:
    """Whether the creator of a temporary named ``…new-<pidns>-<pid>-<random>`` is dead."""
    parts = suffix.split("-")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return False
    who = _proc.Identity(int(parts[1]), 0, int(parts[0]))
    return _proc.liveness(who) is _proc.Liveness.DEAD


def unlink_segment(name: str, inode: int) -> None:
    """Remove ``name`` if it still refers to ``inode`` (not a segment that replaced ours)."""
    try:
        if os.stat(shm_path(name)).st_ino == inode:
            os.unlink(shm_path(name))
    except FileNotFoundError:
        pass
