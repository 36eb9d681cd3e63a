"""Cache keys: content hashes of text prefixes, namespaced by salt and mode.

A key is ``blake3(header || utf8(text[:cut]))`` truncated to 16 bytes, where
the header binds the layer and tenant. One running hasher walks the text and
is digested at every cut, so keying all ~160 boundaries of a 57 KB prompt
hashes each byte once (``digest`` does not finalize a blake3 hasher).

Keys do not name the model: a segment holds exactly one tokenizer
fingerprint, and two model names with the same tokenizer share entries.
"""

from __future__ import annotations

from blake3 import blake3

__all__ = ["KEY_BYTES", "KeyStream", "MODE_EXACT", "MODE_KV_STABLE", "TextKeys", "segment_key"]

KEY_BYTES = 16
MODE_EXACT = b"C"  # canonical ids only
MODE_KV_STABLE = b"K"  # recorded model output (AR) ids take precedence

# 0xFF never occurs in UTF-8, so these suffixes cannot collide with text.
_L0_SUFFIX = b"\xffL0"
_AR_SUFFIX = b"\xffAR"


class KeyStream:
    """Incremental keys over one text. Not thread-safe; one per request."""

    __slots__ = ("_h",)

    def __init__(self, salt: str, mode: bytes) -> None:
        salt_b = salt.encode("utf-8")
        self._h = blake3(b"tokcache/v1\x00" + mode + len(salt_b).to_bytes(4, "little") + salt_b)

    def feed(self, data: bytes) -> None:
        """Append the next bytes of the text."""
        self._h.update(data)

    def exact_key(self) -> bytes:
        """Key of the L0 entry for the text fed so far (the whole text)."""
        h = self._h.copy()
        h.update(_L0_SUFFIX)
        return h.digest(KEY_BYTES)

    def output_key(self) -> bytes:
        """Key of an AR entry ending at the text fed so far (a recorded output)."""
        h = self._h.copy()
        h.update(_AR_SUFFIX)
        return h.digest(KEY_BYTES)


def segment_key(salt: str, mode: bytes, text: bytes) -> bytes:
    """Key of a segment-AR entry: a recorded output's text on its own."""
    salt_b = salt.encode("utf-8")
    h = blake3(b"tokcache/v1\x00S" + mode + len(salt_b).to_bytes(4, "little") + salt_b)
    h.update(text)
    return h.digest(KEY_BYTES)


class TextKeys:
    """Keys of one text at its cuts, computed lazily and only where needed.

    Hashing is the cost that scales with the text: a 57 KB prompt has ~300
    cuts, and an update + digest at each is ~200 µs in Python, while one
    blake3 pass over all of it is ~14 µs. A growing conversation needs keys at
    its last few cuts only (the lookup probes them; the new ones are stored),
    so those are filled in one running pass and any other key is one pass
    over its prefix.
    """

    __slots__ = ("_base", "_data", "_cuts", "_keys")

    def __init__(self, data: bytes, cuts: list[int], salt: str, mode: bytes) -> None:
        self._base = KeyStream(salt, mode)
        self._data = data
        self._cuts = cuts
        self._keys: list[bytes | None] = [None] * len(cuts)

    def exact_key(self) -> bytes:
        """The L0 key of the whole text."""
        h = self._base._h.copy()
        h.update(self._data)
        h.update(_L0_SUFFIX)
        return h.digest(KEY_BYTES)

    def key(self, i: int) -> bytes:
        """The L1 key of ``data[:cuts[i]]``."""
        k = self._keys[i]
        if k is None:
            h = self._base._h.copy()
            h.update(self._data[:self._cuts[i]])
            k = self._keys[i] = h.digest(KEY_BYTES)
        return k

    def fill(self, lo: int, hi: int) -> None:
        """Compute the keys of cuts ``lo <= i < hi`` in one running pass."""
        lo = max(lo, 0)
        if lo >= hi or all(k is not None for k in self._keys[lo:hi]):
            return
        h = self._base._h.copy()
        h.update(self._data[:self._cuts[lo]])
        prev = self._cuts[lo]
        for i in range(lo, hi):
            cut = self._cuts[i]
            h.update(self._data[prev:cut])
            prev = cut
            if self._keys[i] is None:
                self._keys[i] = h.digest(KEY_BYTES)
