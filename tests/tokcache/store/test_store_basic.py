"""Store semantics: round trips, chains, shared records, re-puts, argument checks."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable

import posix_ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tokcache.store.store_helpers import FINGERPRINT, ids_of, key
from tokcache.store import Kind, LockTimeout, SegmentError, Store, StoreClosed, _log, segment_name
from tokcache.store import _store as store_module
from tokcache.store._layout import ID_WIDTHS, U32_MAX
from tokcache.store.errors import translate

Open = Callable[..., Store]
both_widths = pytest.mark.parametrize("id_bytes", ID_WIDTHS)


def u32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


def test_segment_name() -> None:
    assert segment_name("tok.cache_1-a", "AB" * 16) == "/tok.cache_1-a-" + "ab" * 16
    for bad_prefix in ("", "-x", ".x", "a/b", "a b", "x" * 129):
        with pytest.raises(ValueError):
            segment_name(bad_prefix, FINGERPRINT)
    for bad_fp in ("", "ab" * 15, "zz" * 16, "ab" * 17):
        with pytest.raises(ValueError):
            segment_name("tok", bad_fp)


@both_widths
def test_round_trip(open_store: Open, id_bytes: int) -> None:
    store = open_store()
    assert store.name.endswith("-" + FINGERPRINT)
    assert not store.attached_existing
    assert store.id_bytes == store.stats().id_bytes == id_bytes
    ids = u32(1, 2, 3, 4, 5)
    assert store.put(None, 0, ids, [(key("a"), 5), (key("a2"), 2), (key("a0"), 0)], Kind.L0)
    assert store.get(key("a")) == ids
    assert store.get(key("a2")) == u32(1, 2)
    assert store.get(key("a0")) == b""  # an empty prefix is a hit, not a miss
    assert store.get(key("absent")) is None
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.puts) == (3, 1, 1)
    assert stats.live_entries[Kind.L0] == 3
    assert stats.capacity == store.size == 1 << 20
    assert 0 < stats.used_bytes < stats.arena_bytes < stats.capacity


@both_widths
def test_chain_with_partial_entries(open_store: Open) -> None:
    store = open_store()
    assert store.put(None, 0, u32(1, 2, 3), [(key(0), 3), (key(0, "p"), 1)], Kind.L1)
    assert store.put(key(0), 3, u32(4, 5), [(key(1), 2), (key(1, "p"), 1)], Kind.L1)
    assert store.put(key(1), 5, u32(6, 7, 8), [(key(2), 3), (key(2, "p"), 0)], Kind.L1)
    # A child may hang off a partial entry: the chain takes only the ids that key uses.
    assert store.put(key(0, "p"), 1, u32(9), [(key("branch"), 1)], Kind.L1)
    assert store.get(key(2)) == u32(1, 2, 3, 4, 5, 6, 7, 8)
    assert store.get(key(2, "p")) == u32(1, 2, 3, 4, 5)
    assert store.get(key(1, "p")) == u32(1, 2, 3, 4)
    assert store.get(key("branch")) == u32(1, 9)


@both_widths
def test_shared_record_keeps_memory_linear(open_store: Open, id_bytes: int) -> None:
    store = open_store()
    parent: bytes | None = None
    total = b""
    for turn in range(40):
        ids = ids_of("turn", turn, n=275)
        entries = [(key(turn, b), (b + 1) * 55) for b in range(5)]
        assert store.put(parent, len(total) // 4, ids, entries, Kind.L1)
        for b in range(5):
            assert store.get(key(turn, b)) == total + ids[: (b + 1) * 220]
        parent, total = key(turn, 4), total + ids
    # One record per turn: ~11k ids stored once, not once per boundary (that would be ~1 MB).
    assert store.stats().used_bytes < id_bytes * 11_000 + 40 * 256
    assert store.get(key(39, 4)) == total


@both_widths
def test_reput_replaces_mapping_but_not_children(open_store: Open) -> None:
    store = open_store()
    assert store.put(None, 0, u32(1, 2), [(key("p"), 2)], Kind.L1)
    assert store.put(key("p"), 2, u32(3), [(key("c"), 1)], Kind.L1)
    assert store.put(None, 0, u32(7, 7), [(key("p"), 2)], Kind.L1)
    assert store.get(key("p")) == u32(7, 7)
    # The child is bound to the record it was put on, not to the parent key.
    assert store.get(key("c")) == u32(1, 2, 3)
    assert store.put(key("p"), 2, u32(4), [(key("c"), 1)], Kind.L1)
    assert store.get(key("c")) == u32(7, 7, 4)


def test_duplicate_entry_keeps_last(open_store: Open) -> None:
    store = open_store()
    assert store.put(None, 0, u32(1, 2, 3), [(key("k"), 1), (key("k"), 3)], Kind.AR)
    assert store.get(key("k")) == u32(1, 2, 3)
    assert store.stats().live_entries[Kind.AR] == 1


@both_widths
def test_put_refuses_missing_or_mismatched_parent(open_store: Open) -> None:
    store = open_store()
    assert not store.put(key("nope"), 0, u32(1), [(key("x"), 1)], Kind.L1)
    assert store.put(None, 0, u32(1, 2), [(key("p"), 2)], Kind.L1)
    assert not store.put(key("p"), 3, u32(1), [(key("x"), 1)], Kind.L1)
    assert store.get(key("x")) is None
    assert store.stats().puts == 1


@both_widths
def test_record_bigger_than_arena(open_store: Open, id_bytes: int) -> None:
    store = open_store(size=64 << 10)
    arena = store.stats().arena_bytes
    n_fit = (arena - 1024) // id_bytes  # what is stored, not what is passed, must fit
    assert not store.put(None, 0, bytes(4 * (arena // id_bytes)), [(key("big"), 1)], Kind.L0)
    assert store.get(key("big")) is None
    assert store.put(None, 0, bytes(4 * n_fit), [(key("big"), n_fit)], Kind.L0)
    assert store.get(key("big")) == bytes(4 * n_fit)


def test_argument_checks(open_store: Open) -> None:
    store = open_store()
    bad_calls: list[Callable[[], object]] = [
        lambda: store.get(b"short"),
        lambda: store.get(bytes(16)),
        lambda: store.put(None, 0, b"\x01\x02\x03", [(key(1), 0)], Kind.L0),
        lambda: store.put(None, 1, u32(1), [(key(1), 1)], Kind.L0),
        lambda: store.put(key(0), -1, u32(1), [(key(1), 1)], Kind.L0),
        lambda: store.put(None, 0, u32(1), [(key(1), 2)], Kind.L0),
        lambda: store.put(None, 0, u32(1), [(key(1), -1)], Kind.L0),
        lambda: store.put(None, 0, u32(1), [(b"short", 1)], Kind.L0),
        lambda: store.put(None, 0, u32(1), [], Kind.L0),
        lambda: store.put(None, 0, u32(1), [(key(1), 1)], 9),  # type: ignore[arg-type]
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    with pytest.raises(ValueError):
        open_store(size=1000)
    with pytest.raises(ValueError):
        open_store(ttl={Kind.L0: -1.0})


def test_close_and_unlink_are_idempotent(open_store: Open) -> None:
    store = open_store()
    assert store.put(None, 0, u32(1), [(key(1), 1)], Kind.L0)
    with store:
        pass
    store.close()
    with pytest.raises(StoreClosed):
        store.get(key(1))
    with pytest.raises(StoreClosed):
        store.put(None, 0, u32(1), [(key(1), 1)], Kind.L0)
    store.unlink()
    store.unlink()
    again = open_store()
    assert not again.attached_existing
    assert again.get(key(1)) is None


@both_widths
def test_deep_chain_is_consolidated(open_store: Open) -> None:
    store = open_store()
    parent: bytes | None = None
    for i in range(store_module.CONSOLIDATE_DEPTH + 10):
        assert store.put(parent, i, u32(i), [(key("deep", i), 1)], Kind.L1)
        parent = key("deep", i)
    last = key("deep", store_module.CONSOLIDATE_DEPTH + 9)
    want = u32(*range(store_module.CONSOLIDATE_DEPTH + 10))
    assert store.get(last) == want
    assert store.stats().consolidations == 1
    assert store.get(last) == want


@both_widths
def test_chain_longer_than_the_cap_is_a_miss(open_store: Open, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_log, "MAX_CHAIN", 8)
    store = open_store()
    parent: bytes | None = None
    for i in range(9):
        assert store.put(parent, i, u32(i), [(key("c", i), 1)], Kind.L1)
        parent = key("c", i)
    assert store.get(key("c", 7)) == u32(*range(8))
    assert store.get(key("c", 8)) is None


# --- property: the store equals a dict model while nothing is evicted -------------------

_op = st.tuples(
    st.integers(0, 30),  # parent: index into the keys put so far (or none)
    # Ids of a 24-bit vocabulary (its edges included), sometimes with one id past it.
    st.lists(st.one_of(st.integers(0, (1 << 24) - 1), st.sampled_from([0, 255, 1 << 16, (1 << 24) - 1])), max_size=16),
    st.one_of(st.none(), st.tuples(st.integers(1 << 24, U32_MAX), st.floats(0, 1))),
    st.lists(st.tuples(st.integers(0, 40), st.floats(0, 1)), min_size=1, max_size=5),
    st.booleans(),  # lie about parent_tokens
)


@both_widths
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, max_size=40))
def test_matches_reference_model(
    open_store: Open,
    id_bytes: int,
    ops: list[tuple[int, list[int], tuple[int, float] | None, list[tuple[int, float]], bool]],
) -> None:
    store = open_store(fingerprint=uuid.uuid4().hex)  # a fresh segment per example
    store_keys = [key("model", i) for i in range(41)]
    model: dict[bytes, bytes] = {}
    try:
        for parent_i, values, big, picks, lie in ops:
            if big is not None:  # an id outside a 24-bit vocabulary: a 3-byte segment refuses
                values = [*values]
                values.insert(int(big[1] * len(values)), big[0])
            ids = u32(*values)
            parent = store_keys[parent_i] if parent_i < len(store_keys) and parent_i % 3 else None
            n_ids = len(ids) // 4
            entries = [(store_keys[k], int(f * n_ids)) for k, f in picks]
            if parent is None:
                ok, prefix, tokens = True, b"", 0
            else:
                ok = parent in model
                prefix = model.get(parent, b"")
                tokens = len(prefix) // 4 + (1 if lie else 0)
                ok = ok and not lie
            ok = ok and not (big is not None and id_bytes == 3)
            assert (store.put(parent, tokens, ids, entries, Kind.L1) is not None) is ok
            if ok:
                for k, n in entries:
                    model[k] = prefix + ids[: 4 * n]
            for k in store_keys:
                assert store.get(k) == model.get(k)
    finally:
        store.unlink()
        store.close()


def test_foreign_errors_are_translated() -> None:
    for foreign in (posix_ipc.PermissionsError("nope"), posix_ipc.ExistentialError("gone"), OSError(28, "full")):
        with pytest.raises(SegmentError) as caught, translate("open /x"):
            raise foreign
        assert caught.value.__cause__ is foreign
        assert str(caught.value).startswith("open /x: ")
    with pytest.raises(LockTimeout), translate("lock /x"):
        raise LockTimeout("held")  # our own errors pass through


def test_holds_ar_turns_on_with_the_first_ar_record(shm_prefix: str) -> None:
    from tokcache.store import Kind, Store

    store = Store.open(prefix=shm_prefix, fingerprint="cd" * 16, size=2 << 20)
    try:
        assert not store.holds_ar()
        assert store.put(None, 0, (5).to_bytes(4, "little"), [(bytes(range(1, 17)), 1)], Kind.L1)
        assert not store.holds_ar()
        # An AR entry in a record of another kind counts too.
        assert store.put(None, 0, (6).to_bytes(4, "little"), [(bytes(range(2, 18)), 1, Kind.AR)], Kind.L1)
        assert store.holds_ar()
        again = Store.open(prefix=shm_prefix, fingerprint="cd" * 16, size=2 << 20)
        try:
            assert again.holds_ar()  # it lives in the segment, not the process
        finally:
            again.close()
    finally:
        store.unlink()
        store.close()
