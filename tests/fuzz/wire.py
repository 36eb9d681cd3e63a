"""Hypothesis strategies that build tokcache.v1 requests at the protobuf wire level.

The generated ``pb2`` classes refuse what an attacker can still send — invalid UTF-8 or
lone surrogates in string fields, wrong wire types, unknown fields, truncated messages —
so these strategies write the bytes themselves: a field is ``key(varint) + payload`` as
the protobuf encoding defines it, and every string payload is sometimes not UTF-8.
Messages follow proto/tokcache/v1/tokenizer.proto (field numbers below).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

VOCAB = 151_669  # Qwen3 with added tokens; the edge cases sit around it
ROLES = ["system", "user", "assistant", "tool", "developer", "", "x" * 300]
MODELS = ["qwen3"] * 12 + ["", "nope", "qwen3\x00", "Qwen3", "q" * 5000]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "<|im_"]


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_bytes(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def field_varint(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


# --- strings ----------------------------------------------------------------------------------

_lone = st.sampled_from([b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\xb0\x80x"])  # WTF-8 surrogates
_bad_utf8 = st.sampled_from([b"\xff", b"\xc3", b"\xc3\x28", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc0\xaf", b"\x00"])
_text = st.text(st.characters(codec="utf-8"), max_size=60).map(str.encode)
_specials = st.sampled_from(SPECIALS).map(str.encode)
_valid_piece = st.one_of(_text, _text, _specials, st.sampled_from([b"\n\n", b" ", b"\t", b"{}", b"\r\n"]))
_any_piece = st.one_of(_valid_piece, _lone, _bad_utf8)


@st.composite
def raw_string(draw: Any, max_pieces: int = 12) -> bytes:
    """Valid UTF-8 text with special tokens; one in eight has invalid bytes or a lone
    surrogate somewhere; one in forty is huge."""
    if draw(st.integers(0, 40)) == 0:
        huge: bytes = draw(st.sampled_from([b"a" * 300_000, "你好".encode() * 100_000, b"<|im_end|>" * 20_000]))
        return huge
    piece = _any_piece if draw(st.integers(0, 7)) == 0 else _valid_piece
    return b"".join(draw(st.lists(piece, max_size=max_pieces)))


def _nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for i in range(depth):
        value = {"k": [value, i]} if i % 2 else [value]
    return value


@st.composite
def json_text(draw: Any) -> bytes:
    """JSON-ish payloads: valid objects, deep nesting, escaped lone surrogates, garbage."""
    kind = draw(st.integers(0, 7))
    if kind == 0:
        depth: int = draw(st.sampled_from([10, 100, 500, 990, 5000, 100_000]))
        return ("[" * depth + "]" * depth).encode()
    if kind == 1:
        depth = draw(st.sampled_from([50, 200, 400]))
        return json.dumps({"a": _nested(depth, "x")}).encode()
    if kind == 2:
        return b'{"x": "\\ud800", "y": "\\udfff\\ud800", "z": ["\\ud83d"]}'
    if kind == 3:
        text: bytes = draw(raw_string())
        return text
    if kind == 4:
        return b'{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}'
    if kind == 5:
        return b'[{"type": "function", "function": {"name": "\\ud800", "description": 1e999}}]'
    if kind == 6:
        return json.dumps({"enable_thinking": draw(st.booleans()), "x": draw(st.integers())}).encode()
    odd: bytes = draw(st.sampled_from([b"", b"null", b"[]", b"{}", b"1", b'"s"', b"{", b'{"a":}', b"NaN"]))
    return odd


# --- messages ---------------------------------------------------------------------------------


def _maybe(draw: Any, number: int, strategy: Any) -> bytes:
    return field_bytes(number, draw(strategy)) if draw(st.booleans()) else b""


@st.composite
def tool_call(draw: Any) -> bytes:
    fn = _maybe(draw, 1, raw_string(3))
    which = draw(st.integers(0, 2))
    if which == 1:
        fn += field_bytes(2, draw(json_text()))
    elif which == 2:
        fn += field_bytes(3, draw(json_text()))
    return _maybe(draw, 1, raw_string(2)) + _maybe(draw, 2, st.sampled_from([b"function", b"", b"x"])) + (
        field_bytes(3, fn) if draw(st.booleans()) else b""
    )


@st.composite
def chat_message(draw: Any) -> bytes:
    out = field_bytes(1, draw(st.sampled_from(ROLES)).encode()) if draw(st.integers(0, 9)) else b""
    content = draw(st.integers(0, 3))
    if content == 1:
        out += field_bytes(2, draw(raw_string()))
    elif content == 2:
        kinds = st.sampled_from([b"text", b"image_url", b""])
        parts = b"".join(
            field_bytes(1, _maybe(draw, 1, kinds) + _maybe(draw, 2, raw_string()))
            for _ in range(draw(st.integers(0, 4)))
        )
        out += field_bytes(3, parts)
    for number in (4, 6, 7):
        out += _maybe(draw, number, raw_string(4)) if draw(st.integers(0, 3)) == 0 else b""
    for _ in range(draw(st.integers(0, 2))):
        out += field_bytes(5, draw(tool_call()))
    if draw(st.integers(0, 4)) == 0:
        out += field_bytes(8, draw(json_text()))
    return out


MAX_CHAT_BYTES = 8 << 20  # keeps the generator's own memory small (the server limit is 4 MiB)


@st.composite
def chat_input(draw: Any) -> bytes:
    n = draw(st.sampled_from([0, 1, 1, 2, 3, 5, 8, 51, 2000]))
    out: bytes
    if n > 8:
        # Many messages: one drawn message repeated. Drawing each would make one example
        # thousands of choices, and Hypothesis keeps every choice of a run in memory.
        message = field_bytes(1, draw(chat_message()))
        out = message * min(n, max(1, MAX_CHAT_BYTES // max(1, len(message))))
    else:
        out = b"".join(field_bytes(1, draw(chat_message())) for _ in range(n))
    if draw(st.integers(0, 3)) == 0:
        out += field_bytes(2, draw(json_text()))
    out += field_varint(3, draw(st.integers(0, 2)))
    if draw(st.integers(0, 4)) == 0:
        out += field_varint(4, 1)
    if draw(st.integers(0, 3)) == 0:
        out += field_bytes(5, draw(json_text()))
    return out


def _noise(draw: Any, message: bytes) -> bytes:
    """Sometimes corrupt a well-formed message: unknown fields, wrong wire types, truncation."""
    r = draw(st.integers(0, 19))
    if r == 0:
        return message + field_varint(draw(st.integers(11, 5000)), draw(st.integers(0, 2**64 - 1)))
    if r == 1:
        return message + field_varint(2, 7)  # a varint where a string belongs
    if r == 2 and message:
        return message[: draw(st.integers(0, len(message) - 1))]
    if r == 3:
        return message + varint(1 << 3 | 2) + varint(1 << 40)  # a length far past the end
    return message


@st.composite
def tokenize_request(draw: Any) -> bytes:
    out = field_bytes(1, draw(st.sampled_from(MODELS)).encode())
    which = draw(st.integers(0, 3))
    if which in (1, 3):
        out += field_bytes(2, draw(raw_string()))
    if which in (2, 3):
        out += field_bytes(3, draw(chat_input()))
    if draw(st.booleans()):
        out += field_varint(4, draw(st.integers(0, 2)))
    if draw(st.integers(0, 3)) == 0:
        out += field_bytes(5, draw(raw_string(3)))
    if draw(st.booleans()):
        out += field_varint(6, draw(st.sampled_from([0, 1, 2, 3, 99, 2**31, 2**64 - 1])))
    if draw(st.booleans()):
        out += field_varint(7, 1)
    return _noise(draw, out)


@st.composite
def render_request(draw: Any) -> bytes:
    return _noise(draw, field_bytes(1, draw(st.sampled_from(MODELS)).encode()) + _maybe(draw, 2, chat_input()))


_edge_ids = st.sampled_from([0, 1, VOCAB - 2, VOCAB - 1, VOCAB, VOCAB + 1, 151_643, 151_645, 2**31, 2**32 - 1])


@st.composite
def token_ids(draw: Any) -> bytes:
    r = draw(st.integers(0, 6))
    if r == 0:
        odd: bytes = draw(st.binary(max_size=41))  # often not a multiple of 4
        return odd
    if r == 1:
        count: int = draw(st.sampled_from([4, 4 * 100_000]))
        return b"\xff" * count
    ids = draw(st.lists(st.one_of(_edge_ids, st.integers(0, VOCAB + 10)), max_size=64))
    return b"".join(i.to_bytes(4, "little") for i in ids)


@st.composite
def record_output_request(draw: Any) -> bytes:
    out = field_bytes(1, draw(st.sampled_from(MODELS)).encode())
    out += _maybe(draw, 2, raw_string(3))
    out += _maybe(draw, 3, raw_string())
    out += _maybe(draw, 4, token_ids())
    out += _maybe(draw, 5, raw_string())
    out += _maybe(draw, 6, token_ids())
    out += _maybe(draw, 7, st.sampled_from([b"stop", b"length", b"abort", b"", b"\xff"]))
    stop = draw(st.integers(0, 2))
    if stop == 1:
        out += field_varint(8, draw(_edge_ids))
    elif stop == 2:
        out += field_bytes(9, draw(raw_string(3)))
    if draw(st.booleans()):
        out += field_varint(10, draw(st.integers(0, 2)))
    return _noise(draw, out)
