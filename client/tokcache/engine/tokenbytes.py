"""The UTF-8 bytes each token stands for: exact decode checks and token boundaries in text.

Recording a model output checks ``decode(ids) == text`` and keys the output where its byte
offsets fall between tokens (the content after ``</think>``, trimmed variants). For
byte-level BPE (GPT-2 style: Qwen, Llama 3, most current models) HF ``tokenizers`` decodes a
sequence as the concatenation of each token's bytes, made by its ``ByteLevel`` decoder: a
token whose every character is in GPT-2's byte <-> unicode table maps character by character
to bytes, any other token (an added token with a space in it) is its own UTF-8; the result
is read as UTF-8 with replacement. This module builds that table once, so a decode check is
one pass over the ids (in C when the engine extension is built) and a byte compare, and the
offsets of token boundaries come from the same pass. Other tokenizers get no table: the
caller decodes with ``tokenizers``.
"""

from __future__ import annotations

import json
from array import array
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokcache import native

__all__ = ["TokenBytes", "bytes_to_unicode"]

_native: Any = native.engine()


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


def _decoded(token: str, inverse: dict[str, int]) -> bytes:
    """The bytes the ``ByteLevel`` decoder makes of one token string (see the module docstring)."""
    try:
        return bytes(inverse[ch] for ch in token)
    except KeyError:
        return token.encode("utf-8")


class TokenBytes:
    """id -> bytes for a byte-level BPE tokenizer, as one blob and a table of offsets.

    ``blob[starts[i]:starts[i + 1]]`` are token ``i``'s bytes; an id without a token (a hole
    in the vocabulary) has none, and a sequence holding it has no bytes here (None): the
    caller decodes with the reference instead.
    """

    def __init__(self, table: dict[int, bytes]) -> None:
        size = max(table, default=-1) + 1
        starts = array("I", bytes(4 * (size + 1)))
        present = bytearray(size)
        parts: list[bytes] = []
        pos = 0
        for i in range(size):
            starts[i] = pos
            b = table.get(i)
            if b is not None:
                parts.append(b)
                pos += len(b)
                present[i] = 1
        starts[size] = pos
        self._blob = b"".join(parts)
        self._starts = starts
        self._present = bytes(present)
        self._table = table

    @classmethod
    def from_tokenizer_json(cls, path: Path) -> TokenBytes | None:
        """The table, or None when the tokenizer is not byte-level BPE (its decoder is not
        ``ByteLevel`` alone, or its model is not BPE)."""
        data = json.loads(path.read_text(encoding="utf-8"))
        decoder = data.get("decoder") or {}
        model = data.get("model") or {}
        if decoder.get("type") != "ByteLevel" or model.get("type") != "BPE":
            return None
        inverse = {c: b for b, c in bytes_to_unicode().items()}
        table: dict[int, bytes] = {}
        for token, idx in (model.get("vocab") or {}).items():
            if not all(ch in inverse for ch in token):
                return None  # not a byte-level vocabulary after all
            table[int(idx)] = bytes(inverse[ch] for ch in token)
        for added in data.get("added_tokens") or []:
            table[int(added["id"])] = _decoded(str(added["content"]), inverse)
        return cls(table)

    def join(self, ids: list[int]) -> bytes | None:
        """The bytes of ``ids`` (what ``decode`` spells before reading it as UTF-8), or None
        when an id has no token here."""
        if _native is not None:
            return _native.token_bytes(self._blob, self._starts, self._present, ids, False)  # type: ignore[no-any-return]
        table = self._table
        try:
            return b"".join([table[i] for i in ids])
        except (KeyError, TypeError):
            return None

    def decodes_to(self, ids: list[int], data: bytes) -> bool | None:
        """Whether ``decode(ids, skip_special_tokens=False)`` is the UTF-8 text ``data``: True or
        False, or None when this table cannot tell (an id without a token)."""
        got = self.join(ids)
        if got is None:
            return None
        if got == data:
            return True
        # Ids that spell invalid UTF-8 (a multi-byte character cut, or bytes in no valid
        # order: what a sampled model can emit) decode as tokenizers decodes them: each
        # maximal invalid subpart becomes U+FFFD, as the text a server returns has it.
        try:
            got.decode("utf-8")
        except UnicodeDecodeError:
            return got.decode("utf-8", "replace").encode("utf-8", "surrogatepass") == data
        return False

    def packed_offsets(self, ids: list[int]) -> bytes | None:
        """:meth:`offsets` as packed LE uint32, from the C extension (None without it, or if
        an id has no token)."""
        if _native is None:
            return None
        return _native.token_bytes(self._blob, self._starts, self._present, ids, True)  # type: ignore[no-any-return]

    def offsets(self, ids: list[int]) -> list[int] | None:
        """Cumulative byte offsets after each token (None if an id has no token)."""
        if _native is not None:
            raw = _native.token_bytes(self._blob, self._starts, self._present, ids, True)
            return None if raw is None else array("I", raw).tolist()
        table = self._table
        out: list[int] = []
        pos = 0
        try:
            for i in ids:
                pos += len(table[i])
                out.append(pos)
        except (KeyError, TypeError):
            return None
        return out
