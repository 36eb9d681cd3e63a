"""The plugin's sidecar link against a fake sidecar: handshake, deadline, breaker, trace metadata."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc

from sidecar_client.vllm._config import PluginConfig
from sidecar_client.vllm._link import Served, SidecarLink
from sidecar_client.vllm._stats import PluginStats
from tests.vllm.fake_sidecar import FakeSidecar, ids_for, record_ids, run

FP = "f" * 32
OTHER = "0" * 32
TRACE = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), ("tracestate", "k=v"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def link_for(address: str, fingerprint: str | None = FP, clock: Clock | None = None, **cfg: object) -> SidecarLink:
    cfg.setdefault("timeout_s", 2.0)  # a loaded CI machine; the deadline test sets its own
    config = PluginConfig(address=address, **cfg)  # type: ignore[arg-type]
    return SidecarLink(config, fingerprint, PluginStats(), tokenizer_file="/models/m/tokenizer.json",
                       clock=clock or time.monotonic)


def test_handshake_by_fingerprint_then_tokenize_with_salt_mode_and_trace(tmp_path: Path) -> None:
    async def main() -> None:
        async with FakeSidecar(tmp_path, {"other": OTHER, "mine": FP}) as fake:
            link = link_for(fake.address)
            out = await link.tokenize("hello", add_special_tokens=True, cache_salt="s1", trace=TRACE)
            assert isinstance(out, Served)
            assert out.token_ids == ids_for("hello") and out.model == "mine" and out.source == "miss"
            assert link.ready and link.status().handshake == "ready"
            req, metadata = fake.state.tokenize_calls[0]
            assert req.model == "mine" and req.cache_salt == "s1" and req.add_special_tokens is True
            assert req.mode == 1  # TOKENIZE_MODE_KV_STABLE
            assert metadata["traceparent"] == TRACE[0][1] and metadata["tracestate"] == "k=v"
            again = await link.tokenize("hello", add_special_tokens=False, cache_salt=None)
            assert isinstance(again, Served) and again.source == "l0"
            assert fake.state.list_calls == 1  # one handshake
            await link.close()

    run(main())


def test_named_model_with_another_tokenizer_is_refused_then_rechecked(tmp_path: Path, caplog: object) -> None:
    clock = Clock()

    async def main() -> None:
        async with FakeSidecar(tmp_path, {"qwen3": OTHER}) as fake:
            link = link_for(fake.address, clock=clock, model="qwen3", breaker_reset_s=5)
            assert await link.tokenize("x", add_special_tokens=False, cache_salt=None) == "handshake_refused"
            assert link.handshake == "refused"
            assert OTHER in link.reason and FP in link.reason and "a different tokenizer" in link.reason
            assert await link.tokenize("x", add_special_tokens=False, cache_salt=None) == "handshake_refused"
            assert fake.state.list_calls == 1 and not fake.state.tokenize_calls  # not re-asked before the reset
            fake.state.models["qwen3"] = FP  # the operator fixed the sidecar
            clock.now += 5
            assert isinstance(await link.tokenize("x", add_special_tokens=False, cache_salt=None), Served)
            await link.close()

    run(main())


def test_no_model_serves_this_tokenizer(tmp_path: Path) -> None:
    async def main() -> None:
        async with FakeSidecar(tmp_path, {"llama": OTHER}) as fake:
            link = link_for(fake.address)
            assert await link.tokenize("x", add_special_tokens=False, cache_salt=None) == "handshake_refused"
            assert "llama=" + OTHER in link.reason
            await link.close()

    run(main())


def test_without_a_fingerprint_the_path_stays_off(tmp_path: Path) -> None:
    async def main() -> None:
        async with FakeSidecar(tmp_path, {"m": FP}) as fake:
            link = link_for(fake.address, fingerprint=None)
            assert await link.tokenize("x", add_special_tokens=False, cache_salt=None) == "no_fingerprint"
            assert fake.state.list_calls == 0
            await link.close()

    run(main())


def test_dead_sidecar_opens_the_breaker_and_a_restarted_one_closes_it(tmp_path: Path) -> None:
    async def main() -> None:
        fake = FakeSidecar(tmp_path, {"m": FP})
        link = link_for(fake.address, breaker_failures=2, breaker_reset_s=0.2)
        t0 = time.monotonic()
        reasons = [await link.tokenize("x", add_special_tokens=False, cache_salt=None) for _ in range(4)]
        assert time.monotonic() - t0 < 1.0  # nothing listens: fail fast, no deadline wait
        assert reasons[-1] == "breaker_open" and link.breaker.state == "open"
        await fake.start()
        try:
            deadline = time.monotonic() + 5
            out: Served | str = ""
            while time.monotonic() < deadline:
                out = await link.tokenize("x", add_special_tokens=False, cache_salt=None)
                if isinstance(out, Served):
                    break
                await asyncio.sleep(0.1)
            assert isinstance(out, Served) and link.breaker.state == "closed"
        finally:
            await link.close()
            await fake.stop()

    run(main())


def test_a_hung_sidecar_costs_one_deadline_per_call_until_the_breaker_opens(tmp_path: Path) -> None:
    async def main() -> None:
        async with FakeSidecar(tmp_path, {"m": FP}) as fake:
            link = link_for(fake.address, timeout_s=0.25, breaker_failures=2, breaker_reset_s=60)
            # A healthy sidecar first. The handshake (channel + ListModels) and the first call
            # may each outlast a 0.25 s deadline on a loaded CI machine (CI saw a
            # "handshake_pending"), so wait for the handshake and allow one slow first call:
            # a success closes the breaker again.
            link.start_handshake()
            deadline = time.monotonic() + 10
            while link.status().handshake != "ready" and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            first = [await link.tokenize("x", add_special_tokens=False, cache_salt=None)]
            if not isinstance(first[0], Served):
                first.append(await link.tokenize("x", add_special_tokens=False, cache_salt=None))
            assert isinstance(first[-1], Served), first
            fake.state.delay = 2.0
            times = []
            for _ in range(3):
                t0 = time.monotonic()
                times.append((await link.tokenize("x", add_special_tokens=False, cache_salt=None),
                              time.monotonic() - t0))
            assert [r for r, _ in times] == ["deadline", "deadline", "breaker_open"]
            # Each costs its deadline, not the sidecar's 2 s delay; the open breaker costs nothing.
            assert all(0.24 < dt < 1.5 for _, dt in times[:2]) and times[2][1] < 0.05
            await link.close()

    run(main())


def test_a_changed_fingerprint_is_caught_and_handshaken_again(tmp_path: Path) -> None:
    async def main() -> None:
        async with FakeSidecar(tmp_path, {"m": FP}) as fake:
            link = link_for(fake.address)
            assert isinstance(await link.tokenize("x", add_special_tokens=False, cache_salt=None), Served)
            fake.state.models["m"] = OTHER  # restarted with another tokenizer under the same name
            assert await link.tokenize("x", add_special_tokens=False, cache_salt=None) == "fingerprint_changed"
            assert await link.tokenize("x", add_special_tokens=False, cache_salt=None) == "handshake_refused"
            await link.close()

    run(main())


def test_invalid_argument_does_not_trip_the_breaker(tmp_path: Path) -> None:
    async def main() -> None:
        async with FakeSidecar(tmp_path, {"m": FP}) as fake:
            link = link_for(fake.address, breaker_failures=1)
            assert isinstance(await link.tokenize("x", add_special_tokens=False, cache_salt=None), Served)
            fake.state.fail = grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await link.tokenize("x", add_special_tokens=False, cache_salt=None) == "too_large"
            fake.state.fail = grpc.StatusCode.INVALID_ARGUMENT
            assert await link.tokenize("x", add_special_tokens=False, cache_salt=None) == "rejected"
            assert link.breaker.state == "closed"
            fake.state.fail = grpc.StatusCode.INTERNAL
            assert await link.tokenize("x", add_special_tokens=False, cache_salt=None) == "sidecar_error"
            assert link.breaker.state == "open"
            await link.close()

    run(main())


def test_record_sends_one_stream_with_trace_and_counts_refusals(tmp_path: Path) -> None:
    async def main() -> None:
        async with FakeSidecar(tmp_path, {"m": FP}) as fake:
            link = link_for(fake.address)
            await link.tokenize("p", add_special_tokens=False, cache_salt=None)
            records = [{"prompt_text": "p", "prompt_token_ids": [1, 2], "output_text": f"o{i}",
                        "output_token_ids": [3, i], "finish_reason": "length", "stop_reason": None,
                        "cache_salt": "s", "prompt_add_special_tokens": False} for i in range(3)]
            await link.record("m", records, TRACE)
            assert link.stats.records["recorded"] == 3
            (first, metadata), *_ = fake.state.records
            assert first.prompt_text == "p" and record_ids(first, "prompt_token_ids") == [1, 2]
            assert first.cache_salt == "s" and first.finish_reason == "length"
            assert metadata["traceparent"] == TRACE[0][1]
            fake.state.refuse = True
            await link.record("m", records[:2], ())
            assert link.stats.records["refused"] == 2
            await link.record("another-model", records[:1], ())  # the sidecar model changed meanwhile
            assert link.stats.record_skips["sidecar_changed"] == 1
            await link.close()

    run(main())
