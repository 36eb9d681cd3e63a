"""The cluster tier (tokcache.sidecar.tier) against real redis-server processes on loopback.

A single node and a three-node cluster (``redis-cli --cluster create``); failures are real:
SIGKILL of the server (or of one cluster node), then a restart on the same port.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.redis_servers import RedisCluster, RedisServer, cluster, server
from tokcache.ids import pack_ids
from tokcache.sidecar.config import ConfigError, load_config
from tokcache.sidecar.tier import (
    MAX_FETCH_KEYS,
    MIN_WRITE_TIMEOUT_S,
    WRITE_DEADLINES,
    ArTier,
    TierUrl,
    TierUrlError,
    decode_value,
    encode_value,
    redacted,
    tier_key,
)

FP = "0123456789abcdef0123456789abcdef"
# Event-loop latency allowed on top of a deadline (a shared, loaded machine).
LOOP_SLACK_S = 0.5
OTHER_FP = "f" * 32


def _keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[RedisServer]:
    with server(tmp_path / "redis") as s:
        yield s


@pytest.fixture
def three(tmp_path: Path) -> Iterator[RedisCluster]:
    with cluster(tmp_path / "cluster") as c:
        yield c


class Observed:
    """What the tier reported to its ``observe`` hook (the metrics do the same).

    The tier swallows what its hook raises (metrics must not fail a request), so a duration
    out of bounds is collected in ``wrong`` for the test to check, not asserted here."""

    def __init__(self, timeout_s: float) -> None:
        self.calls: list[tuple[str, str]] = []
        self.wrong: list[tuple[str, str, float]] = []
        # A fetch or write that reached the server ends within its deadline, plus the event
        # loop's latency; one that sent nothing (refused, dropped, a breaker change) took 0.
        self.limits = {"fetch": timeout_s + LOOP_SLACK_S,
                       "write": max(timeout_s * WRITE_DEADLINES, MIN_WRITE_TIMEOUT_S) + LOOP_SLACK_S}

    def __call__(self, op: str, result: str, seconds: float) -> None:
        self.calls.append((op, result))
        if op == "breaker" or result in ("refused", "dropped"):
            ok = seconds == 0.0
        else:
            ok = 0.0 < seconds <= self.limits[op]
        if not ok:
            self.wrong.append((op, result, seconds))

    def count(self, op: str, result: str) -> int:
        return self.calls.count((op, result))


# -- URLs and values (no server) -------------------------------------------------------------


@pytest.mark.parametrize(("url", "cluster_mode", "shown"), [
    ("redis://127.0.0.1:6379/0", False, "redis://127.0.0.1:6379/0"),
    ("rediss://user:s3cret@cache.example:6380/2", False, "rediss://cache.example:6380/2"),
    ("redis+cluster://:pw@10.0.0.1:7000", True, "redis+cluster://10.0.0.1:7000"),
    ("rediss+cluster://valkey.svc:6379", True, "rediss+cluster://valkey.svc:6379"),
])
def test_urls(url: str, cluster_mode: bool, shown: str) -> None:
    parsed = TierUrl.parse(url)
    assert parsed.cluster is cluster_mode and parsed.display == shown
    assert "+cluster" not in parsed.url and parsed.url.startswith(("redis://", "rediss://"))


@pytest.mark.parametrize("url", ["http://h:1", "redis://:secret@/0", "redis://h:99999", "redis://h:1/x",
                                 "redis+cluster://h:1/3", "h:6379"])
def test_bad_urls_name_the_flag_and_hide_the_password(url: str) -> None:
    with pytest.raises(TierUrlError) as info:
        TierUrl.parse(url)
    assert "secret" not in str(info.value)
    with pytest.raises(ConfigError) as cfg:
        load_config({"ar_store": url}, {})
    assert str(cfg.value).startswith("ar_store (--ar-store): ") and "secret" not in str(cfg.value)
    assert redacted("redis://u:secret@h:1/0") == "redis://h:1/0"


def test_config_from_env_and_timeout() -> None:
    cfg = load_config({}, {"TOKCACHE_AR_STORE": "redis://:pw@h:1/0", "TOKCACHE_AR_STORE_TIMEOUT_MS": "35"})
    assert cfg.ar_store == "redis://:pw@h:1/0" and cfg.ar_store_timeout_ms == 35.0
    assert "pw" not in repr(cfg)  # a Config is logged and printed: the URL is not in its repr
    with pytest.raises(ConfigError, match="ar_store_timeout_ms"):
        load_config({"ar_store_timeout_ms": "0"}, {})


def test_a_bad_url_stops_the_start_with_one_line(qwen3_path: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tokcache.sidecar.cli", "serve", "--listen",
                           f"unix://{tmp_path}/s.sock", "--model", f"q={qwen3_path}",
                           "--ar-store", "http://user:secret@tier:1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("tokcache-sidecar: ar_store (--ar-store): http://tier:1: the scheme must be")
    assert proc.stderr.count("\n") == 1 and "secret" not in proc.stderr


def test_values_carry_the_fingerprint() -> None:
    value = encode_value(FP, [1, 2, 70000])
    assert decode_value(value, FP) == [1, 2, 70000]
    assert decode_value(value, OTHER_FP) is None  # another tokenizer's record
    assert decode_value(value[:-1], FP) is None  # not whole ids
    assert decode_value(b"junk" + value[4:], FP) is None
    assert decode_value(encode_value(FP, b""), FP) is None  # no ids
    assert tier_key(FP, b"\x01" * 16) == b"tokcache:ar:" + FP.encode() + b":" + b"01" * 16


# -- one node --------------------------------------------------------------------------------


def test_write_then_fetch_in_one_round_trip(node: RedisServer) -> None:
    seen = Observed(timeout_s=0.5)

    async def main() -> None:
        tier = ArTier(TierUrl.parse(node.url), timeout_s=0.5, ttl_s=120, observe=seen)
        assert await tier.start()
        keys = _keys(5)
        assert tier.write(FP, [(k, pack_ids([i, i + 1])) for i, k in enumerate(keys[:3])]) == "queued"
        assert await tier.flush()
        got = await tier.fetch(FP, keys)
        assert got.result == "hit" and got.asked == 5
        assert {k: decode_value(v, FP) for k, v in got.values.items()} == {keys[0]: [0, 1], keys[1]: [1, 2],
                                                                         keys[2]: [2, 3]}
        assert (await tier.fetch(FP, _keys(3))).result == "miss"
        assert (await tier.fetch(OTHER_FP, keys)).result == "miss"  # keys are per tokenizer
        many = _keys(MAX_FETCH_KEYS) + keys  # more than one read asks: the newest are kept
        got = await tier.fetch(FP, many)
        assert got.asked == MAX_FETCH_KEYS and len(got.values) == 3
        await tier.close()

    asyncio.run(main())
    assert seen.count("write", "ok") == 1 and seen.count("fetch", "hit") == 2 and seen.count("fetch", "miss") == 2
    assert seen.wrong == []
    # One MGET for five keys (redis counts commands per type).
    assert "cmdstat_mget:calls=4," in node.cmd("INFO", "commandstats")
    ttl = int(node.cmd("TTL", tier_key(FP, b"\0" * 16).decode()).strip() or -2)
    assert ttl == -2  # absent key
    stored = node.cmd("KEYS", "tokcache:ar:*").split()
    assert len(stored) == 3 and all(0 < int(node.cmd("TTL", k)) <= 120 for k in stored)
    # Keys are hashes: no text is ever sent to the tier.
    assert all(len(k.rsplit(":", 1)[1]) == 32 for k in stored)


def test_a_killed_server_costs_one_deadline_then_the_breaker_refuses_then_it_comes_back(node: RedisServer) -> None:
    seen = Observed(timeout_s=0.05)

    async def main() -> None:
        tier = ArTier(TierUrl.parse(node.url), timeout_s=0.05, ttl_s=60, observe=seen, breaker_failures=2,
                      breaker_reset_s=0.5)
        assert await tier.start()
        keys = _keys(2)
        tier.write(FP, [(keys[0], pack_ids([7]))])
        assert await tier.flush()
        node.kill()
        results = []
        for _ in range(6):
            t0 = time.perf_counter()
            got = await tier.fetch(FP, keys)
            results.append(got.result)
            assert time.perf_counter() - t0 < 0.5  # never more than about one deadline
        assert results[:2] == ["error", "error"] and set(results[2:]) == {"refused"}
        assert tier.state == "open"
        assert tier.write(FP, [(keys[1], pack_ids([8]))]) == "refused"
        node.start()
        await asyncio.sleep(0.6)  # reset_s: the next call is the probe
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            got = await tier.fetch(FP, keys)
            if got.result in ("hit", "miss"):
                break
            await asyncio.sleep(0.6)
        assert got.result == "miss"  # the restarted server has no persistence: nothing there
        assert tier.state == "closed"
        await tier.close()

    asyncio.run(main())
    assert seen.count("fetch", "error") >= 2 and seen.count("fetch", "refused") >= 4
    assert seen.count("write", "refused") == 1
    # The breaker's changes, in order, as the metrics see them.
    assert [r for op, r in seen.calls if op == "breaker"] == ["open", "half_open", "closed"]
    assert seen.wrong == []


def test_metrics_follow_the_tier() -> None:
    from prometheus_client import generate_latest

    from tokcache.sidecar.telemetry import Metrics

    m = Metrics()
    text = generate_latest(m.registry).decode()
    assert "tokcache_tier_breaker_state 0.0" in text and 'tokcache_tier_lookups_total{result="error"} 0.0' in text
    m.observe_tier("fetch", "hit", 0.0002)
    m.observe_tier("write", "dropped", 0.0)
    m.observe_tier("breaker", "open", 0.0)
    m.observe_tier_records("qwen3", 2, 1)
    text = generate_latest(m.registry).decode()
    assert "tokcache_tier_breaker_state 2.0" in text
    assert 'tokcache_tier_lookups_total{result="hit"} 1.0' in text
    assert 'tokcache_tier_writes_total{result="dropped"} 1.0' in text
    assert 'tokcache_tier_duration_seconds_count{op="fetch"} 1.0' in text
    assert 'tokcache_tier_duration_seconds_count{op="write"} 0.0' in text  # a dropped write took no time
    assert 'tokcache_tier_records_total{model="qwen3",result="invalid"} 1.0' in text


def test_a_server_that_is_down_at_start_is_not_fatal(tmp_path: Path) -> None:
    port = RedisServer(tmp_path).port  # nothing listens there

    async def main() -> None:
        tier = ArTier(TierUrl.parse(f"redis://127.0.0.1:{port}/0"), timeout_s=0.05)
        assert not await tier.start()
        assert (await tier.fetch(FP, _keys(1))).result == "error"
        await tier.close()

    asyncio.run(main())


# -- cluster ---------------------------------------------------------------------------------


def test_cluster_mode_spreads_keys_and_reads_them_in_one_call(three: RedisCluster) -> None:
    async def main() -> None:
        tier = ArTier(TierUrl.parse(three.url), timeout_s=0.5, ttl_s=60)
        assert await tier.start()
        keys = _keys(60)
        tier.write(FP, [(k, pack_ids([i])) for i, k in enumerate(keys)])
        assert await tier.flush()
        got = await tier.fetch(FP, keys + _keys(5))
        assert got.result == "hit" and len(got.values) == 60
        assert [decode_value(got.values[k], FP) for k in keys] == [[i] for i in range(60)]
        await tier.close()

    asyncio.run(main())
    per_node = [int(n.cmd("DBSIZE").strip()) for n in three.nodes]
    assert sum(per_node) == 60 and all(per_node), per_node  # no hash tag: every master holds some


def test_cluster_node_killed_fails_open_and_recovers(three: RedisCluster) -> None:
    async def main() -> None:
        tier = ArTier(TierUrl.parse(three.url), timeout_s=0.1, ttl_s=60, breaker_failures=2, breaker_reset_s=0.5)
        assert await tier.start()
        keys = _keys(30)
        tier.write(FP, [(k, pack_ids([1])) for k in keys])
        assert await tier.flush()
        victim = three.nodes[1]
        victim.kill()
        outcomes = []
        for _ in range(8):
            t0 = time.perf_counter()
            outcomes.append((await tier.fetch(FP, keys)).result)
            assert time.perf_counter() - t0 < 1.0
            await asyncio.sleep(0.05)
        assert "error" in outcomes or "refused" in outcomes
        victim.start()
        three.wait_ok()
        deadline = time.monotonic() + 20
        got = None
        while time.monotonic() < deadline:
            got = await tier.fetch(FP, keys)
            if got.result == "hit":
                break
            await asyncio.sleep(0.3)
        assert got is not None and got.result == "hit"
        # The node came back empty (no persistence); the others' keys are read again.
        assert 0 < len(got.values) < 30
        await tier.close()

    asyncio.run(main())


# -- the feed: segment records, from whichever process, to the tier --------------------------

_CHILD_PUTS = """
import sys
from tokcache.ids import pack_ids
from tokcache.store import F_SEGMENT, Kind, Store
prefix, fp = sys.argv[1], sys.argv[2]
with Store.open(prefix=prefix, fingerprint=fp, size=1 << 20) as store:
    for i in range(3):
        assert store.put(None, 0, pack_ids([i, i + 7, i + 9]), [(bytes([i + 1]) * 16, 3)], Kind.AR, flags=F_SEGMENT)
    assert store.put(None, 0, pack_ids([5, 6]), [(bytes([9]) * 16, 2)], Kind.AR)  # a prompt chain: no F_SEGMENT
"""


class _Sent:
    """A tier that keeps what the feed hands it (ArTier.write's contract: "queued")."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []

    def write(self, fp: str, items: list[tuple[bytes, bytes]]) -> str:
        self.keys += [k for k, _ids in items]
        return "queued"


class _Failing:
    """A store whose next ``head``/``follow`` raise while ``failing`` is set (closed under the feed)."""

    def __init__(self, store: Any) -> None:
        self.store, self.name, self.failing = store, store.name, False

    def head(self) -> int:
        if self.failing:
            raise RuntimeError("closed")
        return int(self.store.head())

    def follow(self, cursor: int, *, limit: int) -> tuple[int, list[tuple[bytes, bytes]]]:
        if self.failing:
            raise RuntimeError("closed")
        return self.store.follow(cursor, limit=limit)  # type: ignore[no-any-return]


def test_a_failed_pass_resumes_where_the_feed_stopped(shm_prefix: str) -> None:
    """A pass that fails on a segment keeps its cursor: the next one sends what was recorded
    since, nothing twice and nothing skipped. A cursor past the head (the segment created again
    under its name) follows the new log from its oldest record."""
    from tokcache.sidecar.tier import TierFeed
    from tokcache.store import F_SEGMENT, Kind, Store

    def put(store: Store, key: bytes) -> None:
        assert store.put(None, 0, pack_ids([1, 2, 3]), [(key, 3)], Kind.AR, flags=F_SEGMENT)

    store = Store.open(prefix=shm_prefix, fingerprint=FP, size=1 << 20)
    try:
        put(store, b"\x01" * 16)
        sent, wrapped = _Sent(), _Failing(store)
        feed = TierFeed(sent, lambda: [(FP, wrapped)])  # type: ignore[arg-type]
        assert feed.feed() == 0  # first seen: followed from its head, as start() does
        put(store, b"\x02" * 16)
        assert feed.feed() == 1 and sent.keys == [b"\x02" * 16]
        wrapped.failing = True
        put(store, b"\x03" * 16)
        assert feed.feed() == 0
        wrapped.failing = False
        put(store, b"\x04" * 16)
        assert feed.feed() == 2 and sent.keys == [bytes([i]) * 16 for i in (2, 3, 4)]
        store.unlink()
        store.close()
        store = Store.open(prefix=shm_prefix, fingerprint=FP, size=1 << 20)
        assert store.head() < feed._cursors[store.name]
        put(store, b"\x05" * 16)
        wrapped.store = store
        assert feed.feed() == 1 and sent.keys[-1] == b"\x05" * 16
    finally:
        store.unlink()
        store.close()


def test_the_feed_writes_the_segment_records_appended_after_it_started(node: RedisServer, shm_prefix: str) -> None:
    """TierFeed follows each segment's log from where it stood at start: the F_SEGMENT records
    another process appends (a client's writer) reach the tier with their ids within a bounded
    wait; a record put before start, and records without F_SEGMENT (prompt chains), do not; a
    pass with nothing new writes nothing, and stop() feeds what came last."""
    from tokcache.sidecar.tier import TierFeed
    from tokcache.store import F_SEGMENT, Kind, Store

    store = Store.open(prefix=shm_prefix, fingerprint=FP, size=1 << 20)
    early = b"\x0e" * 16
    assert store.put(None, 0, pack_ids([1]), [(early, 1)], Kind.AR, flags=F_SEGMENT)
    fed = [bytes([i + 1]) * 16 for i in range(3)]

    async def main() -> None:
        tier = ArTier(TierUrl.parse(node.url), timeout_s=0.5, ttl_s=120)
        assert await tier.start()
        feed = TierFeed(tier, lambda: [(FP, store)])
        feed.start()
        child = await asyncio.create_subprocess_exec(sys.executable, "-c", _CHILD_PUTS, shm_prefix, FP,
                                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert await child.wait() == 0
        deadline = time.monotonic() + 10
        while len((got := await tier.fetch(FP, fed)).values) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert {k: decode_value(v, FP) for k, v in got.values.items()} == {
            k: [i, i + 7, i + 9] for i, k in enumerate(fed)}
        assert (await tier.fetch(FP, [early, b"\x09" * 16])).result == "miss"
        assert feed.feed() == 0  # caught up: nothing written twice
        last = b"\x0f" * 16
        assert store.put(None, 0, pack_ids([4, 2]), [(last, 2)], Kind.AR, flags=F_SEGMENT)
        await feed.stop()
        assert await tier.flush()
        got = await tier.fetch(FP, [last])
        assert {k: decode_value(v, FP) for k, v in got.values.items()} == {last: [4, 2]}
        await tier.close()

    try:
        asyncio.run(main())
    finally:
        store.unlink()
        store.close()
