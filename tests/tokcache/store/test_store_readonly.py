"""Read-only attach (co-located readers), read_stats, the L0 key helper, stale temporaries."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.tokcache.store import store_helpers as helpers
from tests.tokcache.store.store_helpers import FINGERPRINT, conversations, expected, ids_of, key, put_turn
from tokcache.store import (
    DirectLookup,
    Kind,
    SegmentError,
    SegmentMismatch,
    Store,
    StoreReader,
    l0_key,
    read_stats,
)
from tokcache.store._layout import ID_WIDTHS
from tokcache.store._segment import shm_path, temp_name
from tokcache.store.keys import MODE_EXACT, MODE_KV_STABLE, KeyStream

Open = Callable[..., Store]
SPAWN = multiprocessing.get_context("spawn")
both_widths = pytest.mark.parametrize("id_bytes", ID_WIDTHS)


def _digest(store: Store) -> str:
    with open(shm_path(store.name), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@both_widths
def test_reader_sees_what_writers_put_and_writes_nothing(open_store: Open, shm_prefix: str, id_bytes: int) -> None:
    store = open_store(size=256 << 10)
    want: dict[bytes, bytes] = {}
    for c, t in conversations(30, 8):  # laps the log: old chains are gone, hot ones near the tail
        put_turn(store, c, t)
        want.update(expected(c, t))
    with StoreReader.attach(prefix=shm_prefix, fingerprint=FINGERPRINT) as reader:
        assert reader.size == 256 << 10 and reader.fingerprint == FINGERPRINT
        assert reader.id_bytes == reader.stats().id_bytes == id_bytes
        hits = 0
        for _ in range(3):
            for k, ids in want.items():
                got = reader.get(k)
                assert got == store.get(k) if got is None else got == ids
                hits += got is not None
        assert hits > 0
        assert reader.get(key("absent")) is None
        with pytest.raises(TypeError):  # the mapping itself is read-only
            reader._segment.mm[0] = 1
    store_stats_before = store.stats()
    # Reads through the reader alone leave every byte as it was (store.get above may
    # have touched LRU stamps or copied chains forward: take the snapshot after it).
    snapshot = _digest(store)
    with StoreReader.attach(prefix=shm_prefix, fingerprint=FINGERPRINT) as reader:
        for k in want:
            reader.get(k)
        assert reader.stats().hits == store_stats_before.hits
    assert _digest(store) == snapshot


@both_widths
def test_reader_in_another_process(open_store: Open, shm_prefix: str) -> None:
    store = open_store()
    want: dict[bytes, bytes] = {}
    for c, t in conversations(5, 6):
        put_turn(store, c, t)
        want.update(expected(c, t))
    keys = [*want, key("absent")]
    with SPAWN.Pool(1) as pool:
        got = pool.apply(helpers.child_read_only, (shm_prefix, keys))
    assert got == [*want.values(), None]


def test_attach_readonly_never_creates_or_replaces(open_store: Open, shm_prefix: str) -> None:
    with pytest.raises(SegmentError):
        StoreReader.attach(prefix=shm_prefix, fingerprint=FINGERPRINT)
    assert not os.path.exists(shm_path(f"/{shm_prefix}-{FINGERPRINT}"))
    store = open_store()
    store.close()
    with open(shm_path(store.name), "r+b") as f:
        f.seek(8)
        f.write((99).to_bytes(4, "little"))  # another layout version
    snapshot = open(shm_path(store.name), "rb").read()
    with pytest.raises(SegmentMismatch):
        StoreReader.attach(prefix=shm_prefix, fingerprint=FINGERPRINT)
    assert open(shm_path(store.name), "rb").read() == snapshot


def test_reader_notices_replacement(open_store: Open, shm_prefix: str) -> None:
    store = open_store()
    assert store.put(None, 0, ids_of("a"), [(key("a"), 1)], Kind.L0)
    reader = StoreReader.attach(prefix=shm_prefix, fingerprint=FINGERPRINT)
    try:
        assert not reader.replaced
        open_store(size=2 << 20)  # another size: replaces the segment
        assert reader.replaced
        assert reader.get(key("a")) == ids_of("a")[:4]  # the old mapping still reads
    finally:
        reader.close()


def test_read_stats_lists_segments_of_the_prefix_only(open_store: Open, shm_prefix: str) -> None:
    first = open_store()
    second = open_store(fingerprint="ab" * 16, ttl={Kind.L0: 100.0})
    other = open_store(prefix=shm_prefix + "-x")  # another prefix that starts with ours
    for i in range(10):
        assert second.put(None, 0, ids_of(i), [(key(i), 1, Kind.L0), (key("l1", i), 1)], Kind.L1)
    for store in (first, second):
        store.get(key(0))
    with open(shm_path(first.name + ".new-1-2-deadbeef"), "wb") as f:  # a creator's temporary
        f.write(b"x")
    stats = read_stats(shm_prefix)
    json.dumps(stats)
    assert [s["name"] for s in stats] == sorted(s.name.lstrip("/") for s in (first, second))
    by_fp = {s["fingerprint"]: s for s in stats}
    s2 = by_fp["ab" * 16]
    assert s2["capacity"] == second.size
    assert s2["live_entries"] == {"L0": 10, "L1": 10, "AR": 0}
    assert s2["puts"] == 10 and s2["hits"] == 1
    assert s2["evictions_by_cause"] == {"cap": 0, "ttl": 0, "pressure": 0}
    assert s2["used_bytes"] > 0 and s2["soft_cap"] == s2["arena_bytes"]
    assert 0 < s2["resident_bytes"] <= s2["capacity"]
    assert by_fp[FINGERPRINT]["misses"] == 1
    assert read_stats(shm_prefix + "-x")[0]["name"] == other.name.lstrip("/")
    assert read_stats("no-such-prefix-" + shm_prefix) == []


def test_read_stats_reports_unreadable_segments(open_store: Open, shm_prefix: str) -> None:
    store = open_store()
    store.close()
    with open(shm_path(store.name), "r+b") as f:
        f.write(b"garbage!")
    (item,) = read_stats(shm_prefix)
    assert "error" in item and item["fingerprint"] == FINGERPRINT


def test_stats_command_prints_json(open_store: Open, shm_prefix: str) -> None:
    open_store()
    out = subprocess.run(
        [sys.executable, "-m", "tokcache.sidecar.cli", "stats", "--shm-prefix", shm_prefix],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (item,) = json.loads(out.stdout)
    assert item["fingerprint"] == FINGERPRINT


@pytest.mark.parametrize("mode, tag", [("kv-stable", MODE_KV_STABLE), ("exact", MODE_EXACT)])
def test_l0_key_is_the_engine_key(mode: str, tag: bytes) -> None:
    text = "<|im_start|>user\nhi 你好<|im_end|>\n"
    stream = KeyStream("tenant", tag)
    for piece in (text[:12], text[12:20], text[20:]):  # the engine feeds cut by cut
        stream.feed(piece.encode())
    assert l0_key(text, salt="tenant", mode=mode) == stream.exact_key()
    assert l0_key(text.encode(), salt="tenant", mode=mode) == stream.exact_key()
    assert l0_key(text, salt="other", mode=mode) != stream.exact_key()
    with pytest.raises(ValueError):
        l0_key(text, mode="fast")


@both_widths
def test_direct_lookup_attaches_lazily_and_again(open_store: Open, shm_prefix: str) -> None:
    lookup = DirectLookup(prefix=shm_prefix, fingerprint=FINGERPRINT, retry_interval=0.0)
    try:
        assert lookup.get("hello") is None  # no segment yet: a miss, not an error
        store = open_store()
        ids = ids_of("hello", n=3)
        assert store.put(None, 0, ids, [(l0_key("hello"), 3, Kind.L0)], Kind.L1)
        assert lookup.get("hello") == ids
        assert lookup.get_ids("hello") == [int.from_bytes(ids[i : i + 4], "little") for i in range(0, 12, 4)]
        assert lookup.get("hello", mode="exact") is None
        assert lookup.get("\ud800") is None  # lone surrogate: refused like the server does
        replacement = open_store(size=2 << 20)
        assert replacement.put(None, 0, ids[:4], [(l0_key("hello"), 1, Kind.L0)], Kind.L1)
        assert lookup.get("hello") == ids[:4]  # re-attached to the new segment
    finally:
        lookup.close()


def test_dead_creators_temporary_is_removed_at_once(open_store: Open) -> None:
    store = open_store()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    live = shm_path(temp_name(store.name))  # ours: alive
    name = temp_name(store.name).rsplit("-", 2)[0] + f"-{proc.pid}-cafebabe"  # same pidns, dead pid
    dead = shm_path(name)
    for path in (live, dead):
        with open(path, "wb") as f:
            f.write(b"x")
    open_store()
    assert not os.path.exists(dead)
    assert os.path.exists(live)
    os.unlink(live)
