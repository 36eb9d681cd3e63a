"""The UTF-8 bytes each token stands for, to find token boundaries in text.

Recording a model output under several keys (the whole output, the content
after ``</think>``, trimmed variants) needs the token index at which a byte
offset of the output text falls — if it falls between tokens at all. For
byte-level BPE (GPT-2 style: Qwen, Llama 3, most current models) a token's
bytes are its vocabulary string mapped back through the byte↔unicode table,
and added tokens are their content; the bytes of a sequence are the
concatenation. Other tokenizers get no table, and only whole-output keys.
"""

from __future__ import annotations

import json
from functools import lru_cache
from itertools import accumulate
from pathlib import Path

__all__ = ["TokenBytes", "bytes_to_unicode"]


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable bytes map to themselves,
    the rest to code points from 256 upwards, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    codes = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            codes.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, codes, strict=True)}


def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


class TokenBytes:
    """id → bytes for a byte-level BPE tokenizer."""

    def __init__(self, table: dict[int, bytes]) -> None:
        self._table = table

    @classmethod
    def from_tokenizer_json(cls, path: Path) -> TokenBytes | None:
        """The table, or None when the tokenizer is not byte-level BPE."""
        data = json.loads(path.read_text(encoding="utf-8"))
        decoder = data.get("decoder") or {}
        model = data.get("model") or {}
        if decoder.get("type") != "ByteLevel" or model.get("type") != "BPE":
            return None
        inverse = _unicode_to_byte()
        table: dict[int, bytes] = {}
        for token, idx in (model.get("vocab") or {}).items():
            try:
                table[int(idx)] = bytes(inverse[ch] for ch in token)
            except KeyError:
                return None  # not a byte-level vocabulary after all
        for added in data.get("added_tokens") or []:
            table[int(added["id"])] = str(added["content"]).encode("utf-8")
        return cls(table)

    def offsets(self, ids: list[int]) -> list[int] | None:
        """Cumulative byte offsets after each token (None if an id is unknown)."""
        try:
            return list(accumulate(len(self._table[i]) for i in ids))
        except KeyError:
            return None

    def join(self, ids: list[int]) -> bytes:
        """The bytes of ``ids`` (for checks; KeyError on an unknown id)."""
        return b"".join(self._table[i] for i in ids)
