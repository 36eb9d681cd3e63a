"""BLAKE3 for keys and record checks, holding the GIL: the one place that picks the hasher.

``Hasher`` is ``tokcache.store._speedups.Hasher`` (the vendored official C implementation,
``_hasher.c``) when the store extension is built, else the ``blake3`` package's hasher; both
give the same digests (tests/tokcache/store/test_hasher.py), so keys and checks written by
either are the same. The C one is also the one the engine extension's key pass works on in
place: a key state made by the Python code is hashed on natively, and the reverse.

Why the C one: it never lets go of the GIL. The package's binding does for an update of
``GIL_PIECE + 1`` bytes or more (as hashlib does), and getting the GIL back then waits for
whichever of the caller's threads took it meanwhile — a client's write-behind, gRPC's, the
caller's own — for up to the interpreter's switch interval (5 ms): for hashing that takes
microseconds. With a thread spinning beside it, a 15 KB hash measured up to ~5000 µs instead
of ~9 (one run, Python 3.11, blake3 1.0.11); in a client's one-process replay a write's record
check took 220 µs on average (~10 alone). So the package is fed in pieces below that bound,
which also loses its SIMD across chunks (57 KB: ~57 µs in pieces against ~16 in one C update).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from tokcache import native

_speedups = native.store()

GIL_PIECE = 2047


class KeyHasher(Protocol):
    """What keys use of a BLAKE3 hasher (either type)."""

    def update(self, data: bytes | bytearray | memoryview, /) -> Any: ...  # noqa: ANN401 - self, or None
    def copy(self) -> KeyHasher: ...
    def digest(self, length: int = 32) -> bytes: ...


Hasher: Callable[..., KeyHasher]
if _speedups is not None:
    Hasher = _speedups.Hasher
    NATIVE = True
else:  # tests/tokcache/store/test_hasher.py runs this in a TOKCACHE_PURE_PYTHON=1 process
    from blake3 import blake3

    Hasher = blake3
    NATIVE = False


def feed(h: Any, data: bytes | bytearray | memoryview) -> None:  # noqa: ANN401 - either hasher type
    """``h.update(data)``, holding the GIL throughout."""
    n = len(data)
    if n <= GIL_PIECE or NATIVE:
        h.update(data)
        return
    mv = memoryview(data)
    for i in range(0, n, GIL_PIECE):
        h.update(mv[i:i + GIL_PIECE])


def digest(data: bytes | bytearray | memoryview, size: int) -> bytes:
    """The first ``size`` bytes of blake3(``data``), holding the GIL throughout."""
    h = Hasher()
    feed(h, data)
    out: bytes = h.digest(size)
    return out
