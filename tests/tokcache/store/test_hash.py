"""tokcache.store._hash: blake3 fed in pieces that keep the GIL gives blake3's own digest."""

from __future__ import annotations

import os

import pytest
from blake3 import blake3

from tokcache.store import _hash
from tokcache.store.keys import _L0_SUFFIX, MODE_KV_STABLE, TextKeys, l0_key, namespace

SIZES = [0, 1, _hash.GIL_PIECE - 1, _hash.GIL_PIECE, _hash.GIL_PIECE + 1, 2 * _hash.GIL_PIECE,
         2 * _hash.GIL_PIECE + 1, 57_000]


@pytest.mark.parametrize("n", SIZES)
def test_digest_is_blake3s(n: int) -> None:
    data = os.urandom(n)
    for size in (16, 32):
        assert _hash.digest(data, size) == blake3(data).digest(size)
    assert _hash.digest(memoryview(data), 16) == _hash.digest(bytearray(data), 16) == blake3(data).digest(16)


@pytest.mark.parametrize("n", SIZES)
def test_feed_continues_a_hasher(n: int) -> None:
    head, data = b"tokcache/v1\x00", os.urandom(n)
    h = blake3(head)
    _hash.feed(h, data)
    _hash.feed(h, memoryview(data)[: n // 2])
    assert h.digest(16) == blake3(head + data + data[: n // 2]).digest(16)


def test_feed_rejects_what_blake3_rejects() -> None:
    with pytest.raises(TypeError):
        _hash.feed(blake3(), "text")  # type: ignore[arg-type]


def test_long_text_keys_match_one_pass() -> None:
    """Keys of a text far longer than a piece are the one-update hash of the documented format
    (``blake3(header || namespace || text || suffix)``), by the Python pass and the key stream."""
    text = ("x" * 3000 + "<|im_end|>\n") * 20
    data = text.encode()
    ref = blake3(b"tokcache/v1\x00" + namespace("", MODE_KV_STABLE) + data + _L0_SUFFIX).digest(16)
    assert l0_key(text) == ref
    assert TextKeys(data, [], "", MODE_KV_STABLE).exact_key() == ref
