"""The C helpers of recording an output (``tokcache.engine._speedups``: ``token_bytes``,
``equal_ids``) against their Python references, and the byte table against ``tokenizers``.

``token_bytes`` decides whether a recorded output's ids spell its text (a wrong answer
stores ids that do not decode to the text, or refuses a good record) and where the output's
token boundaries fall (its segment keys); ``equal_ids`` decides whether a record's prompt ids
are the ones a read served (a wrong True chains the output to ids the caller never had).
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcache.engine import record as record_mod
from tokcache.engine import tokenbytes as tokenbytes_mod
from tokcache.engine.ids import LISTS, Chunks, joined
from tokcache.engine.record import Served
from tokcache.engine.tokenbytes import TokenBytes
from tokcache.native import pure_python
from tokcache.sidecar.bundled import qwen3_dir

pytestmark = pytest.mark.skipif(pure_python(), reason="TOKCACHE_PURE_PYTHON=1: no native helpers")

_native: Any = tokenbytes_mod._native


@pytest.fixture(scope="module", params=["qwen3", "llama32"])
def vocab(request: pytest.FixtureRequest) -> tuple[TokenBytes, tokenizers.Tokenizer]:
    path = Path(request.getfixturevalue(f"{request.param}_path")) / "tokenizer.json"
    table = TokenBytes.from_tokenizer_json(path)
    assert table is not None  # both are byte-level BPE
    return table, tokenizers.Tokenizer.from_file(str(path))


def _python(table: TokenBytes, ids: list[int], monkeypatch: pytest.MonkeyPatch) -> tuple[bytes | None,
                                                                                         list[int] | None]:
    """(join, offsets) by the Python reference."""
    monkeypatch.setattr(tokenbytes_mod, "_native", None)
    try:
        return table.join(ids), table.offsets(ids)
    finally:
        monkeypatch.setattr(tokenbytes_mod, "_native", _native)


def test_token_bytes_equal_the_python_table_and_tokenizers_decode(vocab: tuple[TokenBytes, tokenizers.Tokenizer],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Random id lists of the real vocabularies (added tokens included): the C join and offsets
    are the Python table's, the offsets are the cumulative token lengths ending at the join's
    length, and ``tokenizers``' decode is the join read as UTF-8 with replacement (what makes
    the table a decode check). An id without a token anywhere in the list makes both None."""
    table, ref = vocab
    size = len(table._present)
    rng = random.Random(f"token-bytes-{size}")
    unknown = (size, size + 1, size + 10_000, 1 << 24, (1 << 30) - 1, 1 << 30, 1 << 40, -1, -(1 << 40))
    nones = 0
    for trial in range(600):
        ids = [rng.randrange(size) for _ in range(rng.randint(0, 60))]
        if trial % 3 == 0:
            ids.insert(rng.randint(0, len(ids)), rng.choice(unknown))
        got = table.join(ids), table.offsets(ids)
        want = _python(table, ids, monkeypatch)
        assert got == want, ids
        data, offsets = got
        if data is None:
            assert offsets is None and any(i in unknown for i in ids)
            nones += 1
            continue
        assert offsets is not None and len(offsets) == len(ids)
        assert offsets == [sum(len(table._table[i]) for i in ids[:k + 1]) for k in range(len(ids))]
        assert (offsets[-1] if ids else 0) == len(data)
        text = ref.decode(ids, skip_special_tokens=False)
        assert text == data.decode("utf-8", "replace"), ids
        assert table.decodes_to(ids, data) is True
        assert table.decodes_to(ids, text.encode("utf-8")) is True, ids  # as a server returns the text
        if data:
            assert table.decodes_to(ids, data[:-1]) is False
    assert nones >= 150


def test_ids_that_spell_invalid_utf8_decode_to_the_text_a_server_returns(
        vocab: tuple[TokenBytes, tokenizers.Tokenizer]) -> None:
    """Sampled ids can cut a character or put bytes in no valid order: ``decodes_to`` then
    answers for ``tokenizers``' text (U+FFFD per invalid subpart), and no other text."""
    table, ref = vocab
    single = [i for i, b in table._table.items() if len(b) == 1 and b[0] >= 0x80]
    assert len(single) >= 64
    rng = random.Random("invalid-utf8")
    invalid = 0
    for _ in range(1500):
        ids = [rng.choice(single) if rng.random() < 0.6 else rng.randrange(len(table._present))
               for _ in range(rng.randint(1, 12))]
        text = ref.decode(ids, skip_special_tokens=False)
        joined_bytes = table.join(ids)
        if joined_bytes is None:
            continue
        invalid += "\ufffd" in text
        assert table.decodes_to(ids, text.encode("utf-8")) is True, ids
        assert table.decodes_to(ids, (text + "x").encode("utf-8")) is False, ids
        if "\ufffd" in text:
            assert table.decodes_to(ids, text.replace("\ufffd", "?", 1).encode("utf-8")) is False, ids
    assert invalid >= 300


def test_an_id_in_a_hole_of_the_vocabulary_has_no_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vocabulary with holes (ids no token has): a list holding one has no bytes in C and in
    Python, and so no decode answer from the table (the caller decodes with ``tokenizers``)."""
    table = TokenBytes({0: b"a", 1: b"", 3: "é".encode(), 5: b"\xff"})
    for ids, want in (([0, 3, 5, 1], b"a\xc3\xa9\xff"), ([], b""), ([0, 2], None), ([4], None), ([6], None)):
        assert table.join(ids) == want == _python(table, ids, monkeypatch)[0], ids
        assert table.offsets(ids) == _python(table, ids, monkeypatch)[1], ids
        assert table.decodes_to(ids, b"a") is (None if want is None else want == b"a")
    assert table.offsets([0, 1, 3]) == [1, 1, 3]
    with pytest.raises(ValueError):  # a table whose offsets run past its blob
        _native.token_bytes(b"ab", TokenBytes({0: b"abc"})._starts, b"\x01", [0], False)


# -- equal_ids ------------------------------------------------------------------------------

_values = st.one_of(st.integers(0, 1 << 17), st.integers(1 << 30, 1 << 64), st.integers(-(1 << 40), -1),
                    st.booleans())


def _fresh(values: list[Any]) -> list[Any]:
    """The same values as new objects (what a caller's own list holds)."""
    return [v if isinstance(v, bool) else int(str(v)) for v in values]


@st.composite
def _served(draw: st.DrawFn) -> tuple[list[Any], tuple[Any, ...], tuple[tuple[list[Any], int], ...], int,
                                      tuple[Any, ...]]:
    """(ids, prefix, parts, n, suffix): ids equal to prefix + the first n of parts + suffix, or
    changed in one place (a value, a missing or extra id, past or before n)."""
    parts = []
    for _ in range(draw(st.integers(0, 5))):
        ref = draw(st.lists(_values, max_size=12))
        parts.append((ref, draw(st.integers(0, len(ref)))))
    held = sum(ln for _, ln in parts)
    n = draw(st.integers(-1, held + 2))
    prefix = tuple(draw(st.lists(_values, max_size=3)))
    suffix = tuple(draw(st.lists(_values, max_size=3)))
    flat = [v for ref, ln in parts for v in ref[:ln]][:max(n, 0)]
    ids = list(prefix) + flat + list(suffix)
    ids = _fresh(ids) if draw(st.booleans()) else ids
    change = draw(st.sampled_from(["none", "value", "drop", "add", "mutate-held"]))
    if change == "value" and ids:
        i = draw(st.integers(0, len(ids) - 1))
        ids[i] = draw(_values.filter(lambda v: v != ids[i]))
    elif change == "drop" and ids:
        del ids[draw(st.integers(0, len(ids) - 1))]
    elif change == "add":
        ids.insert(draw(st.integers(0, len(ids))), draw(_values))
    elif change == "mutate-held" and parts and parts[0][0]:
        parts[0][0][0] = draw(_values)  # the held list changed after ids were made from it
    return ids, prefix, tuple(parts), n, suffix


@settings(max_examples=500, deadline=None)
@given(_served())
def test_equal_ids_is_list_equality_with_the_served_ids(case: tuple[list[Any], tuple[Any, ...],
                                                                    tuple[tuple[list[Any], int], ...], int,
                                                                    tuple[Any, ...]]) -> None:
    """``equal_ids(ids, prefix, parts, n, suffix)`` is ``ids == prefix + <first n ids of the
    parts> + suffix`` (False when the parts hold fewer than n, or n < 0), for ints of any size
    and sign (compared by value, not object) and bools (ints equal to 0 and 1)."""
    ids, prefix, parts, n, suffix = case
    held = [v for ref, ln in parts for v in ref[:ln]]
    want = 0 <= n <= len(held) and ids == list(prefix) + held[:n] + list(suffix)
    assert _native.equal_ids(ids, prefix, parts, n, suffix) is want


def test_equal_ids_refuses_what_is_not_served_ids() -> None:
    """No int is equal to no id (a float equal in value is not the id: ``token_ids`` refuses
    floats), and parts that are not (list, length) pairs within their list are errors."""
    assert _native.equal_ids([1, 2], (), (([1, 2], 2),), 2, ()) is True
    assert _native.equal_ids([1.0, 2], (), (([1, 2], 2),), 2, ()) is False
    with pytest.raises(ValueError):
        _native.equal_ids([1, 2], (), (([1], 2),), 2, ())
    with pytest.raises(TypeError):
        _native.equal_ids([1, 2], (), ((1, 2),), 2, ())
    with pytest.raises(TypeError):
        _native.equal_ids((1, 2), (), (([1, 2], 2),), 2, ())


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_served_matches_the_same_in_c_and_python(data: st.DataObject) -> None:
    """``Served.matches`` (a record's prompt ids against what its read served, in C for a list)
    answers as its Python reference for the caller's list as served, changed in one id, cut
    short, extended, or as packed bytes; affixes included."""
    parts = tuple((lst, data.draw(st.integers(0, len(lst))))
                  for lst in data.draw(st.lists(st.lists(st.integers(0, 151_000), max_size=20), max_size=4)))
    full = Chunks(parts, sum(ln for _, ln in parts))
    n = data.draw(st.integers(0, full.n))
    prefix = tuple(data.draw(st.lists(st.integers(0, 200_000), max_size=2)))
    suffix = tuple(data.draw(st.lists(st.integers(0, 200_000), max_size=2)))
    served: Served[Chunks, list[int]] = Served("t", "", "kv-stable", False, [], full, n, None, prefix, suffix)
    ids = list(prefix) + joined(full)[:n] + list(suffix)
    assert LISTS.result(full, n, prefix, suffix) == ids
    variants: list[list[int]] = [ids, _fresh(ids), ids[:-1], [*ids, 7]]
    if ids:
        k = data.draw(st.integers(0, len(ids) - 1))
        variants.append(ids[:k] + [ids[k] + 1] + ids[k + 1:])
    for caller in variants:
        got = served.matches(caller, LISTS)
        record_mod._native, native = None, record_mod._native
        try:
            want = served.matches(caller, LISTS)
            packed = served.matches(b"".join(i.to_bytes(4, "little") for i in caller), LISTS)
        finally:
            record_mod._native = native
        assert got is want is packed is (caller == ids), (caller, ids)


@functools.lru_cache(maxsize=1)
def _qwen() -> tuple[TokenBytes, tokenizers.Tokenizer]:
    path = qwen3_dir() / "tokenizer.json"
    table = TokenBytes.from_tokenizer_json(path)
    assert table is not None
    return table, tokenizers.Tokenizer.from_file(str(path))


_PIECES = ["Hello", " world", "\n", "\n\n", "  ", "\t", "é", "日本", "\u3000", "\u00a0", "\u2009", "\u2028", "\x1c",
           "—", "x", "42", "<think>", "</think>", "<tool_call>", "{\"a\": 1}", "🙂", "\u0085", "\u200b"]


@pytest.mark.skipif(pure_python(), reason="compares the C extension with the Python reference")
@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=24), st.sampled_from(["", "tenant"]))
def test_segment_keys_are_the_variants_keys_of_the_reference(pieces: list[str], salt: str) -> None:
    """The C pass (variants, their token ends, the character floor, the keys) gives what
    segment_variants and segment_key give, in the same order, for outputs cut at boundary
    tokens, with ASCII and Unicode whitespace at the pieces' edges; or None, and then only
    where a piece's edge may be Unicode whitespace."""
    from tokcache.store.keys import MODE_KV_STABLE, segment_key, segment_root

    text = "".join(pieces)
    table, ref = _qwen()
    ids = ref.encode(text, add_special_tokens=False).ids
    data = text.encode("utf-8")
    packed = table.packed_offsets(ids)
    assert packed is not None and int.from_bytes(packed[-4:], "little") == len(data)
    spans = []
    for tag in ("<think>", "</think>", "<tool_call>"):
        start = data.find(tag.encode())
        while start >= 0:
            spans.append((start, start + len(tag)))
            start = data.find(tag.encode(), start + 1)
    spans.sort()  # (the tags never overlap)
    want = [(segment_key(salt, MODE_KV_STABLE, seg.text.encode("utf-8")), seg.start, seg.end)
            for seg in record_mod.segment_variants(text, ids, table, spans, data)
            if len(seg.text) >= record_mod.MIN_SEGMENT_BYTES or seg.text == text]
    got = _native.segment_keys(data, packed, spans, segment_root(salt, MODE_KV_STABLE), record_mod.MIN_SEGMENT_BYTES)
    if got is None:
        assert any(c in text for c in "\u3000\u00a0\u2009\u2028\u0085"), text
        return
    assert got == want, text
