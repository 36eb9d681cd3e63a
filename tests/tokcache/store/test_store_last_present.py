"""``last_present``: the longest-prefix search's one-call probe of many keys, and index population."""

from __future__ import annotations

import random
from collections.abc import Callable

from tests.tokcache.store.store_helpers import FINGERPRINT, FakeClock, conversations, full_key, key, mid_key, put_turn
from tokcache.store import Kind, Store, StoreReader
from tokcache.store._segment import populate, shm_path

Open = Callable[..., Store]


def _one_by_one(probe: Callable[[bytes], bool], keys: list[bytes], lo: int, hi: int) -> int:
    return next((i for i in range(hi - 1, lo - 1, -1) if probe(keys[i])), -1)


def test_last_present_is_probing_from_the_end(open_store: Open, shm_prefix: str) -> None:
    """Same answer as ``probe`` key by key, on a segment whose log has lapped (evicted
    keys whose slots still exist), for the writer and a read-only reader, any window."""
    store = open_store(size=256 << 10)
    for c, t in conversations(30, 8):
        put_turn(store, c, t)
    keys = [k for c, t in conversations(30, 8) for k in (full_key(c, t), mid_key(c, t))]
    keys += [key("absent", i) for i in range(20)]
    rng = random.Random(7)
    rng.shuffle(keys)
    present = sum(store.probe(k) for k in keys)
    assert 0 < present < len(keys)  # some evicted, some live: both kinds are exercised
    with StoreReader.attach(prefix=shm_prefix, fingerprint=FINGERPRINT) as reader:
        for _ in range(300):
            lo = rng.randrange(len(keys))
            hi = rng.randrange(lo, len(keys) + 1)
            want = _one_by_one(store.probe, keys, lo, hi)
            assert store.last_present(keys, lo, hi) == want
            assert reader.last_present(keys, lo, hi) == want
    assert store.last_present(keys, 5, 5) == -1


def test_last_present_skips_expired_keys(open_store: Open, clock: FakeClock) -> None:
    store = open_store(ttl={Kind.L0: 5.0}, clock=clock)
    ks = [key("ttl", i) for i in range(4)]
    store.put(None, 0, b"\x01\x00\x00\x00" * 4, [(ks[0], 1), (ks[1], 2)], Kind.L1)
    store.put(None, 0, b"\x02\x00\x00\x00" * 4, [(ks[2], 3, Kind.L0)], Kind.L1)
    assert store.last_present(ks, 0, 4) == 2
    clock.now += 6  # the L0 key expires, the L1 keys do not
    assert store.last_present(ks, 0, 4) == 1
    assert store.last_present(ks, 2, 4) == -1


def _rss_kib(path: str) -> list[int]:
    """Rss of each mapping of ``path`` in this process (from /proc/self/smaps)."""
    out: list[int] = []
    mapping = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line
                mapping = line.rstrip().endswith(path)
            elif mapping and head[0] == "Rss:":
                out.append(int(head[1]))
    return out


def test_populate_maps_the_index(open_store: Open, shm_prefix: str) -> None:
    """A reader's header and index are in its page tables from attach (no page fault on
    a first probe); populating again, or a range the kernel refuses, is harmless."""
    store = open_store(size=8 << 20)
    mm = store._segment.mm
    arena_off = store._segment.geometry.arena_off
    with StoreReader.attach(prefix=shm_prefix, fingerprint=FINGERPRINT) as reader:
        # The writer's mapping is of the file it created under a temporary name: only
        # the reader maps the file under its published name.
        rss = _rss_kib(shm_path(reader.name))
        assert len(rss) == 1 and rss[0] * 1024 >= arena_off > 1 << 20  # the whole index, before any probe
    assert populate(mm, arena_off)
    assert populate(mm, arena_off)  # again: nothing to do
    assert not populate(mm, -1)  # refused: reported, not raised
