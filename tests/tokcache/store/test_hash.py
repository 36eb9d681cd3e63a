"""tokcache.store._hash and the key formats: SHA-256 of the documented bytes, whatever the buffer."""

from __future__ import annotations

import hashlib
import os

import pytest

from tokcache.store import _hash
from tokcache.store.keys import _L0_SUFFIX, MODE_KV_STABLE, TextKeys, l0_key, namespace

SIZES = [0, 1, 55, 56, 64, 2047, 2048, 2049, 57_000]


@pytest.mark.parametrize("n", SIZES)
def test_digest_is_sha256s(n: int) -> None:
    data = os.urandom(n)
    for size in (8, 16, 32):
        assert _hash.digest(data, size) == hashlib.sha256(data).digest()[:size]
    assert _hash.digest(memoryview(data), 16) == _hash.digest(bytearray(data), 16) == hashlib.sha256(data).digest()[:16]


def test_hasher_rejects_text() -> None:
    with pytest.raises(TypeError):
        _hash.Hasher().update("text")


def test_long_text_keys_match_one_pass() -> None:
    """Keys of a text of many keyed cuts are the one-update hash of the documented format
    (``sha256(header || namespace || text || suffix)``), by the Python pass and the key stream."""
    text = ("x" * 3000 + "<|im_end|>\n") * 20
    data = text.encode()
    ref = hashlib.sha256(b"tokcache/v1\x00" + namespace("", MODE_KV_STABLE) + data + _L0_SUFFIX).digest()[:16]
    assert l0_key(text) == ref
    assert TextKeys(data, [], "", MODE_KV_STABLE).exact_key() == ref
