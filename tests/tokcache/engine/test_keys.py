"""Keys from the one-pass tail scan equal keys computed one by one from scratch."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokcache.store.keys import MODE_EXACT, MODE_KV_STABLE, KeyStream, TextKeys


def _reference(data: bytes, spans: list[tuple[int, int]], salt: str,
               mode: bytes) -> tuple[list[bytes], list[bytes], bytes]:
    """(L1 keys, AR keys, exact key), each from a fresh stream fed the whole prefix."""
    l1, ar = [], []
    for start, end in spans:
        s = KeyStream(salt, mode)
        s.feed(data[:end])
        h = s._h.copy()
        l1.append(h.digest(16))
        a = KeyStream(salt, mode)
        a.feed(data[:start])
        ar.append(a.output_key())
    whole = KeyStream(salt, mode)
    whole.feed(data)
    return l1, ar, whole.exact_key()


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


@settings(max_examples=200, deadline=None)
@given(_texts(), st.integers(-3, 30), st.booleans(), st.sampled_from(["", "tenant-a"]),
       st.sampled_from([MODE_EXACT, MODE_KV_STABLE]))
def test_scan_tail_matches_keys_from_scratch(text: tuple[bytes, list[tuple[int, int]]], lo: int, ar: bool,
                                             salt: str, mode: bytes) -> None:
    data, spans = text
    l1, ar_keys, exact = _reference(data, spans, salt, mode)
    keys = TextKeys(data, spans, salt, mode)
    keys.scan_tail(lo, ar=ar)
    assert keys.exact_key() == exact
    assert [keys.key(i) for i in range(len(spans))] == l1
    assert [keys.ar_key(i) for i in range(len(spans))] == ar_keys
    # Lazy keys without a scan, and fill(), agree too.
    fresh = TextKeys(data, spans, salt, mode)
    fresh.fill(max(lo, 0), len(spans))
    assert [fresh.key(i) for i in range(len(spans))] == l1
    assert fresh.exact_key() == exact


def test_namespaces_differ() -> None:
    data, spans = b"<a>hello<b>world", [(0, 3), (8, 11)]
    a = TextKeys(data, spans, "", MODE_KV_STABLE)
    b = TextKeys(data, spans, "", MODE_EXACT)
    c = TextKeys(data, spans, "salt", MODE_KV_STABLE)
    for keys in (a, b, c):
        keys.scan_tail(0, ar=True)
    assert len({a.exact_key(), b.exact_key(), c.exact_key()}) == 3
    assert len({a.key(1), b.key(1), c.key(1), a.ar_key(1), a.exact_key()}) == 5
