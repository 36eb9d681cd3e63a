"""tokcache.ids: the packed-u32 format, its C packer checked against ``array`` (the reference);
common_prefix."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokcache import ids as ids_mod
from tokcache.ids import common_prefix, pack_ids, unpack_ids

U32_MAX = (1 << 32) - 1


@given(st.lists(st.integers(0, U32_MAX), max_size=200))
def test_pack_matches_array_and_round_trips(values: list[int]) -> None:
    ref = array("I", values).tobytes()
    assert pack_ids(values) == ref  # a list: the C pass, when built
    assert pack_ids(iter(values)) == ref  # any other iterable: array
    assert unpack_ids(ref) == values
    if ids_mod._native is not None:
        assert ids_mod._native.pack(values) == ref


@pytest.mark.parametrize("bad, error", [([-1], OverflowError), ([1 << 32], OverflowError), ([1, 2.0], TypeError),
                                        (["7"], TypeError), ([None], TypeError)])
def test_pack_refuses_what_is_not_a_u32_like_array_does(bad: list[object], error: type[Exception]) -> None:
    with pytest.raises(error):
        array("I", bad)  # type: ignore[arg-type]
    with pytest.raises(error):
        pack_ids(bad)  # type: ignore[arg-type]
    if ids_mod._native is not None:
        with pytest.raises(error):
            ids_mod._native.pack(bad)
        with pytest.raises(TypeError):
            ids_mod._native.pack((1, 2))  # a list only: other iterables go through array


def test_pack_takes_bools_and_int_subclasses_as_array_does() -> None:
    class Id(int):
        pass

    values = [True, Id(5), 0, U32_MAX]
    assert pack_ids(values) == array("I", values).tobytes()


@given(st.lists(st.integers(0, 9), max_size=30), st.lists(st.integers(0, 9), max_size=30))
def test_common_prefix_is_the_longest_shared_start(a: list[int], b: list[int]) -> None:
    n = common_prefix(a, b)
    assert a[:n] == b[:n] and (n == min(len(a), len(b)) or a[n] != b[n])
    assert common_prefix(a, a + b) == len(a)
