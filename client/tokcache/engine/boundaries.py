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
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokcache.engine.encoder import Encoder

log = logging.getLogger(__name__)

__all__ = ["BoundaryCheck", "BoundaryScanner", "Scan", "added_tokens", "check_boundaries"]

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


@functools.lru_cache(maxsize=8)
def _added_tokens_cached(path: str, _mtime_ns: int, _size: int) -> list[dict[str, object]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    tokens = data.get("added_tokens") or []
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


@dataclass(frozen=True, slots=True)
class Scan:
    """A scanned text: every added-token match (start, end, is_boundary), the boundary spans,
    and the text it extended (``base_len`` bytes, 0: none). Shared: never mutate the lists.

    ``hashers`` lets a reader keep, per key namespace, a hash state at some offset of this
    text, so the next text that extends it hashes only what it appended (see ``TextKeys``).
    """

    data: bytes
    matches: list[tuple[int, int, bool]]
    spans: list[tuple[int, int]]
    base_len: int = 0
    hashers: dict[bytes, tuple[int, object]] = field(default_factory=dict)
    base: Scan | None = None

# Scan memo: texts remembered per process, grouped by a hash of their first bytes.
_MEMO_TEXTS = 256
_MEMO_HEAD = 256
_MEMO_PER_HEAD = 4


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
                 memo_texts: int = _MEMO_TEXTS) -> None:
        self._boundaries = frozenset(t.encode("utf-8") for t in boundary_tokens)
        words = {t.encode("utf-8") for t in all_added if t}
        self._pattern: re.Pattern[bytes] | None = _trie_pattern(words) if self._boundaries else None
        self._maxlen = max((len(w) for w in words), default=1)
        # Recent texts and their matches, by a hash of their first bytes: a
        # growing conversation rescans only what it appended. Guarded by _lock
        # (the memo is shared by the threads of a process).
        self._memo: OrderedDict[int, list[Scan]] = OrderedDict()
        self._memo_texts = memo_texts
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer_json: Path, check: BoundaryCheck) -> BoundaryScanner:
        added = [str(t["content"]) for t in added_tokens(tokenizer_json) if not t.get("normalized")]
        return cls(added, check.boundary_tokens)

    @property
    def enabled(self) -> bool:
        return self._pattern is not None

    def cuts(self, data: bytes) -> list[int]:
        """Offsets in ``data`` right after each boundary token, ascending."""
        return [end for _, end in self.spans(data)]

    def _scan(self, data: bytes, pos: int) -> list[tuple[int, int, bool]]:
        assert self._pattern is not None
        boundaries = self._boundaries
        return [(m.start(), m.end(), m.group() in boundaries) for m in self._pattern.finditer(data, pos)]

    def spans(self, data: bytes) -> list[tuple[int, int]]:
        """(start, end) offsets of each boundary token in ``data``, ascending (== a full scan)."""
        return self.spans_and_base(data)[0]

    def spans_and_base(self, data: bytes) -> tuple[list[tuple[int, int]], int]:
        """(boundary spans of ``data`` (a copy), length of the recent text it extends, or 0)."""
        scan = self.scan(data)
        return list(scan.spans), scan.base_len

    def scan(self, data: bytes) -> Scan:
        """The boundary spans of ``data`` (== a full scan), and what it extends.

        When a recent text is a prefix of ``data``, its matches are reused up to
        ``maxlen - 1`` bytes before its end (no added token starting earlier can
        reach past it) and only the rest is scanned. The result is shared with the
        memo: read-only.
        """
        if self._pattern is None:
            return Scan(data, [], [])
        head = hash(data[:_MEMO_HEAD])
        base: Scan | None = None
        with self._lock:
            for cand in self._memo.get(head, ()):
                if len(cand.data) <= len(data) and (base is None or len(cand.data) > len(base.data)) \
                        and data.startswith(cand.data):
                    base = cand
        if base is None:
            matches = self._scan(data, 0)
            spans = [(a, b) for a, b, is_boundary in matches if is_boundary]
            base_len = 0
        else:
            limit = len(base.data) - self._maxlen + 1
            n_kept = bisect_left(base.matches, (limit,))
            n_spans = bisect_left(base.spans, (limit,))
            kept = base.matches[:n_kept]
            new = self._scan(data, max(limit, kept[-1][1] if kept else 0, 0))
            matches = kept + new
            spans = base.spans[:n_spans] + [(a, b) for a, b, is_boundary in new if is_boundary]
            base_len = len(base.data)
        scan = Scan(data, matches, spans, base_len, base=base)
        with self._lock:
            entries = self._memo.setdefault(head, [])
            self._memo.move_to_end(head)
            same = next((e for e in entries if len(e.data) == len(data) and e.data == data), None)
            if same is not None:
                return same
            entries.append(scan)
            del entries[:-_MEMO_PER_HEAD]
            while len(self._memo) > self._memo_texts:
                self._memo.popitem(last=False)
        if base is not None:  # one level is all a reader uses: do not keep a chain of old texts alive
            object.__setattr__(base, "base", None)
        return scan
