"""Fail open: a dead or hung sidecar never fails a request, nor slows one.

vLLM's process reads prompts and records outputs in the node's shared memory itself, so
neither needs the sidecar while its segment stays mapped; the sidecar that comes back
re-attaches the same memory. Runs after the other plugin tests (it kills and restarts the
shared sidecar). The plugin server runs with a 2 s deadline (harness.DEADLINE_S), 3 failures
to open the breaker, and a 1 s breaker reset (conftest.PLUGIN_ENV), for what still goes over
RPC (a process that cannot map the segment: tests/vllm).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable

from e2e.tests.harness import BANNED, Sidecar, VllmServer, run_chat, wait_until
from sidecar_client import SidecarClient

BREAKER = "tokcache_vllm_breaker_state"  # 0 closed, 1 half-open, 2 open
LOCAL = 'tokcache_vllm_served_total{path="local"}'


def _fallbacks(m: dict[str, float]) -> dict[str, float]:
    prefix = 'tokcache_vllm_fallback_total{reason="'
    return {k[len(prefix):-2]: v for k, v in m.items() if k.startswith(prefix)}


def _records(m: dict[str, float]) -> dict[str, float]:
    prefix = 'tokcache_vllm_records_total{result="'
    return {k[len(prefix):-2]: v for k, v in m.items() if k.startswith(prefix)}


def _moved(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0)) for k, v in after.items() if v != before.get(k, 0)}


def _complete(server: VllmServer, text: str) -> tuple[float, dict[str, object]]:
    t0 = time.monotonic()
    resp = server.post("/v1/completions", {"model": server.model, "prompt": text, "max_tokens": 2,
                                           "logit_bias": BANNED})
    return time.monotonic() - t0, resp


def _answers(sidecar: Sidecar) -> bool:
    """The sidecar answers an RPC again (a fresh client, over gRPC only)."""
    def ok() -> bool:
        try:
            with SidecarClient(sidecar.address, zero_rpc=False) as c:
                return bool(c.list_models(timeout=2.0))
        except Exception:
            return False
    return wait_until(ok, 30, interval=0.3)


def test_sidecar_killed_mid_run_then_restarted(plugin: VllmServer, sidecar: Sidecar,
                                               decode: Callable[[list[int]], str],
                                               report: Callable[[str], None]) -> None:
    """kill -9 before turn 3, restart before turn 5: every request succeeds at its normal
    speed, reads and records stay in vLLM's process (no fallback, the breaker stays closed),
    every turn extends the previous prompt + output exactly, and the restarted sidecar
    re-attaches the memory warm."""
    warm_text = f"Remember me across a sidecar restart {uuid.uuid4().hex[:8]}"
    plugin.post("/v1/completions", {"model": plugin.model, "prompt": warm_text, "max_tokens": 2})
    events: list[str] = []
    outage: dict[str, float] = {}

    def between(turn: int) -> None:
        if turn == 3:  # kill -9 after two turns
            before = plugin.metrics()
            sidecar.kill()
            latencies = [_complete(plugin, f"while the sidecar is dead {i}")[0] for i in range(5)]
            after = plugin.metrics()
            fb, rec = _moved(_fallbacks(before), _fallbacks(after)), _moved(_records(before), _records(after))
            outage.update(max_latency=max(latencies), breaker=after.get(BREAKER, -1),
                          local=after.get(LOCAL, 0) - before.get(LOCAL, 0), fallbacks=sum(fb.values()),
                          handled=rec.get("recorded", 0) + rec.get("refused", 0))
            events.append(f"sidecar killed before turn 3; 5 completions all OK (max {max(latencies):.2f}s); "
                          f"prompts read in vLLM's process {outage['local']:.0f}/5, fallbacks {fb}, records {rec}; "
                          f"breaker state {after[BREAKER]:.0f}")
        if turn == 5:  # restart on the same socket and shm prefix
            t0 = time.monotonic()
            sidecar.start()
            back = _answers(sidecar)
            events.append(f"sidecar restarted before turn 5; answering again: {back} after "
                          f"{time.monotonic() - t0:.1f}s; breaker state {plugin.metrics().get(BREAKER, -1):.0f}")

    run = run_chat(plugin, "plugin: sidecar killed before turn 3, restarted before turn 5", stream=True,
                   decode=decode, seed=21, between=between)
    report(run.table() + "\n" + "\n".join(events))

    # Every request succeeded (run_chat raises otherwise), read and recorded in vLLM's process.
    assert outage["local"] == 5 and outage["fallbacks"] == 0 and outage["handled"] == 5, outage
    assert outage["breaker"] == 0 and plugin.metrics().get(BREAKER, -1) == 0
    assert outage["max_latency"] < 15
    assert "re-attached warm" in sidecar.log_tail(10**9)
    # The restarted sidecar re-attached the shared-memory cache: what was cached before is a hit.
    with SidecarClient(sidecar.address) as c:
        assert c.tokenize("qwen3", text=warm_text, add_special_tokens=True).decision.source == "l0"
    # Each turn's output was recorded in vLLM's process, the sidecar dead or not.
    assert all(t.agree == 100.0 for t in run.turns[1:]), run.table()


def test_hung_sidecar_costs_nothing(plugin: VllmServer, sidecar: Sidecar, report: Callable[[str], None]) -> None:
    """A hung sidecar (SIGSTOP: it accepts connections, never answers): prompts are read and
    outputs recorded in vLLM's process, so no response waits for it."""
    assert sidecar.proc is not None and sidecar.proc.poll() is None
    _complete(plugin, "warm up")
    fast = min(_complete(plugin, f"before the hang {i}")[0] for i in range(3))
    before = plugin.metrics()
    os.kill(sidecar.proc.pid, signal.SIGSTOP)
    try:
        latencies = [_complete(plugin, f"while the sidecar hangs {i}")[0] for i in range(6)]
        during = plugin.metrics()
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
    timeouts = (during.get("tokcache_vllm_response_wait_timeouts_total", 0)
                - before.get("tokcache_vllm_response_wait_timeouts_total", 0))
    local = during.get(LOCAL, 0) - before.get(LOCAL, 0)
    rec = _moved(_records(before), _records(during))
    report(f"hung sidecar (SIGSTOP): completion latencies {[round(x, 2) for x in latencies]}s "
           f"(normal {fast:.2f}s); {local:.0f} of 6 prompts read and records {rec} in vLLM's process meanwhile; "
           f"{timeouts:.0f} record-wait timeouts; breaker state {during.get(BREAKER, -1):.0f}")
    assert local == 6  # shared memory needs no sidecar to read
    assert rec.get("recorded", 0) + rec.get("refused", 0) == 6 and "queued" not in rec, rec
    assert timeouts == 0 and during.get(BREAKER, -1) == 0
    assert max(latencies) < fast + 1.0  # slack for a loaded 2-CPU machine; a record wait was 2 s
    assert _answers(sidecar)
