"""Errors raised by :mod:`tokcache.store`.

Hierarchy::

    StoreError                  base: anything the store could not do
     ├── SegmentError           creating, attaching, mapping or unlinking shared memory failed
     │    │                     (translated from posix_ipc / OSError, original as __cause__)
     │    └── SegmentFull       the tmpfs behind /dev/shm has no room for pages a segment
     │                          needs (ENOSPC): creating one too big for it, or a put whose
     │                          pages were given back and could not be had again
     ├── SegmentMismatch        an existing segment is not usable by this opener (other layout
     │                          version, size, fingerprint, or a bad header check);
     │                          ``Store.open`` handles it by replacing the segment
     ├── LockTimeout            the writer lock was not obtained in time (a live holder kept it)
     └── StoreClosed            the Store was used after ``close()``

Bad arguments (wrong key length, ids not a multiple of 4, ...) raise ``ValueError``: they are
caller bugs, not store conditions.

Foreign errors are translated in one place, :func:`translated` (or the :func:`translate`
context manager around it), and re-raised ``from`` the original so the cause stays visible.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import posix_ipc

__all__ = [
    "FOREIGN_ERRORS",
    "LockTimeout",
    "SegmentError",
    "SegmentFull",
    "SegmentMismatch",
    "StoreClosed",
    "StoreError",
    "translate",
    "translated",
]


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class SegmentError(StoreError):
    """Shared memory could not be created, attached, mapped or removed."""


class SegmentFull(SegmentError):
    """The tmpfs behind /dev/shm cannot allocate pages the segment needs (ENOSPC).

    Raised instead of the SIGBUS a store into an unbackable mapped page would be: at
    creation (the segment is allocated whole), and by a put that had to re-allocate pages
    given back earlier while another process filled the tmpfs (the put stored nothing).
    """


class SegmentMismatch(StoreError):
    """An existing segment does not match what the opener expects (message says why)."""


class LockTimeout(StoreError):
    """The writer lock stayed with a live holder for longer than the timeout."""


class StoreClosed(StoreError):
    """The Store was used after ``close()``."""


FOREIGN_ERRORS: tuple[type[BaseException], ...] = (posix_ipc.Error, OSError)
"""What :func:`translated` converts; catch these around calls into posix_ipc or the OS."""


def translated(operation: str, exc: BaseException) -> StoreError:
    """The StoreError to raise ``from exc`` for a foreign error during ``operation``."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, posix_ipc.PermissionsError):
        return SegmentError(f"{operation}: permission denied ({exc})")
    return SegmentError(f"{operation}: {exc}")


@contextmanager
def translate(operation: str) -> Iterator[None]:
    """Re-raise posix_ipc and OS errors inside the block as :class:`SegmentError`.

    ``operation`` names what was attempted ("open /tok-ab12…"); it leads the message.
    StoreError subclasses pass through unchanged. Hot paths use :func:`translated` with
    FOREIGN_ERRORS directly (a generator context manager costs ~1 µs).
    """
    try:
        yield
    except StoreError:
        raise
    except FOREIGN_ERRORS as exc:
        raise translated(operation, exc) from exc
