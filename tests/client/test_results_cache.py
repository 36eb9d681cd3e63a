"""The client's result cache: what it offers, what it keeps, and that callers cannot corrupt it."""

from __future__ import annotations

import pytest

from sidecar_client import _core
from sidecar_client._results import OFFER, ResultCache, group_of
from sidecar_client.errors import SidecarInternalError
from tokcache.v1 import tokenizer_pb2 as pb


def test_groups_follow_the_conversation_head() -> None:
    a = group_of("m", "<|im_start|>system\nX" + "a" * 300, None, "", None, False)
    assert a == group_of("m", "<|im_start|>system\nX" + "a" * 300 + "more turns", None, "", None, False)
    assert a != group_of("m", "<|im_start|>system\nY" + "a" * 300, None, "", None, False)
    assert a != group_of("m", "<|im_start|>system\nX" + "a" * 300, None, "salt", None, False)
    assert a != group_of("m", "<|im_start|>system\nX" + "a" * 300, None, "", None, True)
    msgs = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "q1"}]
    assert group_of("m", None, msgs, None, None, None) == group_of("m", None, msgs + [{"role": "user"}], None, None,
                                                                     None)
    assert group_of("m", None, ["not a mapping"], None, None, None) is None  # type: ignore[list-item]


def test_offers_newest_first_within_the_group_and_bounds_memory() -> None:
    cache = ResultCache(max_results=6, max_ids=100)
    for i in range(5):
        cache.add(1, bytes([i + 1]) * 16, [i] * 10)
    cache.add(2, b"\xff" * 16, [9] * 10)
    offered = cache.offer(1)
    assert list(offered) == [bytes([i + 1]) * 16 for i in (4, 3, 2, 1)][:OFFER]
    assert offered[bytes([5]) * 16] == (4,) * 10
    assert cache.offer(None) == {} and cache.offer(3) == {}
    cache.add(1, b"\xee" * 16, [1] * 60)  # 120 ids > 100: oldest dropped until it fits
    assert len(cache) <= 6 and sum(len(v) for v in cache.offer(1).values()) <= 100
    cache.add(1, b"", [1])  # the server kept nothing: nothing to keep
    cache.add(1, b"\xdd" * 16, [1] * 101)  # bigger than the whole budget
    assert b"\xdd" * 16 not in cache.offer(1)


def test_a_caller_mutating_its_list_does_not_change_the_next_delta() -> None:
    cache = ResultCache()
    ids = list(range(100, 200))
    cache.add(7, b"h" * 16, ids)
    ids[3] = -1  # the caller's list, not the cache's
    known = cache.offer(7)
    resp = pb.TokenizeResponse(token_ids=_core.pack_ids([1, 2], "t"), base_handle=b"h" * 16, base_tokens=50,
                               num_tokens=52)
    assert _core.assemble_ids(resp, known) == list(range(100, 150)) + [1, 2]


def test_inconsistent_delta_replies_are_errors_not_ids() -> None:
    known = {b"h" * 16: (1, 2, 3)}
    with pytest.raises(SidecarInternalError):  # a base we never offered
        _core.assemble_ids(pb.TokenizeResponse(base_handle=b"x" * 16, base_tokens=1, num_tokens=1), known)
    with pytest.raises(SidecarInternalError):  # more base ids than we hold
        _core.assemble_ids(pb.TokenizeResponse(base_handle=b"h" * 16, base_tokens=4, num_tokens=4), known)
    with pytest.raises(SidecarInternalError):  # a count that does not add up
        _core.assemble_ids(pb.TokenizeResponse(token_ids=_core.pack_ids([5], "t"), base_handle=b"h" * 16,
                                               base_tokens=2, num_tokens=4), known)
    full = pb.TokenizeResponse(token_ids=_core.pack_ids([5, 6], "t"), num_tokens=2)
    assert _core.assemble_ids(full, None) == [5, 6]


def test_text_base_is_the_longest_kept_text_the_request_extends() -> None:
    cache = ResultCache()
    head = "s" * 1100
    cache.add(1, b"a" * 16, [1], head)
    cache.add(1, b"b" * 16, [1], head + "turn one")
    cache.add(1, b"c" * 16, [1], head + "other branch")
    cache.add(2, b"d" * 16, [1], head + "turn one and more")  # another group
    assert cache.text_base(1, head + "turn one, turn two") == (b"b" * 16, len(head) + 8)
    assert cache.text_base(1, head + "turn one") == (b"a" * 16, len(head))  # equal text is no extension
    assert cache.text_base(1, "x" + head) == (b"", 0)
    assert cache.text_base(None, head + "y") == (b"", 0)
    short = ResultCache()
    short.add(1, b"e" * 16, [1], "short")  # under MIN_TEXT_BASE: not worth a retry's risk
    assert short.text_base(1, "short and longer") == (b"", 0)
    cache.forget(b"b" * 16)
    assert cache.text_base(1, head + "turn one, turn two") == (b"a" * 16, len(head))
