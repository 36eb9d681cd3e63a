"""The chain memo: reads stop at held records, results equal a full read, hits never depend on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokcache.engine.ids import BYTES, LISTS
from tokcache.engine.memo import ChainMemo
from tokcache.ids import pack_ids, unpack_ids
from tokcache.store import Kind, Store

FP = "ab" * 16


def k(name: str) -> bytes:
    return (name.encode() * 16)[:15] + b"\x01"


@pytest.fixture
def store(shm_prefix: str) -> Iterator[Store]:
    s = Store.open(prefix=shm_prefix, fingerprint=FP, size=2 << 20)
    try:
        yield s
    finally:
        s.unlink()
        s.close()


def test_a_read_stops_at_a_held_record_and_equals_a_full_read(store: Store) -> None:
    memo = ChainMemo(LISTS)
    first = store.put(None, 0, pack_ids(range(100)), [(k("a"), 100)], Kind.L1)
    assert first is not None and first.base == 0 and first.n == 100
    second = store.put(k("a"), 100, pack_ids(range(100, 130)), [(k("b"), 30), (k("b-half"), 10)], Kind.L1)
    assert second is not None and second.base == 100 and second.n == 30
    # Nothing held: the whole chain comes from shared memory.
    full = store.read(k("b"), memo.known)
    assert full is not None and full.held is None and unpack_ids(full.rest) == list(range(130))
    # The first record held: only the second is read.
    memo.put(first, LISTS.from_list(list(range(100))))
    part = store.read(k("b"), memo.known)
    assert part is not None and part.held_tokens == 100 and LISTS.result(part.held, 100) == list(range(100))
    assert unpack_ids(part.rest) == list(range(100, 130))
    # A key that uses part of a held record: nothing left to read.
    memo.put(second, LISTS.from_list(list(range(130))), {k("b-half"): 10})
    half = store.read(k("b-half"), memo.known)
    assert half is not None and half.held_tokens == 110 and half.rest == b""
    assert store.get(k("b-half")) == pack_ids(range(110))
    # A key the memo knows is in the record its slot names: no read at all.
    slot = store.slot(k("b-half"))
    assert slot is not None and slot[0] == second.lsn
    held = memo.held_key(second.lsn, k("b-half"))
    assert held is not None and held[1] == 110 and held[2] == first.lsn <= second.lsn
    assert memo.held_key(second.lsn, k("b")) is None  # not known to the memo: read as usual


def test_the_memo_never_turns_a_miss_into_a_hit(store: Store) -> None:
    memo = ChainMemo(BYTES)
    ref = store.put(None, 0, pack_ids(range(50)), [(k("old"), 50)], Kind.L1)
    assert ref is not None
    memo.put(ref, pack_ids(range(50)))
    child = store.put(k("old"), 50, pack_ids([7, 8]), [(k("child"), 2)], Kind.L1)
    assert child is not None
    for i in range(3000):  # evict both records
        store.put(None, 0, pack_ids(range(200)), [(i.to_bytes(15, "little") + b"\x02", 200)], Kind.L1)
    assert store.get(k("child")) is None
    assert store.read(k("child"), memo.known) is None  # the held parent does not revive it
    assert store.read(k("old"), memo.known) is None


def test_a_re_put_key_is_read_from_its_new_record(store: Store) -> None:
    memo = ChainMemo(LISTS)
    ref = store.put(None, 0, pack_ids([1, 2, 3]), [(k("x"), 3)], Kind.L1)
    assert ref is not None
    memo.put(ref, LISTS.from_list([1, 2, 3]), {k("x"): 3})
    assert store.put(None, 0, pack_ids([7, 8]), [(k("x"), 2)], Kind.L1)
    slot = store.slot(k("x"))
    assert slot is not None and slot[0] != ref.lsn and memo.held_key(slot[0], k("x")) is None
    got = store.read(k("x"), memo.known)
    assert got is not None and got.held is None and unpack_ids(got.rest) == [7, 8]


def test_the_budget_holds_and_drops_the_least_recent() -> None:
    memo = ChainMemo(LISTS, max_ids=100)
    from tokcache.store import RecordRef

    a, b = RecordRef(8, b"a" * 8, 0, 60, 8), RecordRef(16, b"b" * 8, 0, 60, 16)
    memo.put(a, LISTS.from_list(list(range(60))), {k("a"): 60})
    memo.put(b, LISTS.from_list(list(range(60))))
    assert memo.known(8, b"a" * 8) is None and memo.known(16, b"b" * 8) is not None
    assert memo.held_key(8, k("a")) is None  # dropped with its record
    memo.put(RecordRef(24, b"c" * 8, 0, 500), LISTS.from_list(list(range(500))))  # bigger than the budget
    assert memo.known(24, b"c" * 8) is None and len(memo) == 1


def test_chunks_share_lists_and_callers_get_their_own() -> None:
    base = LISTS.from_list([1, 2, 3])
    grown = LISTS.grow(base, 3, LISTS.from_list([4]))
    shorter = LISTS.grow(base, 2, LISTS.from_list([9]))  # a shorter prefix of the same list
    assert LISTS.result(grown, 4) == [1, 2, 3, 4] and LISTS.result(shorter, 3) == [1, 2, 9]
    assert LISTS.result(base, 3) == [1, 2, 3]  # never changed by the others
    out = LISTS.result(grown, 4, (0,), (5,))
    assert out == [0, 1, 2, 3, 4, 5]
    out.append(6)
    assert LISTS.result(grown, 4) == [1, 2, 3, 4]  # a caller's list is its own
    many = base
    for i in range(200):  # a long conversation: parts are flattened now and then
        many = LISTS.grow(many, LISTS.count(many), LISTS.from_list([i]))
    assert len(many.parts) <= 64 and LISTS.result(many, LISTS.count(many)) == [1, 2, 3, *range(200)]
