"""Re-attaching a warm segment, and replacing one this opener cannot use."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from tests.tokcache.store.store_helpers import ids_of, key
from tokcache.store import Kind, Store, _layout
from tokcache.store._segment import shm_path

Open = Callable[..., Store]
both_widths = pytest.mark.parametrize("id_bytes", _layout.ID_WIDTHS)


def _fill(store: Store) -> None:
    assert store.put(None, 0, ids_of("a"), [(key("a"), 1)], Kind.L0)


def _patch(store: Store, offset: int, data: bytes) -> None:
    with open(shm_path(store.name), "r+b") as f:
        f.seek(offset)
        f.write(data)


@both_widths
def test_reopen_is_warm(open_store: Open, id_bytes: int) -> None:
    first = open_store()
    _fill(first)
    first.close()
    second = open_store()
    assert second.attached_existing
    assert second.id_bytes == id_bytes
    assert second.get(key("a")) == ids_of("a")[:4]
    assert second.stats().puts == 1  # the shared counters survive too


@both_widths
def test_two_handles_share_one_segment(open_store: Open) -> None:
    first = open_store()
    second = open_store()
    assert second.attached_existing
    _fill(first)
    assert second.get(key("a")) == ids_of("a")[:4]


def test_other_fingerprint_is_another_segment(open_store: Open) -> None:
    first = open_store()
    _fill(first)
    other = open_store(fingerprint="f" * 32)
    assert not other.attached_existing
    assert other.name != first.name
    assert other.get(key("a")) is None
    assert first.get(key("a")) == ids_of("a")[:4]


def test_other_size_replaces(open_store: Open) -> None:
    first = open_store()
    _fill(first)
    bigger = open_store(size=2 << 20)
    assert not bigger.attached_existing
    assert bigger.get(key("a")) is None
    assert os.stat(shm_path(bigger.name)).st_size == 2 << 20
    # The old handle learns it was replaced: its writes would go nowhere, so it refuses.
    assert first.replaced
    assert not first.put(None, 0, ids_of("b"), [(key("b"), 1)], Kind.L0)
    assert not bigger.replaced


def test_bumped_layout_version_replaces(open_store: Open, monkeypatch: pytest.MonkeyPatch) -> None:
    first = open_store()
    _fill(first)
    first.close()
    monkeypatch.setattr(_layout, "LAYOUT_VERSION", _layout.LAYOUT_VERSION + 1)
    second = open_store()
    assert not second.attached_existing
    assert second.get(key("a")) is None
    second.close()
    monkeypatch.undo()
    third = open_store()  # and back: the newer layout is replaced in turn
    assert not third.attached_existing


@pytest.mark.parametrize(
    "offset",
    [0, 8, 16, 24, 40, 56, 90, _layout.STATIC_CHECK_OFF, _layout.STATIC_CHECK_OFF + 15],
)
def test_corrupted_static_header_replaces(open_store: Open, offset: int) -> None:
    first = open_store()
    _fill(first)
    first.close()
    with open(shm_path(first.name), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))
    second = open_store()
    assert not second.attached_existing
    assert second.get(key("a")) is None


def test_dynamic_header_is_not_checked_on_attach(open_store: Open) -> None:
    first = open_store()
    _fill(first)
    first.close()
    _patch(first, _layout.W_HITS * 8, (12345).to_bytes(8, "little"))
    second = open_store()
    assert second.attached_existing
    assert second.stats().hits == 12345


def test_truncated_or_foreign_file_is_replaced(open_store: Open) -> None:
    first = open_store()
    name = first.name
    first.unlink()
    first.close()
    with open(shm_path(name), "wb") as f:
        f.write(b"not a segment")
    second = open_store()
    assert not second.attached_existing
    assert second.get(key("a")) is None
    assert os.stat(shm_path(name)).st_size == second.size


def test_stale_temporaries_are_removed(open_store: Open) -> None:
    first = open_store()
    stale = shm_path(first.name + ".new-1-deadbeef")
    with open(stale, "wb") as f:
        f.write(b"x")
    os.utime(stale, (0, 0))
    open_store()
    assert not os.path.exists(stale)
