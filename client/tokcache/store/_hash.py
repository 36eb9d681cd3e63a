"""SHA-256 for keys and record checks: the one place that picks the hasher.

``Hasher`` is ``tokcache.store._speedups.Hasher`` (OpenSSL's libcrypto, ``_hasher.c``), or
``hashlib.sha256`` under ``TOKCACHE_PURE_PYTHON=1``. Both give the same digests
(tests/tokcache/store/test_hasher.py), so keys and checks written by either are the same, and
neither finalizes on ``digest()``: a running hash is digested at every keyed cut and fed on.
The C one is also the one the engine extension's key pass works on in place: a key state made
by the Python code is hashed on natively, and the reverse.

Why the C one: it never lets go of the GIL (see ``_hasher.c``). hashlib does for an update of
2 KB or more, and getting the GIL back then waits for the interpreter's switch interval (5 ms)
when another thread took it meanwhile: beside a thread spinning in Python, one 15 KB hash in
~400 took 5-13 ms instead of ~9 µs (Python 3.11, OpenSSL 3.0). The pure-Python path feeds
hashlib whole all the same: it is the reference the C code is tested against, where only the
digests matter. Updates cut below 2 KB would keep the GIL (at ~15% more time on a 57 KB text,
SHA-256 having no wide SIMD to lose), but serve no one: with the extensions part of the build,
TOKCACHE_PURE_PYTHON=1 is for tests and diagnosis, not for latency.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

from tokcache import native

__all__ = ["NATIVE", "Hasher", "KeyHasher", "digest"]

_speedups = native.store()


class KeyHasher(Protocol):
    """What keys use of a SHA-256 hasher (either type)."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def copy(self) -> KeyHasher: ...
    def digest(self) -> bytes: ...


Hasher: Callable[..., KeyHasher]
if _speedups is not None:
    Hasher = _speedups.Hasher
    NATIVE = True
else:  # TOKCACHE_PURE_PYTHON=1
    Hasher = hashlib.sha256
    NATIVE = False


def digest(data: bytes | bytearray | memoryview, size: int) -> bytes:
    """The first ``size`` (<= 32) bytes of SHA-256(``data``)."""
    return Hasher(data).digest()[:size]
