"""The bounded record queue: never blocks, drops when full, drains in batches per (model, trace)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from sidecar_client.vllm._recorder import PendingRecord, RecordQueue
from sidecar_client.vllm._stats import PluginStats


def rec(i: int, model: str = "m", trace: tuple[tuple[str, str], ...] = ()) -> PendingRecord:
    return PendingRecord(model, {"prompt_text": f"p{i}"}, trace)


def test_offer_drops_when_full_without_a_loop() -> None:
    stats = PluginStats()

    async def never(model: str, records: list[Mapping[str, Any]], trace: Any) -> None:
        raise AssertionError("no loop, no drainer")

    q = RecordQueue(3, never, stats)
    assert [q.offer(rec(i)) for i in range(5)] == [True, True, True, False, False]
    assert len(q) == 3 and stats.records["queued"] == 3 and stats.records["dropped"] == 2
    assert [r.record["prompt_text"] for r in q.take_batch()] == ["p0", "p1", "p2"]  # oldest kept, FIFO


def test_drainer_batches_and_groups_by_model_and_trace() -> None:
    stats = PluginStats()
    sent: list[tuple[str, list[str], Any]] = []

    async def send(model: str, records: list[Mapping[str, Any]], trace: Any) -> None:
        sent.append((model, [r["prompt_text"] for r in records], trace))

    async def main() -> None:
        q = RecordQueue(100, send, stats, batch=4)
        t = (("traceparent", "00-abc-def-01"),)
        for i, (model, trace) in enumerate([("m", ()), ("m", t), ("m", ()), ("x", ()), ("m", ()), ("m", ())]):
            q.offer(rec(i, model, trace))  # all queued before the drainer first runs
        await q.aclose()

    asyncio.run(main())
    assert sent == [("m", ["p0", "p2"], ()), ("m", ["p1"], (("traceparent", "00-abc-def-01"),)),
                    ("x", ["p3"], ()), ("m", ["p4", "p5"], ())]


def test_a_slow_sender_never_blocks_offer() -> None:
    stats = PluginStats()
    release = asyncio.Event()

    async def slow(model: str, records: list[Mapping[str, Any]], trace: Any) -> None:
        await release.wait()

    async def main() -> list[bool]:
        q = RecordQueue(2, slow, stats, batch=1)
        q.offer(rec(0))
        await asyncio.sleep(0.01)  # the drainer took rec 0 and is stuck sending it
        results = [q.offer(rec(i)) for i in range(1, 5)]
        release.set()
        await q.aclose()
        return results

    assert asyncio.run(main()) == [True, True, False, False]
    assert stats.records["dropped"] == 2


def test_send_failures_are_counted_and_draining_continues() -> None:
    stats = PluginStats()
    calls = []

    async def flaky(model: str, records: list[Mapping[str, Any]], trace: Any) -> None:
        calls.append(len(records))
        if len(calls) == 1:
            raise RuntimeError("transport down")

    async def main() -> None:
        q = RecordQueue(10, flaky, stats, batch=2)
        for i in range(4):
            q.offer(rec(i))
        await q.aclose()

    asyncio.run(main())
    assert calls == [2, 2] and stats.records["failed"] == 2


def test_closed_queue_refuses() -> None:
    stats = PluginStats()

    async def send(model: str, records: list[Mapping[str, Any]], trace: Any) -> None:
        return None

    async def main() -> bool:
        q = RecordQueue(10, send, stats)
        await q.aclose()
        return q.offer(rec(0))

    assert asyncio.run(main()) is False


def conv(prompt: str, output: str, salt: str | None = None) -> PendingRecord:
    return PendingRecord("m", {"prompt_text": prompt, "output_text": output, "cache_salt": salt})


def test_the_next_turn_waits_for_its_own_pending_record_only() -> None:
    stats = PluginStats()
    release = asyncio.Event()

    async def slow(model: str, records: list[Mapping[str, Any]], trace: Any) -> None:
        await release.wait()

    async def main() -> None:
        q = RecordQueue(10, slow, stats)
        q.offer(conv("<user>hi<assistant>", "Hello!"))
        await asyncio.sleep(0)  # in flight now
        nxt = "<user>hi<assistant>Hello!<end><user>more<assistant>"
        assert q.related(nxt, None)
        assert not q.related(nxt, "other-salt")  # salts never mix
        assert not q.related("<user>something else<assistant>", None)
        assert await q.wait_related("<user>something else<assistant>", None, 5.0)  # no wait at all
        assert await q.wait_related(nxt, None, 0.05) is False  # bounded
        waiter = asyncio.ensure_future(q.wait_related(nxt, None, 5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        release.set()
        assert await waiter is True
        await q.aclose()

    asyncio.run(main())
