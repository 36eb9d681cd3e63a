"""tokcache.store._speedups.Hasher (the vendored BLAKE3 C) against the ``blake3`` package.

Keys and record checks are digests: a segment written by a process with the C hasher is read
by one with the package's (and the reverse) only if they agree on every input. Checked here
on every shape a key pass makes: empty and long inputs, chunk and block edges, updates in any
pieces, copies taken anywhere, digests of any length, several SIMD widths' thresholds
(BLAKE3 hashes 4, 8 or 16 chunks at once by CPU). Then bad input, and the pure-Python build's
keys against this one's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcache import native
from tokcache.store import _hash

_speedups = native.store()
pytestmark = pytest.mark.skipif(_speedups is None, reason="tokcache.store._speedups is not built")

ROOT = Path(__file__).resolve().parents[3]
# Chunk (1024) and block (64) edges, and 4 / 8 / 16 chunks (the SIMD batches) and beyond.
EDGES = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097, 8191, 8192, 8193, 16383, 16384,
         16385, 57_000, 300_001]


@pytest.mark.parametrize("n", EDGES)
def test_one_update_is_blake3s(n: int) -> None:
    data = os.urandom(n)
    h = _speedups.Hasher(data)
    ref = blake3(data)
    for size in (1, 16, 32, 33, 64, 65, 200):
        assert h.digest(size) == ref.digest(size)
    assert h.digest() == ref.digest()
    assert h.hexdigest(16) == ref.hexdigest(16)
    assert _hash.digest(data, 16) == ref.digest(16)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=20_000), cuts=st.lists(st.integers(0, 20_000), max_size=12),
       copy_at=st.integers(0, 12))
def test_pieces_and_copies_are_one_update(data: bytes, cuts: list[int], copy_at: int) -> None:
    """Fed in any pieces, with a copy taken between two of them and fed the rest on its own:
    both give the one-update digest, and digests in between do not finalize anything."""
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    h = _speedups.Hasher()
    copy = None
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        if i == copy_at:
            copy = h.copy()
            assert copy.digest(16) == blake3(data[:a]).digest(16)
        h.update(memoryview(data)[a:b] if i % 2 else data[a:b])
        if copy is not None and copy is not h:
            copy.update(bytearray(data[a:b]))
    assert h.digest(16) == blake3(data).digest(16)
    if copy is not None:
        assert copy.digest(16) == blake3(data).digest(16)


def test_update_returns_the_hasher_and_copy_is_independent() -> None:
    h = _speedups.Hasher(b"tokcache/v1\x00")
    assert h.update(b"abc") is h
    c = h.copy()
    c.update(b"more")
    assert h.digest(16) == blake3(b"tokcache/v1\x00abc").digest(16)
    assert c.digest(16) == blake3(b"tokcache/v1\x00abcmore").digest(16)


@pytest.mark.parametrize("bad", ["text", 12, None, [1, 2]])
def test_update_rejects_what_is_not_bytes(bad: object) -> None:
    h = _speedups.Hasher(b"x")
    with pytest.raises(TypeError):
        h.update(bad)
    assert h.digest(16) == blake3(b"x").digest(16)  # unchanged by the refused update


def test_constructor_and_digest_reject_bad_arguments() -> None:
    with pytest.raises(TypeError):
        _speedups.Hasher("text")
    h = _speedups.Hasher()
    for length in (0, -1, (1 << 20) + 1):
        with pytest.raises(ValueError, match="digest length"):
            h.digest(length)
    with pytest.raises(TypeError):
        h.digest("16")


def test_keys_are_the_same_in_a_pure_python_process() -> None:
    """A process without the extensions (the blake3 package) makes the same keys: its
    segment entries are found by a process with them, and the reverse."""
    code = ("from tokcache.store import _hash, keys; "
            "assert not _hash.NATIVE; "
            "t = 'a' * 70000 + '<|im_end|>\\n' + 'b' * 5000; "
            "print(keys.l0_key(t, salt='s').hex(), keys.output_key(t, 'out', salt='s').hex(), "
            "keys.segment_key('s', keys.MODE_KV_STABLE, t.encode()).hex(), _hash.digest(t.encode(), 16).hex())")
    env = {**os.environ, "TOKCACHE_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=ROOT, check=True).stdout.split()
    from tokcache.store import keys
    t = "a" * 70000 + "<|im_end|>\n" + "b" * 5000
    assert _hash.NATIVE
    assert out == [keys.l0_key(t, salt="s").hex(), keys.output_key(t, "out", salt="s").hex(),
                   keys.segment_key("s", keys.MODE_KV_STABLE, t.encode()).hex(), _hash.digest(t.encode(), 16).hex()]
