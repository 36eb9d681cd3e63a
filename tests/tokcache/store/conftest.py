"""Fixtures for the shared-memory store tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.tokcache.store.store_helpers import FINGERPRINT, FakeClock
from tokcache.store import Store

SIZE = 1 << 20


@pytest.fixture
def id_bytes() -> int:
    """The id width of the segments ``open_store`` creates: tests that must hold for
    both widths parametrize ``id_bytes`` over ``_layout.ID_WIDTHS`` (which overrides this)."""
    return 4


@pytest.fixture
def open_store(shm_prefix: str, id_bytes: int) -> Iterator[Callable[..., Store]]:
    """Open stores under the test's unique prefix; all are closed and unlinked after."""
    opened: list[Store] = []

    def factory(**kwargs: Any) -> Store:
        kwargs.setdefault("prefix", shm_prefix)
        kwargs.setdefault("fingerprint", FINGERPRINT)
        kwargs.setdefault("size", SIZE)
        kwargs.setdefault("id_bytes", id_bytes)
        store = Store.open(**kwargs)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.unlink()
        store.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
