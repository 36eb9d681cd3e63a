"""The chain memo never outlives the record it copied."""

from __future__ import annotations

from tokcache.engine.memo import ChainMemo
from tokcache.store import Kind, Store

KEY = bytes(range(1, 17))
PARENT = bytes(range(2, 18))


def _ids(*xs: int) -> bytes:
    return b"".join(x.to_bytes(4, "little") for x in xs)


def test_memo_follows_record_versions(shm_prefix: str) -> None:
    store = Store.open(prefix=shm_prefix, fingerprint="ab" * 16, size=2 << 20)
    try:
        memo = ChainMemo(max_bytes=1 << 20)
        assert store.put(None, 0, _ids(1, 2, 3), [(KEY, 3)], Kind.L1)
        memo.put(store, KEY, _ids(1, 2, 3))
        assert memo.get(store, KEY) == _ids(1, 2, 3)
        # Re-put with other ids: the version changes, the memo misses.
        assert store.put(None, 0, _ids(7, 8), [(KEY, 2)], Kind.L1)
        assert memo.get(store, KEY) is None
        assert store.get(KEY) == _ids(7, 8)
        # Evicted by filling the log: a miss, never the old copy.
        memo.put(store, KEY, _ids(7, 8))
        for i in range(4000):
            store.put(None, 0, _ids(*range(100)), [((i + 1000).to_bytes(16, "little"), 100)], Kind.L1)
        assert store.get(KEY) is None
        assert memo.get(store, KEY) is None
        # The byte budget holds.
        small = ChainMemo(max_bytes=64)
        store.put(None, 0, _ids(*range(10)), [(PARENT, 10)], Kind.L1)
        small.put(store, PARENT, _ids(*range(10)))
        store.put(None, 0, _ids(*range(10)), [(KEY, 10)], Kind.L1)
        small.put(store, KEY, _ids(*range(10)))
        assert small.get(store, PARENT) is None and small.get(store, KEY) == _ids(*range(10))
    finally:
        store.unlink()
        store.close()
