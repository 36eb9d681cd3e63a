"""Heads (``tokcache.engine.heads``): a head is taken once, only for the cut and length it
was built for, and the heads of a process stay within their budget, oldest dropped first."""

from __future__ import annotations

import threading
from typing import Any

from tokcache.engine.boundaries import Scan
from tokcache.engine.heads import Heads, Ready
from tokcache.engine.ids import BYTES, LISTS, Chunks
from tokcache.ids import pack_ids


def _scan() -> Scan:
    return Scan(b"", [], [], 0, 0)


def _ready(scan: Scan, ids: list[int], tokens: int, cut: int = 10) -> Ready[Chunks]:
    return Ready(scan, cut, LISTS.from_list(ids), tokens)


def test_a_head_is_the_prefix_and_the_takers_own() -> None:
    heads: Heads[Chunks, list[int]] = Heads(LISTS)
    s = _scan()
    ids = [5, 6, 7, 8]
    heads.build(_ready(s, ids, 3))
    got = heads.take(s, 10, 3)
    assert got == [5, 6, 7]
    assert got is not ids
    got.append(99)  # the taker's: the ids it was built from are untouched
    assert ids == [5, 6, 7, 8]
    assert heads.take(s, 10, 3) is None  # taken once
    assert (heads.built, heads.used, len(heads)) == (1, 1, 0)


def test_a_head_for_another_cut_or_length_is_not_used() -> None:
    heads: Heads[Chunks, list[int]] = Heads(LISTS)
    a, b = _scan(), _scan()
    heads.build(_ready(a, [1, 2, 3], 3, cut=10))
    heads.build(_ready(b, [1, 2, 3], 3, cut=10))
    assert heads.take(a, 11, 3) is None
    assert heads.take(b, 10, 2) is None
    assert heads.take(_scan(), 10, 3) is None  # an equal scan is not the same one
    assert heads.used == 0 and len(heads) == 0


def test_heads_stay_within_their_budget_oldest_first() -> None:
    heads: Heads[Chunks, list[int]] = Heads(LISTS, budget=10)
    scans = [_scan() for _ in range(4)]
    for s in scans:
        heads.build(_ready(s, list(range(4)), 4))
    assert len(heads) == 2  # 4 + 4 <= 10 < 12
    assert heads.take(scans[0], 10, 4) is None and heads.take(scans[1], 10, 4) is None
    assert heads.take(scans[3], 10, 4) == [0, 1, 2, 3]
    heads.build(_ready(_scan(), list(range(11)), 11))  # over the budget alone: not kept
    assert len(heads) == 1


def test_rebuilding_a_scans_head_replaces_it() -> None:
    heads: Heads[Chunks, list[int]] = Heads(LISTS, budget=10)
    s = _scan()
    heads.build(_ready(s, [1, 2, 3], 3))
    heads.build(_ready(s, [1, 2, 3, 4], 4, cut=12))
    assert len(heads) == 1
    assert heads.take(s, 12, 4) == [1, 2, 3, 4]


def test_one_taker_among_threads() -> None:
    heads: Heads[Chunks, list[int]] = Heads(LISTS)
    s = _scan()
    heads.build(_ready(s, list(range(1000)), 1000))
    got: list[object] = []
    start = threading.Barrier(8)

    def take() -> None:
        start.wait()
        got.append(heads.take(s, 10, 1000))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(g is not None for g in got) == 1


def test_bytes_heads_finish_like_lists() -> None:
    heads: Heads[bytes, bytes] = Heads(BYTES)
    s = _scan()
    heads.build(Ready(s, 4, pack_ids([1, 2, 3, 4]), 3))
    head = heads.take(s, 4, 3)
    assert head == pack_ids([1, 2, 3])
    assert BYTES.finish(head, [3, 9], 1, (7,)) == pack_ids([1, 2, 3, 9, 7])
    assert LISTS.finish([1, 2, 3], [3, 9], 1, (7,)) == [1, 2, 3, 9, 7]
    assert LISTS.finish([1, 2, 3], [9], 0) == [1, 2, 3, 9]


def test_no_head_for_a_superseded_text() -> None:
    """A text extending the scan was filed first: its turn is served, the head is never built."""
    heads: Heads[Chunks, list[int]] = Heads(LISTS)
    s = _scan()
    s.superseded = True
    heads.build(_ready(s, [1, 2, 3], 3))
    assert len(heads) == 0 and heads.built == 0


def test_a_busy_process_declines_offers_for_a_while() -> None:
    """A turn that finds its head offered but not built (nothing ran between the turns) makes
    the next BACKOFF offers decline: a saturated process copies ids once, not twice."""
    from tokcache.engine import heads as heads_mod

    heads: Heads[Chunks, list[int]] = Heads(LISTS)
    s = _scan()
    assert heads.offer(_ready(s, [1, 2, 3], 3))
    assert heads.pending
    assert heads.take(s, 10, 3) is None  # offered, not built: this turn copies itself
    assert not heads.pending
    declined = 0
    while not heads.offer(_ready(_scan(), [1], 1)):
        declined += 1
    assert declined == heads_mod.BACKOFF
    heads.build_pending()
    assert heads.built == 1


def test_offered_heads_are_built_after_the_reply_and_taken() -> None:
    heads: Heads[Chunks, list[int]] = Heads(LISTS)
    a, b = _scan(), _scan()
    assert heads.offer(_ready(a, [1, 2, 3], 3)) and heads.offer(_ready(b, [4, 5], 2))
    b.superseded = True  # its next turn came first
    heads.build_pending()
    assert not heads.pending and heads.built == 1
    assert heads.take(a, 10, 3) == [1, 2, 3]


def test_heads_of_superseded_texts_and_past_max_heads_are_dropped() -> None:
    """A head keeps its text alive: one whose text was superseded without taking it goes when
    the next is built, and at most MAX_HEADS stay."""
    from tokcache.engine import heads as heads_mod

    heads: Heads[Chunks, list[int]] = Heads(LISTS)
    a = _scan()
    heads.build(_ready(a, [1, 2], 2))
    a.superseded = True  # its next turn went another way (did not take it)
    heads.build(_ready(_scan(), [3], 1))
    assert len(heads) == 1
    scans = [_scan() for _ in range(heads_mod.MAX_HEADS + 5)]
    for s in scans:
        heads.build(_ready(s, [1], 1))
    assert len(heads) == heads_mod.MAX_HEADS
    assert heads.take(scans[0], 10, 1) is None and heads.take(scans[-1], 10, 1) == [1]


def test_a_recorded_outputs_head_is_taken_once_by_its_key_and_length() -> None:
    """Heads built under an AR key (a recorded output's chain, after its record): taken once,
    only with the length built, the taker's own; the oldest go past the budget."""
    heads: Heads[Chunks, list[int]] = Heads(LISTS, budget=8)
    ids = [1, 2, 3, 4, 5]
    heads.build_key(b"k" * 16, LISTS.from_list(ids), 4)
    assert heads.take_key(b"x" * 16, 4) is None  # another key
    got = heads.take_key(b"k" * 16, 4)
    assert got == [1, 2, 3, 4] and got is not ids
    got.append(9)
    assert ids == [1, 2, 3, 4, 5] and heads.take_key(b"k" * 16, 4) is None  # taken once
    heads.build_key(b"a" * 16, LISTS.from_list(ids), 5)
    assert heads.take_key(b"a" * 16, 4) is None  # another length: dropped, not used
    heads.build_key(b"a" * 16, LISTS.from_list(ids), 5)
    heads.build_key(b"b" * 16, LISTS.from_list(ids), 5)  # 10 ids > budget 8: "a" goes
    assert heads.take_key(b"a" * 16, 5) is None and heads.take_key(b"b" * 16, 5) == ids
    assert (heads.built, heads.used, len(heads)) == (4, 2, 0)


def test_scan_and_key_heads_share_the_budget() -> None:
    heads: Heads[Chunks, list[int]] = Heads(LISTS, budget=8)
    heads.build_key(b"k" * 16, LISTS.from_list([1, 2, 3, 4, 5, 6]), 6)
    s = _scan()
    heads.build(_ready(s, [1, 2, 3, 4], 4))  # over budget with the key's: a scan head drops, nothing raises
    assert heads.take(s, 10, 4) is None and heads.take_key(b"k" * 16, 6) == [1, 2, 3, 4, 5, 6]


def test_a_recorded_outputs_head_is_offered_then_built_between_requests_or_dropped_when_late() -> None:
    heads: Heads[Chunks, list[int]] = Heads(LISTS)
    loads: list[bytes] = []

    def load(key: bytes, n: int) -> Any:
        def f() -> tuple[Chunks, int] | None:
            loads.append(key)
            if n < 0:
                raise OSError("the store failed")
            return (LISTS.from_list(list(range(n))), n) if n else None
        return f

    assert heads.offer_key(b"a" * 16, load(b"a" * 16, 3)) and heads.pending
    assert heads.offer_key(b"b" * 16, load(b"b" * 16, 0))  # evicted meanwhile: no head
    assert heads.offer_key(b"c" * 16, load(b"c" * 16, -1))  # a store error: no head, nothing raised
    assert not loads  # nothing read on the offering path
    heads.build_pending()
    assert not heads.pending and sorted(loads) == [b"a" * 16, b"b" * 16, b"c" * 16]
    assert heads.take_key(b"a" * 16, 3) == [0, 1, 2] and heads.take_key(b"b" * 16, 0) is None
    # Taken before it was built (a busy process): not built later, and the next offers are declined.
    assert heads.offer_key(b"d" * 16, load(b"d" * 16, 2))
    assert heads.take_key(b"d" * 16, 2) is None
    assert not heads.pending and not heads.offer_key(b"e" * 16, load(b"e" * 16, 2))


def test_a_head_being_built_is_still_pending() -> None:
    """A build under way (another thread reading the chain) keeps ``pending`` true until the
    head is built: whoever waits for the heads (a flush, a test, a benchmark's pause between
    turns) would otherwise go on while the chain is still being read, and its next request
    would read the chain itself."""
    heads: Heads[Chunks, list[int]] = Heads(LISTS)
    reading, release = threading.Event(), threading.Event()

    def load() -> tuple[Chunks, int] | None:
        reading.set()
        release.wait(10)
        return LISTS.from_list([1, 2, 3]), 3

    assert heads.offer_key(b"k" * 16, load)
    builder = threading.Thread(target=heads.build_pending)
    builder.start()
    assert reading.wait(10)
    assert heads.pending  # taken from the offers, not built yet
    assert not heads.offered  # nothing left for another builder (the write-behind) to take
    release.set()
    builder.join(10)
    assert not heads.pending and heads.take_key(b"k" * 16, 3) == [1, 2, 3]
