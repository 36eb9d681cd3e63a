"""tokcache.store._speedups.Hasher (SHA-256 through libcrypto) against ``hashlib.sha256``.

Keys and record checks are digests: a segment written by a process with the C hasher is read
by one with hashlib's (``TOKCACHE_PURE_PYTHON=1``, and the reverse) only if they agree on every
input. Checked here on every shape a key pass makes: empty and long inputs, block (64) and
padding edges (55/56 bytes in a block), updates in any pieces, copies taken anywhere, digests
that do not finalize. Then bad input, and the pure-Python build's keys against this one's.
The extension is imported directly, so this runs in a pure-Python test run too.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcache import native
from tokcache.store import _hash

_speedups = importlib.import_module("tokcache.store._speedups")

ROOT = Path(__file__).resolve().parents[3]
# Block (64) edges, the padding edge (a message of 55 bytes in its last block pads in one
# block, 56 in two), and long inputs.
EDGES = [0, 1, 55, 56, 63, 64, 65, 119, 120, 127, 128, 2047, 2048, 2049, 57_000, 300_001]


@pytest.mark.parametrize("n", EDGES)
def test_one_update_is_sha256s(n: int) -> None:
    data = os.urandom(n)
    h = _speedups.Hasher(data)
    ref = hashlib.sha256(data)
    assert h.digest() == ref.digest()
    assert h.digest() == ref.digest()  # a digest does not finalize
    assert h.hexdigest() == ref.hexdigest()
    assert _hash.digest(data, 16) == ref.digest()[:16]


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
            assert copy.digest() == hashlib.sha256(data[:a]).digest()
        assert h.digest() == hashlib.sha256(data[:a]).digest()
        h.update(memoryview(data)[a:b] if i % 2 else data[a:b])
        if copy is not None and copy is not h:
            copy.update(bytearray(data[a:b]))
    assert h.digest() == hashlib.sha256(data).digest()
    if copy is not None:
        assert copy.digest() == hashlib.sha256(data).digest()


def test_update_returns_none_and_copy_is_independent() -> None:
    h = _speedups.Hasher(b"tokcache/v1\x00")
    assert h.update(b"abc") is None  # as hashlib's
    c = h.copy()
    c.update(b"more")
    assert h.digest() == hashlib.sha256(b"tokcache/v1\x00abc").digest()
    assert c.digest() == hashlib.sha256(b"tokcache/v1\x00abcmore").digest()


@pytest.mark.parametrize("bad", ["text", 12, None, [1, 2]])
def test_update_rejects_what_is_not_bytes(bad: object) -> None:
    h = _speedups.Hasher(b"x")
    with pytest.raises(TypeError):
        h.update(bad)
    assert h.digest() == hashlib.sha256(b"x").digest()  # unchanged by the refused update


def test_constructor_and_digest_reject_bad_arguments() -> None:
    with pytest.raises(TypeError, match="encoded"):
        _speedups.Hasher("text")
    with pytest.raises(TypeError):
        _speedups.Hasher(b"a", b"b")
    with pytest.raises(TypeError):
        _speedups.Hasher().digest(16)


def test_the_keys_hasher_is_the_extensions_unless_pure_python() -> None:
    """``_hash.Hasher`` is the C type (the one the engine's key pass hashes on in place), or
    hashlib's under TOKCACHE_PURE_PYTHON=1: never a third."""
    if native.pure_python():
        assert (_hash.NATIVE, _hash.Hasher) == (False, hashlib.sha256)
    else:
        assert (_hash.NATIVE, _hash.Hasher) == (True, _speedups.Hasher)


def test_keys_are_the_same_in_a_pure_python_process() -> None:
    """A process with hashlib's hasher (TOKCACHE_PURE_PYTHON=1) makes the same keys and checks
    as one with the C hasher: its segment entries are found by the other, and the reverse."""
    code = ("from tokcache.store import _hash, _layout, keys; "
            "import sys; assert _hash.NATIVE == (sys.argv[1] == '0'); "
            "t = 'a' * 70000 + '<|im_end|>\\n' + 'b' * 5000; "
            "print(keys.l0_key(t, salt='s').hex(), keys.output_key(t, 'out', salt='s').hex(), "
            "keys.segment_key('s', keys.MODE_KV_STABLE, t.encode()).hex(), keys.pending_key(bytes(16)).hex(), "
            "_layout.check_of(t.encode()).hex())")
    outs = []
    for pure in ("1", "0"):
        env = {**os.environ, "TOKCACHE_PURE_PYTHON": pure}
        outs.append(subprocess.run([sys.executable, "-c", code, pure], capture_output=True, text=True, env=env,
                                   timeout=120, cwd=ROOT, check=True).stdout.split())
    assert outs[0] == outs[1] and len(outs[0]) == 5
