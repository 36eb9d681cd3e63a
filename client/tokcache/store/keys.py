"""Cache keys: content hashes of text prefixes, namespaced by salt and mode.

A key is ``blake3(header || utf8(text[:cut]))`` truncated to 16 bytes, where
the header binds the layer and tenant. One running hasher walks the text and
is digested at every cut, so keying all ~160 boundaries of a 57 KB prompt
hashes each byte once (``digest`` does not finalize a blake3 hasher).

Keys do not name the model: a segment holds exactly one tokenizer
fingerprint, and two model names with the same tokenizer share entries.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from blake3 import blake3

__all__ = ["CHECKPOINT_CUTS", "KEY_BYTES", "KeyState", "KeyStream", "MODE_EXACT", "MODE_KV_STABLE", "TextKeys",
           "l0_key", "namespace", "root_hasher", "segment_key"]

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


class KeyState(NamedTuple):
    """Where hashing one text stopped, for a text that extends it (``TextKeys(resume=...)``).

    ``hasher`` was fed the namespace header and ``data[:spans[cut][1]]`` and is never
    updated again (a user copies it); ``l1`` and ``ar`` hold the L1 and AR keys that text
    computed, by cut index (None where not computed): only those at cuts ``<= cut`` are
    meant (the text's own lists, shared, not copied). Valid for any text whose first
    ``cut + 1`` boundary spans, and the bytes before the end of span ``cut``, are the same.
    """

    cut: int
    hasher: Any
    l1: list[bytes | None]
    ar: list[bytes | None]


# Random access below the keys a request hashes anyway (the longest-prefix search after a
# rewritten history gallops back): one pass keeps a hasher every this many cuts, so a key
# costs a copy and at most this many cuts of hashing, not a pass over its whole prefix.
CHECKPOINT_CUTS = 16


@functools.lru_cache(maxsize=64)
def root_hasher(salt: str, mode: bytes) -> Any:  # noqa: ANN401 - blake3's hasher type is untyped
    """A hasher fed the namespace header of (salt, mode): copy it, never update it."""
    return KeyStream(salt, mode)._h


class TextKeys:
    """Keys of one text at its boundaries, computed lazily and only where needed.

    Hashing is the cost that scales with the text: a 57 KB prompt has ~300
    cuts, and an update + digest at each is ~200 µs in Python, while one
    blake3 pass over all of it is ~14 µs. A growing conversation needs keys at
    its last few cuts only (the lookup probes them; the new ones are stored),
    so :meth:`scan_tail` fills those, the AR keys at the boundary starts
    between them and the whole-text key in one running pass; any other key
    is hashed from the nearest state this object holds.

    ``resume`` (a :class:`KeyState` of a text this one extends) makes the keys it holds
    free and starts hashing at its cut: a turn hashes only what it appended.
    ``spans`` are the (start, end) offsets of the boundary tokens: the L1 key
    of boundary ``i`` covers ``data[:end]``, its AR key ``data[:start]``.
    """

    __slots__ = ("_root", "_data", "_spans", "_keys", "_ar_keys", "_exact", "_resume", "_marks", "_state")

    @property
    def data(self) -> bytes:
        """The text the keys are of (UTF-8)."""
        return self._data

    def __init__(self, data: bytes, spans: list[tuple[int, int]], salt: str, mode: bytes,
                 resume: KeyState | None = None) -> None:
        self._root = root_hasher(salt, mode)
        self._data = data
        self._spans = spans
        n = len(spans)
        self._keys: list[bytes | None] = [None] * n
        self._ar_keys: list[bytes | None] = [None] * n
        self._exact: bytes | None = None
        ok = resume is not None and resume.cut < n and spans[resume.cut][1] <= len(data)
        self._resume = resume if ok else None
        # Hasher states (offset, hasher) by ascending offset, beside the resume point.
        self._marks: list[tuple[int, Any]] = []
        self._state: KeyState | None = None

    def _hasher_at(self, offset: int) -> Any:  # noqa: ANN401 - blake3's hasher type is untyped
        """A (new) hasher fed the namespace header and ``data[:offset]``, from the nearest
        state at or below ``offset``."""
        start, base = 0, self._root
        r = self._resume
        if r is not None:
            r_off = self._spans[r.cut][1]
            if r_off <= offset:
                start, base = r_off, r.hasher
        for m_off, m in self._marks:
            if start < m_off <= offset:
                start, base = m_off, m
        h = base.copy()
        if offset > start:
            h.update(memoryview(self._data)[start:offset])
        return h

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The boundary spans the keys are at."""
        return self._spans

    @property
    def keys(self) -> list[bytes]:
        """The L1 keys by boundary index; only the ones computed are set (see :meth:`fill`)."""
        return self._keys  # type: ignore[return-value]

    @property
    def ar_keys(self) -> list[bytes]:
        """The AR keys by boundary index; only the ones computed are set (see :meth:`fill_ar`)."""
        return self._ar_keys  # type: ignore[return-value]

    def state(self) -> KeyState | None:
        """Where :meth:`scan_tail` left the last cut a longer text keeps (for ``resume``)."""
        return self._state

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
            r = self._resume
            if r is not None and i <= r.cut:
                k = r.l1[i]
            if k is None:
                self._checkpoint(i)
                k = self._hasher_at(self._spans[i][1]).digest(KEY_BYTES)
            self._keys[i] = k
        return k

    def ar_key(self, i: int) -> bytes:
        """The AR key of ``data[:spans[i][0]]``: a recorded output ending where boundary ``i`` starts."""
        k = self._ar_keys[i]
        if k is None:
            r = self._resume
            if r is not None and i <= r.cut:
                k = r.ar[i]
            if k is None:
                self._checkpoint(i)
                h = self._hasher_at(self._spans[i][0])
                h.update(_AR_SUFFIX)
                k = h.digest(KEY_BYTES)
            self._ar_keys[i] = k
        return k

    def _checkpoint(self, i: int) -> None:
        """Before hashing a key far below every state held: one pass keeping a hasher every
        CHECKPOINT_CUTS cuts up to the lowest state (a gallop then costs short hashes)."""
        spans = self._spans
        offset = spans[i][1]
        low = spans[self._resume.cut][1] if self._resume is not None else len(self._data)
        if self._marks or offset + 4096 > low:
            return
        h = self._root.copy()
        mv = memoryview(self._data)
        prev = 0
        marks = []
        for j in range(CHECKPOINT_CUTS - 1, len(spans), CHECKPOINT_CUTS):
            end = spans[j][1]
            if end >= low:
                break
            h.update(mv[prev:end])
            prev = end
            marks.append((end, h.copy()))
        self._marks = marks

    def scan_tail(self, lo: int, *, ar: bool, keep: int | None = None) -> None:
        """One pass from boundary ``lo`` to the end: L1 keys of boundaries ``>= lo``, the
        whole-text key and, with ``ar``, the AR keys of boundaries ``> lo``.

        ``keep``: the number of leading cuts any longer text keeps (see ``Scan.stable``);
        the state at the last of them is kept for :meth:`state`.
        """
        spans = self._spans
        n = len(spans)
        lo = max(lo, 0)
        data = memoryview(self._data)  # views: no copies of the text
        keys, ar_keys = self._keys, self._ar_keys
        r = self._resume
        if r is not None and lo - 1 <= r.cut:
            # Keys the text this one extends computed are the same here: take them (one
            # slice each), and hash from where it stopped.
            known = r.l1[lo:r.cut + 1]
            known_ar = r.ar[lo + 1:r.cut + 1] if ar else []
            if None in known or None in known_ar:
                r = None  # (not a window it computed: hash the whole window)
            else:
                keys[lo:r.cut + 1] = known
                if ar:
                    ar_keys[lo + 1:r.cut + 1] = known_ar
        if r is not None and lo - 1 <= r.cut:
            first = r.cut + 1
            prev = spans[r.cut][1]
            h = r.hasher  # copied before any update (never changed: others hold it)
        else:
            first = lo + 1
            prev = spans[lo][1] if lo < n else len(data)
            h = self._hasher_at(prev)  # a fresh one: ours
            if lo < n and keys[lo] is None:
                keys[lo] = h.digest(KEY_BYTES)
        last = -1 if keep is None else keep - 1
        if last == first - 1 and last >= lo:
            self._state = KeyState(last, h, keys, ar_keys)
        h = h.copy()
        for i in range(first, n):
            start, end = spans[i]
            if ar:
                h.update(data[prev:start])
                prev = start
                if ar_keys[i] is None:
                    a = h.copy()
                    a.update(_AR_SUFFIX)
                    ar_keys[i] = a.digest(KEY_BYTES)
            h.update(data[prev:end])
            prev = end
            if keys[i] is None:
                keys[i] = h.digest(KEY_BYTES)
            if i == last:
                self._state = KeyState(i, h.copy(), keys, ar_keys)
        if self._exact is None:
            h.update(data[prev:])
            h.update(_L0_SUFFIX)
            self._exact = h.digest(KEY_BYTES)

    def fill(self, lo: int, hi: int) -> None:
        """Compute the L1 keys of boundaries ``lo <= i < hi`` (one pass from ``lo`` if any is missing)."""
        lo = max(lo, 0)
        if None in self._keys[lo:hi]:
            self.scan_tail(lo, ar=False)

    def fill_ar(self, lo: int, hi: int) -> None:
        """Compute the AR keys of boundaries ``lo <= i < hi`` that are missing."""
        ar_keys = self._ar_keys
        for i in range(max(lo, 0), hi):
            if ar_keys[i] is None:
                self.ar_key(i)
