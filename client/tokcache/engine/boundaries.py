"""Safe boundaries: where a text can be cut so that the ids of the parts concatenate.

HF ``tokenizers`` splits added tokens out of the input before normalization
and pre-tokenization, so for an added token ``S`` that is matched atomically,
``encode(a + S + b) == encode(a + S) + encode(b)``. That is what lets L1 reuse
the ids of a cached prefix ending in ``S`` and encode only the tail.

It is not true for every added token: ``lstrip``/``rstrip`` tokens swallow
neighbouring whitespace, ``single_word`` tokens only match between word
boundaries, ``normalized`` tokens are matched after normalization, and a
Metaspace pre-tokenizer with ``prepend_scheme: first`` treats the start of the
input differently from text after a token. Rather than trusting the flags,
every added token (special or not — Qwen marks ``<tool_call>``, ``<think>``
as non-special) is *tested* on probe strings at load; the ones that pass are
boundaries. A tokenizer with none gets no L1, and says why.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from tokcache import native
from tokcache.engine.encoder import Encoder
from tokcache.engine.ids import Chunks, untrack

log = logging.getLogger(__name__)

# The added-token scan in C (``_speedups.c``: the same matches as the trie regex below) when
# the extension was built. TOKCACHE_PURE_PYTHON=1 forces the regex (the tests compare both).
def _load_native() -> Any:  # noqa: ANN401 - the extension module, or None
    return native.engine()


_native: Any = _load_native()

__all__ = ["BoundaryCheck", "BoundaryScanner", "Encoded", "Scan", "added_tokens", "check_boundaries",
           "extends"]

# (a, b) pairs around each candidate token: whitespace on either side probes
# lstrip/rstrip, letters right after probe single_word, an empty ``a`` probes
# start-of-input handling (Metaspace "first"), and CJK/digits/newline runs
# probe pre-tokenizer regex edges.
_PROBE_PAIRS: tuple[tuple[str, str], ...] = (
    ("", "hello"),
    ("", " hello"),
    ("hello", "world"),
    ("hello ", " world"),
    ("x  ", "  y"),
    ("\n", "\n\nfoo"),
    ("a\n\n", "\n"),
    ("你好", "世界"),
    ("word", "word"),
    ("12", "34"),
    (" ", " "),
    ("end.", "Start"),
    ("\t", "\tz"),
    ("", ""),
    ("abc", ""),
)


@dataclass(frozen=True)
class BoundaryCheck:
    """Result of the load-time self-check."""

    boundary_tokens: tuple[str, ...]
    rejected: tuple[str, ...]
    disabled_reason: str


def added_tokens(tokenizer_json: Path) -> list[dict[str, object]]:
    """The ``added_tokens`` of a tokenizer.json (parsed once per file version: big vocabularies
    take ~0.1 s to parse)."""
    stat = tokenizer_json.stat()
    return _added_tokens_cached(str(tokenizer_json), stat.st_mtime_ns, stat.st_size)


_ADDED_KEY = re.compile(rb'"added_tokens"\s*:\s*')


@functools.lru_cache(maxsize=8)
def _added_tokens_cached(path: str, _mtime_ns: int, _size: int) -> list[dict[str, object]]:
    raw = Path(path).read_bytes()
    # Only the added_tokens array is parsed (~1 ms), not the whole file (~150 ms for a
    # 150k vocabulary, on every process's first request): in JSON a quoted key followed
    # by a colon cannot occur inside a string, and HF writes added_tokens before the model.
    tokens: object = None
    found = _ADDED_KEY.search(raw)
    window = 64 << 10
    while found is not None and tokens is None:
        chunk = raw[found.end():found.end() + window]
        try:
            tokens, _ = json.JSONDecoder().raw_decode(chunk.decode("utf-8", "replace"))
        except ValueError:  # cut short by the window (or not JSON: the whole file decides)
            if len(chunk) < window:
                break
            window *= 8
    if not isinstance(tokens, list):
        tokens = json.loads(raw).get("added_tokens") or []
    assert isinstance(tokens, list)
    return [t for t in tokens if isinstance(t, dict) and isinstance(t.get("content"), str)]


def check_boundaries(tokenizer_json: Path, reference: Encoder) -> BoundaryCheck:
    """Test every added token of ``tokenizer_json`` as a cut point with ``reference``."""
    tokens = added_tokens(tokenizer_json)
    good: list[str] = []
    bad: list[str] = []
    for tok in tokens:
        content = str(tok["content"])
        if not content:
            continue
        ok = True
        for a, b in _PROBE_PAIRS:
            whole = reference.encode(a + content + b)
            # Right side: cut after S (L1). Left side: cut before S (where a
            # recorded output ends and the template's end-of-turn token follows).
            if (whole != reference.encode(a + content) + reference.encode(b)
                    or whole != reference.encode(a) + reference.encode(content + b)):
                ok = False
                break
        (good if ok else bad).append(content)
    reason = ""
    if not good:
        reason = "no added token passed the boundary self-check" if tokens else "tokenizer has no added tokens"
        log.warning("L1 disabled for %s: %s", tokenizer_json, reason)
    elif bad:
        log.info("%d added tokens are not safe boundaries for %s (e.g. %r)", len(bad), tokenizer_json, bad[:3])
    return BoundaryCheck(tuple(good), tuple(bad), reason)


_Trie = dict[int | None, "_Trie"]


@dataclass(slots=True)
class Encoded:
    """The canonical ids of a text from byte ``start`` (a cut) on, no recorded output spliced,
    and where its keyed cuts and last stable cut fall in them (byte offset -> tokens before it).
    ``ids``: a conversation's turns share their parts (see lookup._Tail.chunks)."""

    start: int
    ids: Chunks
    cut_tokens: dict[int, int]


@dataclass(slots=True, eq=False)  # identity: the memo finds and drops *this* entry, not an equal one
class Scan:
    """A scanned text: its boundary spans, and what the next scan of a text extending it needs.

    ``data`` is the UTF-8 text (``text`` the str it came from, when scanned from one);
    ``spans`` every boundary token's (start, end) (a list of tuples, or the native fast path's
    ``_speedups.Spans``: the same as a read-only sequence); ``tail`` the (start, end) of every
    added-token match that starts within ``maxlen`` bytes of the end (a longer text may
    match differently there), ``tail_from`` where that region starts and ``kept_end`` the
    end of the last match that starts before it. ``base_len`` is the length of the text it
    extended (0: none). Shared with the memo: read-only.

    ``stable`` is how many leading spans every longer text that extends this one has too
    (those starting before ``tail_from``). ``hashers`` lets a reader keep, per key namespace,
    where hashing stopped (a ``tokcache.store.keys.KeyState`` at a stable cut), so the next
    text that extends it hashes only what it appended (see ``TextKeys``).
    """

    data: bytes
    spans: Sequence[tuple[int, int]]
    tail: list[tuple[int, int]]
    tail_from: int
    kept_end: int
    base_len: int = 0
    text: str | None = None
    hashers: dict[tuple[str, bytes], Any] = field(default_factory=dict)
    base: Scan | None = None
    stable: int = 0
    # Where the memo filed it (None: not filed under an anchor, e.g. still among the recent).
    filed: tuple[bool, int, int] | None = None
    # A reader's canonical encoding of this text from some cut on (see Lookup._canonical_tail).
    encoded: Encoded | None = None
    # A text extending this one was filed since (its head, if any, is of no more use).
    superseded: bool = False
    # The text this one's line of extensions started from (a conversation's first turn, or a
    # history the template rewrote: one that extended none of the texts before it), when that
    # is not this one; kept alive here for the next rewrite of the history (see _MEMO_ROOTS).
    root: Scan | None = None
    # On a root: the memo key its line's latest text was last filed under (None: not filed since),
    # so a text that rewrites the line's history drops that text without searching the memo.
    line_key: tuple[bool, int, int] | None = None
    # Bytes this entry keeps alive (for the memo's budget): its texts, and its root's. Fixed
    # at construction (the texts and the root never change), so the memo adds and subtracts
    # the same figure, and reading it touches neither the old text nor its root.
    weight: int = field(init=False)

    def __post_init__(self) -> None:
        own = len(self.data) + (sys.getsizeof(self.text) if self.text is not None else 0)
        self.weight = own if self.root is None else own + self.root.weight  # (a root has no root of its own)

    @property
    def line_root(self) -> Scan:
        """The text this one's line of extensions started from (``root``, or this one)."""
        return self if self.root is None else self.root

    def prefix(self, limit: int) -> Scan | None:
        """A base for a text that shares this one's first ``limit + maxlen - 1`` bytes and then
        differs (a rewritten history): this text up to the end of a boundary span starting
        before ``limit`` — the last one where its canonical encoding is known (``encoded``), else
        the last one — with its spans, key states and encoding up there. None: no such span.

        Every match that starts before ``limit`` is the same in both texts (no added token is
        longer than ``maxlen``, and matching is left to right), and the end of a match is where
        a full scan resumes, so :meth:`BoundaryScanner._finish` scans the other text from that
        end. Not a text of its own: never filed, read once."""
        spans = self.spans
        k = bisect_left(spans, (limit, -1))  # spans[:k] start before limit
        if k == 0:
            return None
        j = k - 1
        enc = self.encoded
        if enc is not None:
            at = enc.cut_tokens
            while j >= 0 and spans[j][1] not in at:
                j -= 1
            if j < 0 or enc.start > spans[j][1]:
                j, enc = k - 1, None
        end = spans[j][1]
        if enc is not None:
            enc = Encoded(enc.start, enc.ids, {c: t for c, t in enc.cut_tokens.items() if c <= end})
        # Key states (tokcache.store.keys.KeyState) cut back to span j: their keys up there are
        # the other text's too; the hasher is rebuilt where it is needed (TextKeys).
        hashers = {ns: st.at(j) for ns, st in self.hashers.items() if st.cut >= j}
        return Scan(self.data[:end], spans[:j + 1], [], end, end, text=None, hashers=hashers, stable=j + 1,
                    encoded=enc)


# Scan memo: recent texts within a byte budget, found by a window near their end.
#
# A text is filed under (its kind, an anchor, a hash of the window at the anchor): the
# anchor is its length minus a window, rounded down to a grid, so the window lies in the
# last grid + window units of the text. A text extending it holds the same window at the
# same anchor, and finds it by trying the anchors below its own length, from the top:
# a turn appends a few KB, so the right anchor is among the first few. Windows near the
# end tell conversations apart even when they share a long system prompt (a hash of the
# first bytes did not: every conversation of an agent lands on one key).
_MEMO_BYTES = 64 << 20
_MEMO_GRID = 4096  # units (chars of a str, bytes of UTF-8)
_MEMO_WINDOW = 64
_MEMO_PROBES = 48  # anchors tried: a base up to ~192K units shorter is found
_MEMO_PER_KEY = 32  # texts filed under one key (many conversations' first turns may share one)
_MEMO_CHECK = 256  # units before a candidate's end compared before the whole of it
# The latest texts, tried before any anchor: one per conversation in flight. An API server
# serves dozens at once, each turn of one between turns of others. With fewer than it serves,
# most texts find their base only by anchor, which the native fast path never probes (with 4,
# a process serving 16 conversations turn about found ~60% of its texts' bases that way, on the
# Python path), and the scan memo holds several texts per conversation instead of one (~3x
# the memory). A latest text the new one does not extend costs the native path ~40 ns (its
# last character compared), the Python path ~0.3 µs.
_MEMO_RECENT = 64
# A text that extends none of the latest may extend the text its conversation's line of turns
# started from (``Scan.root``): a template that rewrites history when the user speaks (Qwen3
# drops the reasoning of the turns since the user's previous message) renders the rewritten
# text as an extension of the prompt that followed that message, which is the previous such
# rewrite, or the conversation's first prompt (8 bench conversations: each of their 37
# rewritten turns extends the previous rewrite or first prompt, 5-9 turns back). Found, it
# is scanned, keyed and encoded from that text's end with its spans, key states and canonical
# encoding, as an extension is. The roots of the latest texts are tried, then the latest
# this many roots (a conversation's first rewrite extends its first prompt, whose line ended
# when the second prompt rewrote the first's generation prompt).
_MEMO_ROOTS = 8


# A text that extends none of the latest may still share a long prefix with one of them: a
# conversation whose history the template rewrote (Qwen3 drops earlier turns' reasoning once
# the user speaks again). Its spans, keys and encoding up to where they differ are reused
# (Scan.prefix) when at least this many bytes are shared.
_SHARED_MIN = 4096


def _common_prefix(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (the reference of the C one)."""
    n = min(len(a), len(b))
    lo = 0
    while lo < n and a[lo:lo + 4096] == b[lo:lo + 4096]:
        lo += 4096
    hi = min(n, lo + 4096)  # a[:lo] == b[:lo]; the first difference, if any, is before hi
    while lo < hi:  # bisect: a[:lo] == b[:lo], and a[:hi + 1] != b[:hi + 1] once hi moved
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


common_prefix = _native.common_prefix if _native is not None else _common_prefix


def extends(seq: str | bytes, old: str | bytes) -> bool:
    """Whether ``seq`` starts with ``old`` (of seq's type). The end of ``old`` is compared first:
    a text that does not extend it usually differs there, where the whole compare would run
    through the prefix they share (a system prompt: 4 bytes a character in a str holding an emoji)."""
    m = len(old)
    return m <= len(seq) and seq[max(0, m - _MEMO_CHECK):m] == old[-_MEMO_CHECK:] \
        and seq.startswith(old)  # type: ignore[arg-type]  # old has seq's type


def _anchor(n: int) -> int:
    """Where the memo window of a text of length ``n`` starts (-1: too short to file)."""
    return (n - _MEMO_WINDOW) // _MEMO_GRID * _MEMO_GRID if n >= _MEMO_WINDOW else -1


def _trie_pattern(words: set[bytes]) -> re.Pattern[bytes]:
    """A regex matching any of ``words``, leftmost-longest, factored as a trie.

    ``sre`` tries the branches of a flat alternation one by one at every
    candidate position; with 257 Llama added tokens that start with ``<`` the
    flat pattern costs ~4x more on code-heavy prompts. Greedy optional groups
    keep "longest" among words that are prefixes of one another.
    """
    root: _Trie = {}
    for word in words:
        node = root
        for byte in word:
            node = node.setdefault(byte, {})
        node[None] = {}

    def build(node: _Trie) -> bytes:
        alts = [re.escape(bytes([k])) + build(v) for k, v in sorted(
            ((k, v) for k, v in node.items() if k is not None), key=lambda kv: kv[0])]
        if not alts:
            return b""
        body = alts[0] if len(alts) == 1 else b"(?:" + b"|".join(alts) + b")"
        return b"(?:" + body + b")?" if None in node else body

    return re.compile(build(root))


class BoundaryScanner:
    """Finds the byte offsets just after each boundary token in UTF-8 text.

    Matching mimics the added-vocabulary split of ``tokenizers`` (leftmost,
    longest among *all* non-normalized added tokens), so a boundary token that
    is part of a longer added token is not mistaken for a cut point.
    """

    def __init__(self, all_added: Sequence[str], boundary_tokens: Sequence[str], *,
                 memo_bytes: int = _MEMO_BYTES, native: bool = True, recent: int = _MEMO_RECENT) -> None:
        """``recent``: how many of the latest texts are tried before the anchors (_MEMO_RECENT)."""
        self._boundaries = frozenset(t.encode("utf-8") for t in boundary_tokens)
        words = {t.encode("utf-8") for t in all_added if t}
        self._pattern: re.Pattern[bytes] | None = _trie_pattern(words) if self._boundaries else None
        self._matcher: Any = None
        if native and _native is not None and self._pattern is not None:
            self._matcher = _native.Matcher([(w, w in self._boundaries) for w in sorted(words)])
        self._maxlen = max((len(w) for w in words), default=1)
        # Recent texts and their scans (see _anchor): a growing conversation rescans (and
        # re-encodes, and re-hashes) only what it appended. Guarded by _lock (the memo is
        # shared by the threads of a process); _bytes is its weight.
        self._memo: OrderedDict[tuple[bool, int, int], list[Scan]] = OrderedDict()
        # The latest texts (up to ``recent``), newest first, tried before the anchors: a process
        # serving that many conversations at a time finds each one's previous turn here, which
        # the native fast path can use (it never probes anchors). A text leaves it for the
        # anchors when newer ones push it out.
        self._recent: list[Scan] = []
        # Each recent text's ``root`` (None: it is one), in step with _recent: what bases() answers
        # is made from them without reading each recent Scan again (cold at the next request of a
        # busy process: the comprehension over 64 of them cost ~5 µs of each).
        self._recent_roots: list[Scan | None] = []
        self._recent_max = recent
        # The latest texts that extended none of the latest ones (see _MEMO_ROOTS), newest
        # first, and their weight (apart from _bytes: a root in the memo too counts twice).
        self._roots: list[Scan] = []
        self._root_bytes = 0
        # What bases() answers, made again whenever those two change (_keep, after the reply)
        # rather than on every request: the list copies and the comprehension cost a cold
        # request ~6 µs. Replaced whole, never changed.
        self._bases: tuple[list[Scan], int] = ([], 0)
        self._memo_bytes = memo_bytes
        self._bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer_json: Path, check: BoundaryCheck, *,
                       recent: int = _MEMO_RECENT) -> BoundaryScanner:
        added = [str(t["content"]) for t in added_tokens(tokenizer_json) if not t.get("normalized")]
        return cls(added, check.boundary_tokens, recent=recent)

    @property
    def enabled(self) -> bool:
        return self._pattern is not None

    @property
    def matcher(self) -> Any:  # noqa: ANN401 - the native Matcher, or None
        """The native matcher (``_speedups.Matcher``), None where the regex serves."""
        return self._matcher

    @property
    def maxlen(self) -> int:
        """The longest added token, in UTF-8 bytes (a text's last ``maxlen - 1`` bytes may match
        differently once it grows)."""
        return self._maxlen

    def bases(self) -> tuple[list[Scan], int]:
        """The texts a new one may extend, as :meth:`scan_text` tries them: the latest, newest first,
        then their lines' roots and the latest roots (see _MEMO_ROOTS); and how many are the latest
        (a text extending one of the others starts a line of its own). A snapshot, shared by every
        caller until the next text is filed: read it, never change it."""
        return self._bases

    def _snapshot(self) -> None:
        """Make what :meth:`bases` answers from the latest texts and roots. Lock held."""
        bases = list(self._recent)
        n = len(bases)
        bases += filter(None, self._recent_roots)  # (a Scan is always true)
        bases += self._roots
        self._bases = (bases, n)

    def keep(self, scan: Scan) -> Scan:
        """File ``scan`` (made outside :meth:`scan_text`, from ``scan.base``) in the memo, as a scan
        would: it supersedes its base. Returns it."""
        return self._keep(scan, scan.base)

    def find_spans(self, data: bytes) -> list[tuple[int, int]]:
        """(start, end) of each boundary token in ``data``, ascending: one scan, nothing filed
        (a recorded output's pieces: not a text a later one extends)."""
        if self._pattern is None:
            return []
        if self._matcher is not None:
            spans, _tail, _kept, _stable = self._matcher.scan(data, 0, max(0, len(data) - self._maxlen + 1))
            return list(spans)
        return [m.span() for m in self._pattern.finditer(data) if m.group() in self._boundaries]

    def cuts(self, data: bytes) -> list[int]:
        """Offsets in ``data`` right after each boundary token, ascending."""
        return [end for _, end in self.spans(data)]

    def spans(self, data: bytes) -> list[tuple[int, int]]:
        """(start, end) offsets of each boundary token in ``data``, ascending (== a full scan)."""
        return list(self.scan(data).spans)

    def spans_and_base(self, data: bytes) -> tuple[list[tuple[int, int]], int]:
        """(boundary spans of ``data`` (a copy), length of the recent text it extends, or 0)."""
        scan = self.scan(data)
        return list(scan.spans), scan.base_len

    def scan(self, data: bytes) -> Scan:
        """The boundary spans of UTF-8 ``data`` (== a full scan), reusing a recent text it extends."""
        if self._pattern is None:
            return Scan(data, [], [], len(data), 0)
        base, extends = self._base(data)
        return self._finish(data, base if base is not None else self._shared(data), None, extends)

    def scan_text(self, text: str) -> Scan:
        """:meth:`scan` of ``text`` (its UTF-8 is ``Scan.data``): when a recent text scanned
        from a str is a prefix, only what was appended is encoded to UTF-8 (for a long
        conversation with non-ASCII text, encoding the whole of it costs ~1 ms per 800 KB).

        Raises UnicodeEncodeError for a lone surrogate, as ``str.encode`` does.
        """
        if self._pattern is None:
            data = text.encode("utf-8")
            return Scan(data, [], [], len(data), 0, text=text)
        base, extends = self._base(text)
        if base is not None:
            assert base.text is not None
            n = len(base.text)
            try:
                data = base.data + text[n:].encode("utf-8")
            except UnicodeEncodeError as exc:  # where in the whole text, not in its new part
                raise UnicodeEncodeError(exc.encoding, text, exc.start + n, exc.end + n, exc.reason) from None
        else:
            data = text.encode("utf-8")
            base = self._shared(data)
        return self._finish(data, base, text, extends)

    def _shared(self, data: bytes) -> Scan | None:
        """A base for ``data``, which extends none of the latest texts, from the one it shares
        the longest prefix with (at least _SHARED_MIN bytes; see :meth:`Scan.prefix`), or None."""
        best: Scan | None = None
        shared = _SHARED_MIN - 1
        for c in tuple(self._recent):  # a snapshot (other threads file too)
            n = common_prefix(data, c.data)
            if n > shared:
                best, shared = c, n
        return None if best is None else best.prefix(shared - self._maxlen + 1)

    def _base(self, seq: str | bytes) -> tuple[Scan | None, bool]:
        """(the longest recent text that ``seq`` extends (a str: one scanned from a str), or None;
        whether ``seq`` continues that text's line (False: it starts a line, see _MEMO_ROOTS))."""
        is_text = isinstance(seq, str)
        n = len(seq)
        bases, latest = self.bases()  # the newest first; a snapshot (other threads file too)
        for c in bases[:latest]:
            old = c.text if is_text else c.data
            if old is not None and (c.text is not None) == is_text and extends(seq, old):
                return c, True
        # A rewritten history: the roots of the latest texts' lines, and the latest roots.
        root = self._extended(bases[latest:], seq, is_text)
        if root is not None:
            return root, False
        top = _anchor(n)
        memo = self._memo
        for a in range(top, max(-1, top - _MEMO_PROBES * _MEMO_GRID), -_MEMO_GRID):
            key = (is_text, a, hash(seq[a:a + _MEMO_WINDOW]))
            with self._lock:
                bucket = memo.get(key)
                candidates = list(bucket) if bucket else ()
            best = self._extended(candidates, seq, is_text)
            if best is not None:
                return best, True
        return None, False

    @staticmethod
    def _extended(candidates: Sequence[Scan], seq: str | bytes, is_text: bool) -> Scan | None:
        """The longest of ``candidates`` (scanned from seq's type) that ``seq`` extends, or None."""
        best: Scan | None = None
        best_len = -1
        for c in candidates:  # the longest that is a prefix
            old = c.text if is_text else c.data
            if old is None or (c.text is not None) != is_text:
                continue
            if len(old) > best_len and extends(seq, old):
                best, best_len = c, len(old)
        return best

    def _file(self, scan: Scan, is_text: bool) -> tuple[bool, int, int] | None:
        """The memo key of ``scan`` (None: too short to file)."""
        seq = scan.text if is_text else scan.data
        assert seq is not None
        a = _anchor(len(seq))
        return None if a < 0 else (is_text, a, hash(seq[a:a + _MEMO_WINDOW]))

    def _finish(self, data: bytes, base: Scan | None, text: str | None, extends: bool) -> Scan:
        """The scan of ``data`` from ``base`` (None: from the start), filed; ``extends``: it continues
        ``base``'s line (else it starts one: see _MEMO_ROOTS)."""
        assert self._pattern is not None
        root = base.line_root if extends and base is not None else None
        if base is None:
            spans: list[tuple[int, int]] = []
            kept_end = pos = 0
        else:
            # Matches that start before the base's tail region cannot change (no added token
            # is longer than maxlen); the region itself is scanned again with the new text.
            kept_end = base.kept_end
            # A list either way (a Spans' slice is one too): extended below, never the base's.
            spans = cast("list[tuple[int, int]]", base.spans[:base.stable])
            pos = max(base.tail_from, kept_end)
        tail_from = max(0, len(data) - self._maxlen + 1)
        if self._matcher is not None:
            new, tail, kept, stable = self._matcher.scan(data, pos, tail_from)
            if kept >= 0:
                kept_end = kept
            stable += len(spans)
            spans += new
            return self._keep(Scan(data, spans, tail, tail_from, kept_end, len(base.data) if base is not None else 0,
                                   text, base=base, stable=stable, root=root), base)
        tail = []
        stable = -1
        boundaries = self._boundaries
        for m in self._pattern.finditer(data, pos):
            span = m.span()
            if span[0] < tail_from:
                kept_end = span[1]
            else:
                if stable < 0:
                    stable = len(spans)
                tail.append(span)
            if m.group() in boundaries:
                spans.append(span)
        scan = Scan(data, spans, tail, tail_from, kept_end, len(base.data) if base is not None else 0, text,
                    base=base, stable=len(spans) if stable < 0 else stable, root=root)
        return self._keep(scan, base)

    def _keep(self, scan: Scan, base: Scan | None) -> Scan:
        """File ``scan`` among the recent texts, superseding ``base``; returns it."""
        if isinstance(scan.spans, list):  # (a native Spans holds no objects: never tracked)
            untrack(scan.spans)  # kept: see tokcache.engine.ids.untrack (the native scan did it already)
        # The text this one extends is superseded: a conversation keeps one entry (its latest
        # turn), so the budget holds as many conversations as it can.
        with self._lock:
            recent = self._recent
            if base is not None:
                if base.filed is not None:
                    self._drop(base.filed, base)
                elif base in recent:
                    i = recent.index(base)
                    del recent[i], self._recent_roots[i]
                    self._bytes -= base.weight
            if base is not None and scan.root is None:
                self._drop_line(base)
            recent.insert(0, scan)
            self._recent_roots.insert(0, scan.root)
            self._bytes += scan.weight
            if len(recent) > self._recent_max:
                self._recent_roots.pop()
                self._file_old(recent.pop())
            while self._bytes > self._memo_bytes and self._memo:
                _, gone = self._memo.popitem(last=False)
                self._bytes -= sum(e.weight for e in gone)
                for e in gone:
                    e.filed = None
            while self._bytes > self._memo_bytes and recent:
                self._recent_roots.pop()
                self._bytes -= recent.pop().weight
            if scan.root is None:
                self._root(scan, base)
            self._snapshot()
        if base is not None:  # one level is all a reader uses: do not keep a chain of old texts alive
            base.base = None
            base.superseded = True
        return scan

    def _root(self, scan: Scan, base: Scan | None) -> None:
        """Keep ``scan`` among the latest roots, instead of ``base`` if that was one. Lock held."""
        roots = self._roots
        for i, r in enumerate(roots):
            if r is base:  # (identity: an equal text may be another conversation's)
                del roots[i]
                self._root_bytes -= r.weight
                break
        roots.insert(0, scan)
        self._root_bytes += scan.weight
        while roots and (len(roots) > _MEMO_ROOTS or self._root_bytes > self._memo_bytes // 4):
            self._root_bytes -= roots.pop().weight

    def _drop_line(self, root: Scan) -> None:
        """Forget the latest text of each line ``root`` started: a text that extends ``root`` and
        starts a line of its own has rewritten that line's history (Qwen3 drops the reasoning of
        the turns since the user's previous message), and its conversation goes on from the new
        text. Kept, the old line's latest text (and, through it, the root) stayed in the memo until
        its budget evicted it: ~16 texts per 40-turn conversation instead of ~3, the memory a
        fresh process grows by (on a VM that backs memory lazily, a host fault per new page; see
        bench/first_touch.py). Only a speed-up is lost if that text comes back (a retried turn: it is
        scanned again, or from a shared prefix), never ids. Lock held."""
        recent, roots = self._recent, self._recent_roots
        for k in range(len(roots) - 1, -1, -1):  # (in place, from the end: _keep holds the lists)
            if roots[k] is root:
                c = recent[k]
                self._bytes -= c.weight
                c.superseded = True
                del recent[k], roots[k]
        key = root.line_key
        if key is not None:
            root.line_key = None
            for c in [c for c in self._memo.get(key, ()) if c.root is root]:
                self._drop(key, c)
                c.superseded = True

    def _file_old(self, scan: Scan) -> None:
        """File a text that left the recent ones under its anchor (or forget it). Lock held."""
        key = self._file(scan, scan.text is not None)
        if key is None:
            self._bytes -= scan.weight
            return
        bucket = self._memo.setdefault(key, [])
        self._memo.move_to_end(key)
        bucket.insert(0, scan)
        scan.filed = key
        if scan.root is not None:
            scan.root.line_key = key
        for dropped in bucket[_MEMO_PER_KEY:]:
            self._bytes -= dropped.weight
            dropped.filed = None
        del bucket[_MEMO_PER_KEY:]

    def _drop(self, key: tuple[bool, int, int], scan: Scan) -> None:
        """Remove ``scan`` (the object) from the memo. Lock held."""
        bucket = self._memo.get(key)
        if bucket is None:
            return
        for i, e in enumerate(bucket):
            if e is scan:
                del bucket[i]
                self._bytes -= scan.weight
                scan.filed = None
                break
        if not bucket:
            del self._memo[key]
