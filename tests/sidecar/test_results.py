"""Delta replies: the server's result memo and the prefix comparison behind it."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from tokcache.sidecar.results import MIN_DELTA_IDS, ResultMemo, common_prefix_ids


def _pack(ids: list[int]) -> bytes:
    return array("I", ids).tobytes()


def _naive(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=3000), st.integers(0, 3000),
       st.lists(st.integers(0, 2**32 - 1), max_size=50), st.integers(0, 2**32 - 1))
def test_common_prefix_matches_a_naive_scan(base: list[int], cut: int, tail: list[int], flip: int) -> None:
    other = base[:cut] + tail
    assert common_prefix_ids(_pack(base), _pack(other)) == _naive(base, other)
    # A change in a single byte of one id is found at that id.
    if base:
        i = flip % len(base)
        changed = list(base)
        changed[i] ^= 1 << (flip % 32)
        assert common_prefix_ids(_pack(base), _pack(changed)) == i


def test_memo_picks_the_longest_known_prefix_and_forgets_by_size() -> None:
    memo = ResultMemo(max_bytes=4 * 1000)
    ids = list(range(500))
    short = memo.put("", _pack(ids[:100] + [9999]))
    longer = memo.put("", _pack(ids[:300]))
    unrelated = memo.put("", _pack([7] * 200))
    assert len({short, longer, unrelated}) == 3 and all(len(h) == 16 for h in (short, longer, unrelated))
    assert memo.best_base([short, longer, unrelated, b"\x00" * 16], _pack(ids), "") == (longer, 300)
    # Less than MIN_DELTA_IDS shared: no delta.
    assert memo.best_base([short], _pack(ids[:MIN_DELTA_IDS - 1]), "") == (b"", 0)
    # Over the byte budget the least recently used go first; a bigger-than-budget result is not kept.
    memo.put("", _pack(list(range(400))))  # 4004 bytes: the least recently used one (longer) goes
    assert memo.get(longer, "") is None and memo.get(short, "") is not None and memo.get(unrelated, "") is not None
    assert memo.put("", _pack(list(range(2000)))) == b""
    # Another process's (or life's) handles are unknown, never confused with ours.
    assert ResultMemo().get(unrelated, "") is None


def test_a_handle_answers_only_under_its_salt() -> None:
    memo = ResultMemo()
    ids = _pack(list(range(1000)))
    handle = memo.put("tenant-a", ids, b"secret prompt of tenant a", 25)
    assert memo.text_of(handle, "tenant-a") == (b"secret prompt of tenant a", 25)
    assert memo.text_of(handle, "tenant-b") is None and memo.text_of(handle, "") is None
    assert memo.best_base([handle], ids, "tenant-b") == (b"", 0)
    assert memo.best_base([handle], ids, "tenant-a") == (handle, 1000)
