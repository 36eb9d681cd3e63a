"""Cache keys: content hashes of text prefixes, namespaced by salt and mode.

A key is ``blake3(header || utf8(text[:cut]))`` truncated to 16 bytes, where
the header binds the layer and tenant. One running hasher walks the text and
is digested at every cut, so keying all ~160 boundaries of a 57 KB prompt
hashes each byte once (``digest`` does not finalize a blake3 hasher).

Keys do not name the model: a segment holds exactly one tokenizer
fingerprint, and two model names with the same tokenizer share entries.
"""

from __future__ import annotations

from typing import Any

from blake3 import blake3

__all__ = ["KEY_BYTES", "KeyStream", "MODE_EXACT", "MODE_KV_STABLE", "TextKeys", "l0_key", "namespace", "segment_key"]

KEY_BYTES = 16
MODE_EXACT = b"C"  # canonical ids only
MODE_KV_STABLE = b"K"  # recorded model output (AR) ids take precedence

# 0xFF never occurs in UTF-8, so these suffixes cannot collide with text.
_L0_SUFFIX = b"\xffL0"
_AR_SUFFIX = b"\xffAR"


def namespace(salt: str, mode: bytes) -> bytes:
    """What separates one key namespace (mode, salt) from another, as bytes."""
    salt_b = salt.encode("utf-8")
    return mode + len(salt_b).to_bytes(4, "little") + salt_b


class KeyStream:
    """Incremental keys over one text. Not thread-safe; one per request."""

    __slots__ = ("_h", "namespace")

    def __init__(self, salt: str, mode: bytes) -> None:
        self.namespace = namespace(salt, mode)
        self._h = blake3(b"tokcache/v1\x00" + self.namespace)

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


_MODES = {"kv-stable": MODE_KV_STABLE, "exact": MODE_EXACT}


def l0_key(text: str | bytes, *, salt: str = "", mode: str = "kv-stable") -> bytes:
    """The key under which the whole-text (L0) ids of ``text`` are kept.

    ``mode`` is the request's mode ("kv-stable" or "exact"). Raises ValueError for an
    unknown mode and UnicodeEncodeError for text that is not valid Unicode.
    """
    try:
        tag = _MODES[mode]
    except KeyError:
        raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}") from None
    stream = KeyStream(salt, tag)
    stream.feed(text if isinstance(text, bytes) else text.encode("utf-8"))
    return stream.exact_key()


def segment_key(salt: str, mode: bytes, text: bytes) -> bytes:
    """Key of a segment-AR entry: a recorded output's text on its own."""
    salt_b = salt.encode("utf-8")
    h = blake3(b"tokcache/v1\x00S" + mode + len(salt_b).to_bytes(4, "little") + salt_b)
    h.update(text)
    return h.digest(KEY_BYTES)


class TextKeys:
    """Keys of one text at its boundaries, computed lazily and only where needed.

    Hashing is the cost that scales with the text: a 57 KB prompt has ~300
    cuts, and an update + digest at each is ~200 µs in Python, while one
    blake3 pass over all of it is ~14 µs. A growing conversation needs keys at
    its last few cuts only (the lookup probes them; the new ones are stored),
    so :meth:`scan_tail` fills those, the AR keys at the boundary starts
    between them and the whole-text key in one running pass; any other key
    is one pass over its prefix.

    ``spans`` are the (start, end) offsets of the boundary tokens: the L1 key
    of boundary ``i`` covers ``data[:end]``, its AR key ``data[:start]``.
    """

    __slots__ = ("_base", "_data", "_spans", "_keys", "_ar_keys", "_exact", "_resume", "_last")

    @property
    def data(self) -> bytes:
        """The text the keys are of (UTF-8)."""
        return self._data

    def __init__(self, data: bytes, spans: list[tuple[int, int]], salt: str, mode: bytes,
                 resume: tuple[int, Any] | None = None) -> None:
        """``resume``: (offset, hash state after the namespace header and ``data[:offset]``),
        from :meth:`last_cut_state` of a text ``data`` extends: hashing starts there."""
        self._base = KeyStream(salt, mode)
        self._data = data
        self._spans = spans
        self._keys: list[bytes | None] = [None] * len(spans)
        self._ar_keys: dict[int, bytes] = {}
        self._exact: bytes | None = None
        self._resume = resume if resume is not None and resume[0] <= len(data) else None
        self._last: tuple[int, Any] | None = None

    def _hasher_at(self, offset: int) -> Any:  # noqa: ANN401 - blake3's hasher type is untyped
        """A hasher fed the namespace header and ``data[:offset]``."""
        r = self._resume
        if r is not None and r[0] <= offset:
            h = r[1].copy()
            h.update(memoryview(self._data)[r[0]:offset])
        else:
            h = self._base._h.copy()
            h.update(memoryview(self._data)[:offset])
        return h

    @property
    def keys(self) -> list[bytes]:
        """The L1 keys by boundary index; only the ones computed are set (see :meth:`fill`)."""
        return self._keys  # type: ignore[return-value]

    def namespace(self) -> bytes:
        """What identifies these keys' namespace (mode and salt), for memoizing hash states."""
        return self._base.namespace

    def last_cut_state(self) -> tuple[int, Any] | None:
        """(offset, hash state) where :meth:`scan_tail`'s window started (for ``resume``)."""
        return self._last

    def exact_key(self) -> bytes:
        """The L0 key of the whole text."""
        if self._exact is None:
            h = self._hasher_at(len(self._data))
            h.update(_L0_SUFFIX)
            self._exact = h.digest(KEY_BYTES)
        return self._exact

    def key(self, i: int) -> bytes:
        """The L1 key of ``data[:spans[i][1]]``."""
        k = self._keys[i]
        if k is None:
            k = self._keys[i] = self._hasher_at(self._spans[i][1]).digest(KEY_BYTES)
        return k

    def ar_key(self, i: int) -> bytes:
        """The AR key of ``data[:spans[i][0]]``: a recorded output ending where boundary ``i`` starts."""
        k = self._ar_keys.get(i)
        if k is None:
            h = self._hasher_at(self._spans[i][0])
            h.update(_AR_SUFFIX)
            k = self._ar_keys[i] = h.digest(KEY_BYTES)
        return k

    def scan_tail(self, lo: int, *, ar: bool) -> None:
        """One pass from boundary ``lo`` to the end: L1 keys of boundaries ``>= lo``, the
        whole-text key and, with ``ar``, the AR keys of boundaries ``> lo``."""
        lo = max(lo, 0)
        data, spans = memoryview(self._data), self._spans  # views: no copies of the text
        prev = spans[lo][1] if lo < len(spans) else len(data)
        h = self._hasher_at(prev)
        # The state at the first cut of the window: a text that extends this one has at
        # least as many cuts, so its window starts there or later.
        self._last = (prev, h.copy())
        if lo < len(spans) and self._keys[lo] is None:
            self._keys[lo] = h.digest(KEY_BYTES)
        for i in range(lo + 1, len(spans)):
            start, end = spans[i]
            if ar:
                h.update(data[prev:start])
                prev = start
                if i not in self._ar_keys:
                    a = h.copy()
                    a.update(_AR_SUFFIX)
                    self._ar_keys[i] = a.digest(KEY_BYTES)
            h.update(data[prev:end])
            prev = end
            if self._keys[i] is None:
                self._keys[i] = h.digest(KEY_BYTES)
        if self._exact is None:
            h.update(data[prev:])
            h.update(_L0_SUFFIX)
            self._exact = h.digest(KEY_BYTES)

    def fill(self, lo: int, hi: int) -> None:
        """Compute the L1 keys of boundaries ``lo <= i < hi`` (one pass from ``lo`` if any is missing)."""
        lo = max(lo, 0)
        if None in self._keys[lo:hi]:
            self.scan_tail(lo, ar=False)
