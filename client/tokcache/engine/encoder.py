"""Encoding backends behind the cache, and the exactness gate that picks one.

The reference is HF ``tokenizers`` (what ``transformers`` and vLLM use).
``fastokens`` is a much faster re-implementation; it is only used for a
tokenizer after it reproduces the reference on the exactness suite below,
and among the backends that pass, the fastest on a chat-sized probe wins.

All encoders here return *raw* ids: no post-processor special tokens
(BOS/EOS). Special tokens requested with ``add_special_tokens`` are applied by
:mod:`tokcache.engine.affixes`, so cached entries are independent of the flag.
"""

from __future__ import annotations

import logging
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import tokenizers

log = logging.getLogger(__name__)

__all__ = [
    "EXACTNESS_PROBES",
    "Encoder",
    "EncoderChoice",
    "FastokensEncoder",
    "TokenizersEncoder",
    "choose_encoder",
    "load_encoder",
]


class Encoder(Protocol):
    """Text → raw token ids. Implementations are thread-safe."""

    name: str
    # True when the encoder hands out one int object per id value, the same on every call
    # (fastokens keeps one per vocabulary id): its lists need no interning (IdFormat.own),
    # which would replace each int by itself. Probed at load, never assumed from the name.
    shared_ints: bool

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without post-processor special tokens."""
        ...

    def encode_full(self, text: str) -> list[int]:
        """Ids of ``text`` with post-processor special tokens (BOS/EOS)."""
        ...

    def encode_pieces(self, texts: Sequence[str]) -> tuple[list[int], list[int]]:
        """Raw ids of each text, concatenated, and the cumulative token count after each
        text (``len(texts)`` ints)."""
        ...

    def encode_segments(self, texts: Sequence[str]) -> tuple[bytes, list[int]]:
        """:meth:`encode_pieces` with the ids as little-endian uint32 bytes."""
        ...


# Letters, digits, punctuation, whitespace runs, code, non-ASCII and chat-template markup.
_WARM_UP = ("Hello, world! It's 2026-11-23 12:34:56.\n\n  def f(x):\n\treturn x ** 2  # 你好，世界 🛠️ naïve "
            "café <|im_start|>user\n<|im_end|> <think></think> [INST] <|begin_of_text|>\r\n")


class _HfStyleEncoder:
    """Shared by both backends: same Tokenizer-like API (``encode(text, add_special_tokens)``)."""

    name = ""
    tokenizer: Any
    shared_ints = False

    def _setup(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # The sidecar serves whole prompts; truncation/padding from the file
        # would silently change ids, so they are switched off (vLLM does too).
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        # Native encoders initialise parts of themselves on first use (fastokens: 50-300 ms
        # for the first chat text on a busy node): pay it here, at load, not in the first
        # request a process serves.
        first = self.tokenizer.encode(_WARM_UP, add_special_tokens=False).ids
        self.shared_ints = _same_objects(first, self.tokenizer.encode(_WARM_UP, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids  # a new list per call
        return ids

    def encode_full(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=True).ids
        return ids

    def encode_pieces(self, texts: Sequence[str]) -> tuple[list[int], list[int]]:
        # One sequential call per piece, not the batch APIs: those run on a thread pool
        # whose workers sleep between requests, and waking them costs 30-1500 µs on a
        # busy node, against ~5 µs for the handful of short pieces of a
        # conversation's new tail.
        enc = self.tokenizer.encode
        out: list[int] = []
        ends: list[int] = []
        for text in texts:
            if text:
                out += enc(text, add_special_tokens=False).ids
            ends.append(len(out))
        return out, ends

    def encode_segments(self, texts: Sequence[str]) -> tuple[bytes, list[int]]:
        ids, ends = self.encode_pieces(texts)
        return _le(array("I", ids)), ends


def _same_objects(a: list[int], b: list[int]) -> bool:
    """True when two encodings of one text hold the same int objects for every id that
    CPython does not cache itself (-5..256 are always shared, so they prove nothing)."""
    big = [i for i, x in enumerate(a) if x > 256]
    return bool(big) and len(a) == len(b) and all(a[i] is b[i] for i in big)


class TokenizersEncoder(_HfStyleEncoder):
    """The reference: HF ``tokenizers``."""

    name = "tokenizers"

    def __init__(self, path: Path) -> None:
        self._setup(tokenizers.Tokenizer.from_file(str(path)))


class FastokensEncoder(_HfStyleEncoder):
    """``fastokens`` (Rust BPE with PCRE2), about 100x faster than the reference here."""

    name = "fastokens"

    def __init__(self, path: Path) -> None:
        import fastokens  # optional at import time: only needed when chosen

        tokenizer = fastokens.Tokenizer.from_file(str(path))
        # fastokens turns its segment cache on from FASTOKENS_SEGMENT_CACHE at construction (what
        # a user of vLLM's VLLM_USE_FASTOKENS=1 sets). Off here, whatever the environment: the cache in front
        # of this encoder already holds every text seen, so the segments it is asked for are new
        # by construction, and caching them made a 1.5 KB tail's encode 1.5-1.9x as slow and grew
        # every process's memory by ~1.5 KB per call up to the variable's MiB.
        if hasattr(tokenizer, "enable_segment_cache"):
            tokenizer.enable_segment_cache(0)
        self._setup(tokenizer)


def _le(ids: array[int]) -> bytes:
    """Pack as little-endian uint32 (the wire and shm format)."""
    if sys.byteorder != "little":
        ids = array("I", ids)
        ids.byteswap()
    return ids.tobytes()


# Strings that have broken BPE re-implementations before: whitespace runs of
# every kind, newline clusters, digits, contractions, CJK, emoji and ZWJ
# sequences, combining marks (NFC), code, JSON, and text that looks like (or
# is) an added token. Each is also tried embedded in ChatML/Llama framing.
EXACTNESS_PROBES: tuple[str, ...] = (
    "",
    " ",
    "  ",
    "\n",
    "\n\n",
    " \n \n\n  \t\t\n",
    "hello world",
    " leading space",
    "trailing space ",
    "I'm you're we've they'll she'd IT'S",
    "1234567890 3.14159 1e-9 0x1F 100,000",
    "def f(x):\n    if x:\n        return [x, {'a': 1}]\n\n\n    return None\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2, 3]}}',
    "你好，世界！这是一个测试。日本語のテキストです。한국어 텍스트",
    "emoji 🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "e\u0301 vs \u00e9, A\u030a, \u1e9b\u0323",
    "tabs\tand\u00a0nbsp\u2003em\u3000ideographic",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<think>\nreasoning\n</think>\n\nanswer",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "<|im_end|<|im_end||im_end|><|eot_id|<|notatoken|>",
    "    indented\n\t\ttabs\n\n\n\n\nmany newlines",
    "mixed ünïcödé ÀÉÎÕÜ ßſ ﬁ ligature",
    "a" * 300,
    " " * 257 + "x",
    "\r\n\r\nwindows\r\nlines\r",
    "$$\\frac{a}{b}$$ `code` **bold** ~~strike~~ > quote",
    "🙂" * 40,
    "x\u200by\u200dz\ufeff",
)


def _suite(probes: Sequence[str]) -> list[str]:
    texts = list(probes)
    texts.append("".join(probes))
    texts.extend(f"<|im_start|>user\n{p}<|im_end|>\n" for p in probes[:12])
    return texts


@dataclass(frozen=True)
class EncoderChoice:
    """The encoder a model uses, and why."""

    encoder: Encoder
    reference: TokenizersEncoder
    passed: tuple[str, ...]
    failed: tuple[str, ...]
    timings_us: dict[str, float]


def _time_us(fn: Callable[[str], list[int]], text: str, rounds: int = 5) -> float:
    fn(text)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(text)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def load_encoder(name: str, path: Path) -> Encoder:
    """The backend called ``name`` ("fastokens" or "tokenizers") for ``path``, unchecked.

    For a reader that uses the backend the sidecar proved exact for this same file with
    this same backend version. ValueError for an unknown name.
    """
    if name == "tokenizers":
        return TokenizersEncoder(path)
    if name == "fastokens":
        return FastokensEncoder(path)
    raise ValueError(f"unknown encoder backend {name!r}")


def choose_encoder(path: Path, *, allow: Sequence[str] = ("fastokens", "tokenizers")) -> EncoderChoice:
    """Build the candidate backends for ``path`` (a tokenizer.json) and pick one.

    A candidate must reproduce the reference on every probe, with and without
    special tokens; the fastest passing one wins. The reference always passes,
    so this never fails for a loadable tokenizer. Runs once per model at load.
    """
    reference = TokenizersEncoder(path)
    suite = _suite(EXACTNESS_PROBES)
    expected = [(reference.encode(t), reference.encode_full(t)) for t in suite]
    candidates: list[Encoder] = []
    failed: list[str] = []
    for name in allow:
        if name == "tokenizers":
            candidates.append(reference)
            continue
        if name != "fastokens":
            raise ValueError(f"unknown encoder backend {name!r}")
        try:
            cand: Encoder = FastokensEncoder(path)
        except Exception as exc:  # a backend that cannot load is just not used
            log.warning("encoder fastokens unavailable for %s: %s", path, exc)
            failed.append(name)
            continue
        bad = [t for t, (raw, full) in zip(suite, expected, strict=True)
               if cand.encode(t) != raw or cand.encode_full(t) != full]
        flat, ends = cand.encode_segments(suite)
        want = [i for raw, _ in expected for i in raw]
        if flat != _le(array("I", want)) or ends[-1:] != [len(want)]:
            bad.append("<encode_segments>")
        if bad:
            log.warning("encoder fastokens is not exact for %s on %d probes (first %r); not used",
                        path, len(bad), bad[0][:60])
            failed.append(name)
            continue
        candidates.append(cand)
    timing_text = "".join(suite) * 4
    timings = {c.name: _time_us(c.encode, timing_text) for c in candidates}
    best = min(candidates, key=lambda c: timings[c.name])
    return EncoderChoice(
        encoder=best,
        reference=reference,
        passed=tuple(c.name for c in candidates),
        failed=tuple(failed),
        timings_us=timings,
    )
