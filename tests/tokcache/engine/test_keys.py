"""Keys from the one-pass tail scan, and from a resumed text, equal keys computed one by one from scratch."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokcache.store.keys import KEY_GRID, MODE_EXACT, MODE_KV_STABLE, KeyStream, TextKeys, extend_keyed


def _reference(data: bytes, spans: list[tuple[int, int]], salt: str,
               mode: bytes) -> tuple[list[bytes], list[bytes], bytes]:
    """(L1 keys, AR keys, exact key) by cut index, each from a fresh stream fed the whole prefix."""
    l1, ar = [], []
    for start, end in spans:
        s = KeyStream(salt, mode)
        s.feed(data[:end])
        h = s._h.copy()
        l1.append(h.digest()[:16])
        a = KeyStream(salt, mode)
        a.feed(data[:start])
        ar.append(a.output_key())
    whole = KeyStream(salt, mode)
    whole.feed(data)
    return l1, ar, whole.exact_key()


def _keyed(spans: list[tuple[int, int]], grid: int) -> list[int]:
    """The keyed cuts, straight from the definition: the first, and the first in each new grid block."""
    if not grid:
        return list(range(len(spans)))
    return [i for i in range(len(spans)) if i == 0 or spans[i][1] // grid != spans[i - 1][1] // grid]


@st.composite
def _texts(draw: st.DrawFn) -> tuple[bytes, list[tuple[int, int]]]:
    data = draw(st.binary(min_size=0, max_size=300))
    points = sorted(draw(st.lists(st.integers(0, len(data)), max_size=24)))
    spans = []
    prev = 0
    for a, b in zip(points[::2], points[1::2], strict=False):
        if a >= prev:
            spans.append((a, b))
            prev = b
    return data, spans


_GRIDS = st.sampled_from([0, 1, 16, 64, KEY_GRID])


@settings(max_examples=200, deadline=None)
@given(_texts(), st.integers(-3, 30), _GRIDS, st.sampled_from(["", "tenant-a"]),
       st.sampled_from([MODE_EXACT, MODE_KV_STABLE]))
def test_scan_tail_matches_keys_from_scratch(text: tuple[bytes, list[tuple[int, int]]], lo: int, grid: int,
                                             salt: str, mode: bytes) -> None:
    data, spans = text
    l1, ar_keys, exact = _reference(data, spans, salt, mode)
    keys = TextKeys(data, spans, salt, mode, grid=grid)
    assert keys.keyed == _keyed(spans, grid)
    keys.scan_tail(lo)
    assert keys.exact_key() == exact
    assert [keys.key_at(p) for p in range(len(keys.keyed))] == [l1[i] for i in keys.keyed]
    keys.fill_ar(0, len(spans))
    assert [keys.ar_key(i) for i in range(len(spans))] == ar_keys
    # Lazy keys without a scan, and fill(), agree too.
    fresh = TextKeys(data, spans, salt, mode, grid=grid)
    fresh.fill(max(lo, 0), len(fresh.keyed))
    assert [fresh.key_at(p) for p in range(len(fresh.keyed))] == [l1[i] for i in fresh.keyed]
    assert fresh.exact_key() == exact


@settings(max_examples=200, deadline=None)
@given(_texts(), st.binary(max_size=200), st.integers(0, 30), st.integers(0, 24), _GRIDS, st.booleans())
def test_a_text_resumed_from_the_one_it_extends_has_the_same_keys(
        base: tuple[bytes, list[tuple[int, int]]], more: bytes, lo: int, extra: int, grid: int, ar: bool) -> None:
    """A text that extends another takes its keys and hash state (KeyState) and hashes only what it
    appended: every key equals the one computed from scratch."""
    data, spans = base
    keep = len(spans)  # every span of the base is kept by the longer text (the test's texts say so)
    first = TextKeys(data, spans, "s", MODE_KV_STABLE, grid=grid)
    first.scan_tail(len(first.keyed) - lo, keep=keep)
    if ar:
        first.fill_ar(0, len(spans))
    state = first.state()
    longer = data + more
    new_spans = list(spans)
    prev = len(data)
    for k in range(0, len(more) - 1, max(1, len(more) // max(1, extra))):
        a, b = prev + k, prev + k + 1
        if not new_spans or a >= new_spans[-1][1]:
            new_spans.append((a, b))
    l1, ar_keys, exact = _reference(longer, new_spans, "s", MODE_KV_STABLE)
    keys = TextKeys(longer, new_spans, "s", MODE_KV_STABLE, state, grid=grid)
    assert keys.keyed == _keyed(new_spans, grid)
    keys.scan_tail(len(keys.keyed) - lo, keep=len(new_spans))
    assert keys.exact_key() == exact
    assert [keys.key_at(p) for p in range(len(keys.keyed))] == [l1[i] for i in keys.keyed]
    keys.fill_ar(0, len(new_spans))
    assert [keys.ar_key(i) for i in range(len(new_spans))] == ar_keys


def test_extend_keyed_continues_a_prefix() -> None:
    spans = [(0, 5), (10, 2050), (2100, 2101), (4000, 4200), (4300, 6200)]
    whole: list[int] = []
    extend_keyed(spans, 2048, 0, whole)
    assert whole == [0, 1, 3, 4]
    part = whole[:2]
    extend_keyed(spans, 2048, 2, part)
    assert part == whole


def test_namespaces_differ() -> None:
    data, spans = b"<a>hello<b>world", [(0, 3), (8, 11)]
    a = TextKeys(data, spans, "", MODE_KV_STABLE, grid=0)
    b = TextKeys(data, spans, "", MODE_EXACT, grid=0)
    c = TextKeys(data, spans, "salt", MODE_KV_STABLE, grid=0)
    for keys in (a, b, c):
        keys.scan_tail(0)
        keys.fill_ar(0, 2)
    assert len({a.exact_key(), b.exact_key(), c.exact_key()}) == 3
    assert len({a.key_at(1), b.key_at(1), c.key_at(1), a.ar_key(1), a.exact_key()}) == 5


@settings(max_examples=200, deadline=None)
@given(_texts(), st.binary(max_size=200), st.integers(0, 30), _GRIDS, st.booleans(), st.data())
def test_a_text_resumed_from_a_state_cut_back_has_the_same_keys(
        base: tuple[bytes, list[tuple[int, int]]], other: bytes, lo: int, grid: int, ar: bool,
        data_: st.DataObject) -> None:
    """A text that shares only a prefix of another (a rewritten history) takes the other's key
    state cut back to a span inside that prefix (KeyState.at: no hasher, rebuilt in one pass):
    every key equals the one computed from scratch."""
    data, spans = base
    first = TextKeys(data, spans, "s", MODE_KV_STABLE, grid=grid)
    first.scan_tail(len(first.keyed) - lo, keep=len(spans))
    if ar:
        first.fill_ar(0, len(spans))
    state = first.state()
    if state is None or not spans:
        return
    cut = data_.draw(st.integers(0, state.cut))
    shared = spans[cut][1]
    text = data[:shared] + other
    new_spans = spans[:cut + 1] + [(shared + k, shared + k + 1) for k in range(0, len(other) - 1, 7)]
    l1, ar_keys, exact = _reference(text, new_spans, "s", MODE_KV_STABLE)
    keys = TextKeys(text, new_spans, "s", MODE_KV_STABLE, state.at(cut), grid=grid)
    assert keys.keyed == _keyed(new_spans, grid)
    keys.scan_tail(len(keys.keyed) - lo, keep=len(new_spans))
    assert keys.exact_key() == exact
    assert [keys.key_at(p) for p in range(len(keys.keyed))] == [l1[i] for i in keys.keyed]
    keys.fill_ar(0, len(new_spans))
    assert [keys.ar_key(i) for i in range(len(new_spans))] == ar_keys
    later = keys.state()
    assert later is None or later.hasher is not None  # a state passed on always has its hasher


def test_segment_key_is_its_documented_hash_whatever_the_buffer() -> None:
    """segment_key (whose namespace header is hashed once per namespace and copied) is
    sha256(header + text) truncated to 16 bytes — the key the sidecar writes and every
    reader and the cluster tier look up — for bytes and for a memoryview into a longer
    buffer alike, in each namespace."""
    import hashlib

    from tokcache.store.keys import KEY_BYTES, MODE_EXACT, MODE_KV_STABLE, segment_key

    body = "<|im_start|>assistant\nDone: 3 files changed. 你好 🛠\n".encode()
    for salt in ("", "tenant-a", "é"):
        for mode in (MODE_KV_STABLE, MODE_EXACT):
            salt_b = salt.encode()
            header = b"tokcache/v1\x00S" + mode + len(salt_b).to_bytes(4, "little") + salt_b
            for p in (0, 22):
                want = hashlib.sha256(header + body[p:]).digest()[:KEY_BYTES]
                assert segment_key(salt, mode, body[p:]) == want
                assert segment_key(salt, mode, memoryview(body)[p:]) == want
    assert segment_key("", MODE_KV_STABLE, body) != segment_key("x", MODE_KV_STABLE, body)
