"""Emulate the token ids an autoregressive model generates for a known answer text.

A model samples one token at a time, and nothing makes it pick BPE's canonical segmentation:
it emits ``"\\n\\n"`` as ``[198, 198]`` where BPE has ``[271]``, an indentation run as two half
runs, a number digit by digit, a rare word in two pieces. Re-encoding the text then gives other
ids than the ones the engine holds KV for.

:class:`AREmulator` starts from the canonical ids of ``text`` and, independently per canonical
token, rewrites it with probability ``p_i`` into a *valid non-canonical segmentation*: pieces
that are all vocabulary tokens and whose bytes concatenate to the original token's bytes. Kinds:

- ``split``: one token into two vocabulary pieces at a random byte cut
  (``"\\n\\n"`` -> ``"\\n" "\\n"``, ``"    "`` -> ``"  " "  "``, ``"123"`` -> ``"1" "23"``,
  ``"hello"`` -> ``"hel" "lo"``); when no two-piece cut exists, the token is split into its
  single bytes (always valid for byte-level BPE: all 256 bytes are tokens);
- ``recut``: the token and its right neighbour re-cut at another byte position
  (``"ab" "c"`` -> ``"a" "bc"``), when both new pieces are in the vocabulary.

``p_i = min(1, rate * N * w_i / W)`` over the ``N`` canonical tokens, where ``w_i`` weighs
whitespace/newline runs and digit tokens above other tokens (a model's usual deviations),
unsplittable tokens (one byte, added/special tokens) weigh 0 and ``W`` is the total weight; so
the expected number of rewritten tokens is ``rate * N`` and the achieved rate
(``Emulated.achieved_rate``: rewritten canonical tokens / canonical tokens, a re-cut counting
its two) is reported. The per-token draws come first and do not depend on ``rate``, so with the
same seed a higher rate selects a superset of the tokens a lower one selects.

Byte-level BPE only (Qwen2/3, Llama 3, GPT-2 family): a token's bytes come from its vocabulary
string through GPT-2's byte<->unicode table. Every result is checked:
``decode(ids without EOS, skip_special_tokens=False) == text``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from tokcache.engine.tokenbytes import bytes_to_unicode

__all__ = ["AREmulator", "Emulated", "bytes_to_unicode"]

DEFAULT_WEIGHTS = {"whitespace": 4.0, "digit": 3.0, "multibyte": 1.0, "word": 1.0, "other": 1.0}
RECUT_SHARE = 0.2  # share of rewrites attempted as a re-cut with the next token


@dataclass(frozen=True)
class Emulated:
    """Generated ids for one answer."""

    ids: list[int]                  # what the model emitted, EOS last if one was asked for
    canonical: list[int]            # encode(text)
    rate_target: float
    rewritten: int                  # canonical tokens rewritten (a recut counts its 2 tokens)
    by_kind: dict[str, int] = field(default_factory=dict)  # rewrite events by token kind / op
    eos_id: int | None = None

    @property
    def achieved_rate(self) -> float:
        return self.rewritten / len(self.canonical) if self.canonical else 0.0

    @property
    def answer_ids(self) -> list[int]:
        """The ids without the trailing EOS."""
        return self.ids[:-1] if self.eos_id is not None and self.ids and self.ids[-1] == self.eos_id else self.ids

    @property
    def differs(self) -> bool:
        return self.answer_ids != self.canonical


def _seed_int(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


class AREmulator:
    """Non-canonical, decode-exact id sequences for answer texts (byte-level BPE tokenizers)."""

    def __init__(self, tokenizer: Tokenizer, *, eos_id: int | None = None,
                 weights: dict[str, float] | None = None) -> None:
        self.tok = tokenizer
        self.eos_id = eos_id
        self.weights = {**DEFAULT_WEIGHTS, **(weights or {})}
        spec = json.loads(tokenizer.to_str())
        decoder = spec.get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            raise ValueError(f"only byte-level BPE tokenizers are supported (decoder {decoder.get('type')!r})")
        vocab: dict[str, int] = spec["model"]["vocab"]
        added = {int(a["id"]) for a in spec.get("added_tokens", [])}
        u2b = {u: b for b, u in bytes_to_unicode().items()}
        self._id_bytes: dict[int, bytes] = {}
        self._bytes_id: dict[bytes, int] = {}
        for s, i in vocab.items():
            if i in added:
                continue
            try:
                bs = bytes(u2b[c] for c in s)
            except KeyError:  # not a byte-level string: leave the token alone
                continue
            self._id_bytes[i] = bs
            self._bytes_id.setdefault(bs, i)
        self._added = added

    @classmethod
    def from_file(cls, path: str | Path, **kw: object) -> AREmulator:
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        return cls(Tokenizer.from_file(str(p)), **kw)  # type: ignore[arg-type]

    # -- token classification -------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes | None:
        return self._id_bytes.get(token_id)

    def kind(self, token_id: int) -> str:
        bs = self._id_bytes.get(token_id)
        if bs is None:
            return "special"
        if bs.isspace():
            return "whitespace"
        if bs.isdigit():
            return "digit"
        if any(b >= 0x80 for b in bs):
            return "multibyte"
        if bs.strip().isalpha():
            return "word"
        return "other"

    def _splits(self, bs: bytes) -> list[list[int]]:
        """Two-piece vocabulary splits of ``bs``."""
        out = []
        for cut in range(1, len(bs)):
            a, b = self._bytes_id.get(bs[:cut]), self._bytes_id.get(bs[cut:])
            if a is not None and b is not None:
                out.append([a, b])
        return out

    def _recuts(self, left: bytes, right: bytes) -> list[list[int]]:
        both = left + right
        out = []
        for cut in range(1, len(both)):
            if cut == len(left):
                continue
            a, b = self._bytes_id.get(both[:cut]), self._bytes_id.get(both[cut:])
            if a is not None and b is not None:
                out.append([a, b])
        return out

    def _byte_split(self, bs: bytes) -> list[int]:
        return [self._bytes_id[bytes([b])] for b in bs]

    # -- emulation ------------------------------------------------------------------------

    def canonical(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def emulate(self, text: str, rate: float, seed: object = 0, *, eos: bool = True) -> Emulated:
        """Ids that decode to ``text`` and differ from ``encode(text)`` at about ``rate`` per token."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError("rate must be in [0, 1]")
        canon = self.canonical(text)
        if self.tok.decode(canon, skip_special_tokens=False) != text:
            raise ValueError("text does not round-trip through the tokenizer (not NFC?)")
        n = len(canon)
        draw = random.Random(_seed_int("draw", seed, text))
        pick = random.Random(_seed_int("pick", seed, text, rate))
        u = [draw.random() for _ in range(n)]
        kinds = [self.kind(i) for i in canon]
        w = [0.0 if (k == "special" or len(self._id_bytes[i]) < 2) else self.weights[k]
             for i, k in zip(canon, kinds, strict=True)]
        total = sum(w)
        out: list[int] = []
        rewritten = 0
        by_kind: Counter[str] = Counter()
        i = 0
        while i < n:
            tid = canon[i]
            p = min(1.0, rate * n * w[i] / total) if total and rate else 0.0
            if u[i] >= p:
                out.append(tid)
                i += 1
                continue
            bs = self._id_bytes[tid]
            if i + 1 < n and canon[i + 1] in self._id_bytes and pick.random() < RECUT_SHARE:
                recuts = self._recuts(bs, self._id_bytes[canon[i + 1]])
                if recuts:
                    out.extend(pick.choice(recuts))
                    rewritten += 2
                    by_kind[f"recut:{kinds[i]}"] += 1
                    i += 2
                    continue
            splits = self._splits(bs)
            out.extend(pick.choice(splits) if splits else self._byte_split(bs))
            rewritten += 1
            by_kind[f"split:{kinds[i]}"] += 1
            i += 1
        got = self.tok.decode(out, skip_special_tokens=False)
        assert got == text, f"emulated ids do not decode to the text: {got!r} != {text!r}"
        ids = out + ([self.eos_id] if eos and self.eos_id is not None else [])
        if eos and self.eos_id is not None:
            eos_text = self.tok.decode([self.eos_id], skip_special_tokens=False)
            assert self.tok.decode(ids, skip_special_tokens=False) == text + eos_text
            # Decoding as a server does drops the EOS, and with it any special token the text
            # holds as its own (a text "<|im_end|>" encodes to that token): checked where none.
            if self.tok.decode(canon, skip_special_tokens=True) == text:
                assert self.tok.decode(ids, skip_special_tokens=True) == text
        return Emulated(ids=ids, canonical=canon, rate_target=rate, rewritten=rewritten,
                        by_kind=dict(by_kind), eos_id=self.eos_id if eos else None)

    def check(self, ids: Sequence[int], text: str) -> bool:
        return self.tok.decode(list(ids), skip_special_tokens=False) == text
