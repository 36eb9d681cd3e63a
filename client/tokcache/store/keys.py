"""Cache keys: content hashes of text prefixes, namespaced by salt and mode.

A key is ``sha256(header || utf8(text[:cut]))`` truncated to 16 bytes, where
the header binds the layer and tenant. One running hasher walks the text and
is digested at every keyed cut (KEY_GRID), so keying a 57 KB prompt hashes each
byte once (``digest`` finalizes a copy of the state, not the hasher).

Keys do not name the model: a segment holds exactly one tokenizer
fingerprint, and two model names with the same tokenizer share entries.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any, NamedTuple

from ._hash import Hasher, KeyHasher

__all__ = ["CHECKPOINT_CUTS", "KEY_BYTES", "KEY_GRID", "KeyState", "KeyStream", "MODE_EXACT", "MODE_KV_STABLE",
           "TextKeys", "extend_keyed", "l0_key", "namespace", "output_key", "pending_key", "root_hasher", "segment_key",
           "segment_root"]

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
        self._h = Hasher(b"tokcache/v1\x00" + self.namespace)

    def feed(self, data: bytes) -> None:
        """Append the next bytes of the text."""
        self._h.update(data)

    def exact_key(self) -> bytes:
        """Key of the L0 entry for the text fed so far (the whole text)."""
        h = self._h.copy()
        h.update(_L0_SUFFIX)
        return h.digest()[:KEY_BYTES]

    def output_key(self) -> bytes:
        """Key of an AR entry ending at the text fed so far (a recorded output)."""
        h = self._h.copy()
        h.update(_AR_SUFFIX)
        return h.digest()[:KEY_BYTES]


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


def output_key(prompt: str | bytes, output: str | bytes, *, salt: str = "") -> bytes:
    """The AR key of a recorded output: where ``output`` ends after ``prompt`` (kv-stable),
    the key ``RecordOutput`` stores it under. UnicodeEncodeError for invalid text."""
    stream = KeyStream(salt, MODE_KV_STABLE)
    stream.feed(prompt if isinstance(prompt, bytes) else prompt.encode("utf-8"))
    stream.feed(output if isinstance(output, bytes) else output.encode("utf-8"))
    return stream.output_key()


_PENDING = Hasher(b"tokcache/v1\x00P")


def pending_key(ar_key: bytes) -> bytes:
    """The key of the mark saying "a record for AR key ``ar_key`` is on its way" (``Store.mark``).

    Derived from the AR key alone, so a reader that computed AR keys for a text's cuts
    finds the marks of the same cuts without hashing the text again."""
    h = _PENDING.copy()
    h.update(ar_key)
    return h.digest()[:KEY_BYTES]


def segment_key(salt: str, mode: bytes, text: bytes | memoryview) -> bytes:
    """Key of a segment-AR entry: a recorded output's text on its own (a read probes one per
    piece of its uncached tail: the namespace header is hashed once per namespace)."""
    h = segment_root(salt, mode).copy()
    h.update(text)
    return h.digest()[:KEY_BYTES]


@functools.lru_cache(maxsize=256)
def segment_root(salt: str, mode: bytes) -> KeyHasher:
    """A hasher fed segment_key's namespace header: copy it, never update it."""
    return Hasher(b"tokcache/v1\x00S" + namespace(salt, mode))


# Which cuts carry an L1 key: the first cut, and the first cut ending in each KEY_GRID-byte
# block of the text after it. A cut's status depends only on itself and the cut before it
# (a prefix property: every text sharing the prefix keys the same cuts), so a writer and
# every later reader agree. One key per ~2 KB instead of one per boundary token (~12 per
# 2 KB of agent chat): a request hashes and probes a key or two for what it appended, a
# record carries a few entries, and the L1 hit is at most a block before the longest cut
# (a process re-encodes none of that: Lookup's canonical tail; another one re-encodes
# ≤ 2 KB). 0 keys every cut.
KEY_GRID = 2048


def extend_keyed(spans: Sequence[tuple[int, int]], grid: int, start: int, keyed: list[int]) -> None:
    """Append to ``keyed`` the indices ``i >= start`` of the cuts of ``spans`` that carry a key."""
    prev_block = spans[start - 1][1] // grid if start > 0 and grid else -1
    for i in range(start, len(spans)):
        if not grid:
            keyed.append(i)
            continue
        block = spans[i][1] // grid
        if block != prev_block:
            keyed.append(i)
            prev_block = block


class KeyState(NamedTuple):
    """Where hashing one text stopped, for a text that extends it (``TextKeys(resume=...)``).

    ``hasher`` was fed the namespace header and ``data[:spans[cut][1]]`` and is never
    updated again (a user copies it); None when it is to be rebuilt from the text (a state
    cut back with :meth:`at`). ``keyed`` are that text's keyed cut indices and
    ``l1`` their keys by position in ``keyed`` (None where not computed); ``ar`` its AR keys
    by cut index. Only entries at cuts ``<= cut`` are meant (the text's own lists, shared,
    not copied). Valid for any text whose first ``cut + 1`` boundary spans, and the bytes
    before the end of span ``cut``, are the same.
    """

    cut: int
    hasher: Any
    l1: list[bytes | None]
    ar: list[bytes | None]
    keyed: list[int]

    def at(self, cut: int) -> KeyState:
        """This state cut back to an earlier cut (<= ``self.cut``), for a text that shares only
        the bytes up there: the same keys, no hasher (TextKeys rebuilds it in one pass)."""
        if cut > self.cut:
            raise ValueError(f"cut {cut} is past this state's {self.cut}")
        return KeyState(cut, self.hasher if cut == self.cut else None, self.l1, self.ar, self.keyed)


# Random access below the keys a request hashes anyway (the longest-prefix search after a
# rewritten history gallops back): one pass keeps a hasher every this many cuts, so a key
# costs a copy and at most this many cuts of hashing, not a pass over its whole prefix.
CHECKPOINT_CUTS = 16


@functools.lru_cache(maxsize=256)
def root_hasher(salt: str, mode: bytes) -> KeyHasher:
    """A hasher fed the namespace header of (salt, mode): copy it, never update it.

    Shared (per namespace, across requests and threads: only ever copied), so a request
    does not build one — a few µs of cold interpreter and hashing work each time."""
    return KeyStream(salt, mode)._h


class TextKeys:
    """Keys of one text at its keyed cuts, computed lazily and only where needed.

    Hashing is the cost that scales with the text: a 57 KB prompt has ~300 boundaries,
    ~30 of them keyed (see KEY_GRID), and one SHA-256 pass over all of it is ~35 µs while
    each digest is a call. A growing conversation needs keys at its last keyed cuts only
    (the lookup probes them; the new ones are stored), so :meth:`scan_tail` fills those and
    the whole-text key in one running pass; any other key is hashed from the nearest state
    this object holds.

    L1 keys are addressed by *position* in :attr:`keyed` (the keyed cut indices, ascending);
    AR keys by cut index (every boundary start may end a recorded output). ``resume`` (a
    :class:`KeyState` of a text this one extends) makes the keys it holds free and starts
    hashing at its cut: a turn hashes only what it appended. ``spans`` are the (start, end)
    offsets of the boundary tokens: the L1 key of cut ``i`` covers ``data[:end]``, its AR key
    ``data[:start]``.
    """

    __slots__ = ("_root", "_data", "_spans", "_keyed", "_keys", "_ar_keys", "_exact", "_resume", "_marks",
                 "_state")

    def __init__(self, data: bytes, spans: Sequence[tuple[int, int]], salt: str, mode: bytes,
                 resume: KeyState | None = None, *, grid: int = KEY_GRID) -> None:
        self._root = root_hasher(salt, mode)
        self._data = data
        self._spans = spans
        n = len(spans)
        ok = resume is not None and resume.cut < n and spans[resume.cut][1] <= len(data)
        r = resume if ok else None
        if r is not None and r.hasher is None:
            # A state cut back (KeyState.at): one pass over the shared bytes, in one call
            # rather than a key at a time.
            h = self._root.copy()
            h.update(memoryview(data)[:spans[r.cut][1]])
            r = r._replace(hasher=h)
        self._resume = r
        if r is not None:
            p = bisect_right(r.keyed, r.cut)
            keyed = r.keyed[:p]
            keys: list[bytes | None] = r.l1[:p]
            extend_keyed(spans, grid, r.cut + 1, keyed)
            keys += [None] * (len(keyed) - p)
        else:
            keyed = []
            extend_keyed(spans, grid, 0, keyed)
            keys = [None] * len(keyed)
        self._keyed = keyed
        self._keys = keys
        self._ar_keys: list[bytes | None] = [None] * n
        self._exact: bytes | None = None
        # Hasher states (offset, hasher) by ascending offset, beside the resume point.
        self._marks: list[tuple[int, KeyHasher]] = []
        self._state: KeyState | None = None

    @classmethod
    def from_state(cls, data: bytes, spans: Sequence[tuple[int, int]], salt: str, mode: bytes, keyed: list[int],
                   keys: list[bytes | None], exact: bytes, cut: int, hasher: Any,  # noqa: ANN401
                   resume: KeyState | None, *, grid: int = KEY_GRID,
                   ar_keys: list[bytes | None] | None = None) -> TextKeys:
        """The keys a caller computed already (the native fast path): ``keyed``, their keys by
        position, the L0 key, the hash state at ``cut`` (for :meth:`state`), and the AR keys by
        cut index (None: none made); ``resume`` is the state they were computed from (lazy keys
        below use it). Nothing is hashed here."""
        self = cls.__new__(cls)
        self._root = root_hasher(salt, mode)
        self._data = data
        self._spans = spans
        self._keyed = keyed
        self._keys = keys
        self._ar_keys = ar_keys if ar_keys is not None else [None] * len(spans)
        self._exact = exact
        self._resume = resume
        self._marks = []
        self._state = KeyState(cut, hasher, keys, self._ar_keys, keyed)
        return self

    @property
    def data(self) -> bytes:
        """The text the keys are of (UTF-8)."""
        return self._data

    @property
    def spans(self) -> Sequence[tuple[int, int]]:
        """The boundary spans the keys are at."""
        return self._spans

    @property
    def keyed(self) -> list[int]:
        """The indices of the cuts that carry an L1 key, ascending (see KEY_GRID)."""
        return self._keyed

    @property
    def keys(self) -> list[bytes]:
        """The L1 keys by position in :attr:`keyed`; only the ones computed are set."""
        return self._keys  # type: ignore[return-value]

    @property
    def ar_keys(self) -> list[bytes]:
        """The AR keys by cut index; only the ones computed are set (see :meth:`fill_ar`)."""
        return self._ar_keys  # type: ignore[return-value]

    def state(self) -> KeyState | None:
        """Where :meth:`scan_tail` left the last cut a longer text keeps (for ``resume``)."""
        return self._state

    def _hasher_at(self, offset: int) -> KeyHasher:
        """A (new) hasher fed the namespace header and ``data[:offset]``, from the nearest
        state at or below ``offset``."""
        start, base = 0, self._root
        for r in (self._resume, self._state):  # (the state a scan left: at its last stable cut)
            if r is not None and r.hasher is not None:
                r_off = self._spans[r.cut][1] if r.cut >= 0 else 0
                if start < r_off <= offset:
                    start, base = r_off, r.hasher
        for m_off, m in self._marks:
            if start < m_off <= offset:
                start, base = m_off, m
        h = base.copy()
        if offset > start:
            h.update(memoryview(self._data)[start:offset])
        return h

    def output_key(self, output: bytes) -> bytes:
        """The AR key of a recorded ``output`` (UTF-8) after this text (``tokcache.store.keys.output_key``),
        hashed on from the nearest state held, not from the start."""
        h = self._hasher_at(len(self._data))
        h.update(output)
        h.update(_AR_SUFFIX)
        key: bytes = h.digest()[:KEY_BYTES]
        return key

    def exact_key(self) -> bytes:
        """The L0 key of the whole text."""
        if self._exact is None:
            h = self._hasher_at(len(self._data))
            h.update(_L0_SUFFIX)
            self._exact = h.digest()[:KEY_BYTES]
        return self._exact

    def key_at(self, pos: int) -> bytes:
        """The L1 key of the keyed cut at position ``pos`` (``data[:spans[keyed[pos]][1]]``)."""
        k = self._keys[pos]
        if k is None:
            end = self._spans[self._keyed[pos]][1]
            self._checkpoint(end)
            k = self._keys[pos] = self._hasher_at(end).digest()[:KEY_BYTES]
        return k

    def ar_key(self, i: int) -> bytes:
        """The AR key of ``data[:spans[i][0]]``: a recorded output ending where boundary ``i`` starts."""
        k = self._ar_keys[i]
        if k is None:
            r = self._resume
            if r is not None and i <= r.cut:
                k = r.ar[i]
            if k is None:
                start = self._spans[i][0]
                self._checkpoint(start)
                h = self._hasher_at(start)
                h.update(_AR_SUFFIX)
                k = h.digest()[:KEY_BYTES]
            self._ar_keys[i] = k
        return k

    def _checkpoint(self, offset: int) -> None:
        """Before hashing a key far below every state held: one pass keeping a hasher every
        CHECKPOINT_CUTS cuts up to the lowest state (a gallop then costs short hashes)."""
        spans = self._spans
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

    def scan_tail(self, lo: int, *, keep: int | None = None) -> None:
        """One pass over the text's end: the L1 keys at keyed positions ``>= lo`` (those the
        text this one extends holds are taken as they are), the whole-text key, and, for
        ``keep`` (the number of leading cuts any longer text keeps, see ``Scan.stable``),
        the state at the last of them for :meth:`state`."""
        spans, keyed, keys = self._spans, self._keyed, self._keys
        lo = max(lo, 0)
        if None in keys[lo:]:  # (one C-level scan: usually only what was appended is missing)
            todo = [p for p in range(lo, len(keyed)) if keys[p] is None]
        else:
            todo = []
        last = -1 if keep is None else keep - 1
        keep_at = spans[last][1] if last >= 0 else -1
        r = self._resume
        if r is not None and last == r.cut and not todo:
            self._state = KeyState(last, r.hasher, keys, self._ar_keys, keyed)
        # The pass starts at the nearest state below everything it computes.
        first = min([spans[keyed[todo[0]]][1]] if todo else [], default=len(self._data))
        if 0 <= keep_at < first and (r is None or last != r.cut):
            first = keep_at
        h = self._hasher_at(first)
        start = first
        data = memoryview(self._data)  # views: no copies of the text
        marks = [(spans[keyed[p]][1], p) for p in todo]
        if keep_at >= first and (r is None or last != r.cut):
            marks.append((keep_at, -1))
            marks.sort()
        for end, p in marks:
            if end > start:
                h.update(data[start:end])
                start = end
            if p >= 0:
                keys[p] = h.digest()[:KEY_BYTES]
            else:
                self._state = KeyState(last, h.copy(), keys, self._ar_keys, keyed)
        if self._exact is None:
            h.update(data[start:])
            h.update(_L0_SUFFIX)
            self._exact = h.digest()[:KEY_BYTES]

    def fill(self, lo: int, hi: int) -> None:
        """Compute the L1 keys at keyed positions ``lo <= p < hi`` that are missing."""
        for p in range(max(lo, 0), hi):
            if self._keys[p] is None:
                self.key_at(p)

    def fill_ar(self, lo: int, hi: int) -> None:
        """Compute the AR keys of boundaries ``lo <= i < hi`` that are missing: one running
        pass from the nearest state below the first of them."""
        ar_keys = self._ar_keys
        r = self._resume
        todo = []
        for i in range(max(lo, 0), hi):
            if ar_keys[i] is None:
                k = r.ar[i] if r is not None and i <= r.cut else None
                if k is None:
                    todo.append(i)
                else:
                    ar_keys[i] = k
        if not todo:
            return
        spans = self._spans
        start = spans[todo[0]][0]
        self._checkpoint(start)
        h = self._hasher_at(start)
        data = memoryview(self._data)
        for i in todo:
            end = spans[i][0]
            if end > start:
                h.update(data[start:end])
                start = end
            a = h.copy()
            a.update(_AR_SUFFIX)
            ar_keys[i] = a.digest()[:KEY_BYTES]
