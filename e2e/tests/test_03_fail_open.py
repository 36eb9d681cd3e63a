"""Fail open: a dead or hung sidecar never fails a request; the path comes back with it.

Runs after the other plugin tests (it kills and restarts the shared sidecar).
The plugin server runs with a 2 s deadline (harness.DEADLINE_S), 3 failures
to open the breaker, and a 1 s breaker reset (conftest.PLUGIN_ENV).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable

from e2e.tests.harness import BANNED, DEADLINE_S, Sidecar, VllmServer, run_chat, wait_until
from sidecar_client import SidecarClient

TOK = "tokcache_vllm_tokenize_total"
BREAKER = "tokcache_vllm_breaker_state"  # 0 closed, 1 half-open, 2 open


def _fallbacks(m: dict[str, float]) -> dict[str, float]:
    prefix = 'tokcache_vllm_fallback_total{reason="'
    return {k[len(prefix):-2]: v for k, v in m.items() if k.startswith(prefix)}


def _complete(server: VllmServer, text: str) -> tuple[float, dict[str, object]]:
    t0 = time.monotonic()
    resp = server.post("/v1/completions", {"model": server.model, "prompt": text, "max_tokens": 2,
                                           "logit_bias": BANNED})
    return time.monotonic() - t0, resp


def _wait_sidecar_path_back(server: VllmServer, timeout: float = 30.0) -> bool:
    """Send small requests until one is tokenized by the sidecar again (the breaker's probe)."""
    start = server.metrics().get(TOK, 0.0)

    def back() -> bool:
        server.post("/tokenize", {"model": server.model, "prompt": f"probe {uuid.uuid4().hex[:6]}"})
        return server.metrics().get(TOK, 0.0) > start

    return wait_until(back, timeout, interval=0.3)


def test_sidecar_killed_mid_run_then_restarted(plugin: VllmServer, sidecar: Sidecar,
                                               decode: Callable[[list[int]], str],
                                               report: Callable[[str], None]) -> None:
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
            outage.update(max_latency=max(latencies), breaker=after.get(BREAKER, -1))
            fb = {k: v - _fallbacks(before).get(k, 0) for k, v in _fallbacks(after).items()}
            events.append(f"sidecar killed before turn 3; 5 completions all OK (max {max(latencies):.2f}s); "
                          f"fallbacks {({k: int(v) for k, v in fb.items() if v})}; breaker state {after[BREAKER]:.0f}")
        if turn == 5:  # restart on the same socket and shm prefix
            t0 = time.monotonic()
            sidecar.start()
            back = _wait_sidecar_path_back(plugin)
            events.append(f"sidecar restarted before turn 5; sidecar path back: {back} after "
                          f"{time.monotonic() - t0:.1f}s; breaker state {plugin.metrics().get(BREAKER, -1):.0f}")

    run = run_chat(plugin, "plugin: sidecar killed before turn 3, restarted before turn 5", stream=True,
                   decode=decode, seed=21, between=between)
    report(run.table() + "\n" + "\n".join(events))

    # Every request succeeded (run_chat raises otherwise); during the outage the breaker opened.
    assert outage["breaker"] == 2
    assert outage["max_latency"] < 15
    assert "re-attached warm" in sidecar.log_tail(10**9)
    assert plugin.metrics().get(BREAKER, -1) == 0
    log = plugin.log_text()
    assert "circuit breaker open" in log and "circuit breaker closed" in log
    # The restarted sidecar re-attached the shared-memory cache: what was cached before is a hit.
    with SidecarClient(sidecar.address) as c:
        assert c.tokenize("qwen3", text=warm_text, add_special_tokens=True).decision.source == "l0"
    # Turns 1-2 were recorded before the kill; turns 3-4 were tokenized by vLLM itself and not
    # recorded; turn 5 is tokenized by the sidecar again and recorded, so turn 6 is exact again.
    assert run.turns[1].agree == 100.0
    assert run.turns[5].agree == 100.0, run.table()


def test_hung_sidecar_costs_at_most_the_deadline(plugin: VllmServer, sidecar: Sidecar,
                                                 report: Callable[[str], None]) -> None:
    """A hung sidecar (SIGSTOP): prompts are still tokenized in vLLM's process (no RPC to
    wait for); a finishing response waits for its record at most TOKCACHE_RECORD_WAIT_MS,
    and after 3 such timeouts the breaker opens and responses stop waiting."""
    assert sidecar.proc is not None and sidecar.proc.poll() is None
    _complete(plugin, "warm up")
    fast, _ = _complete(plugin, "before the hang")
    before = plugin.metrics()
    os.kill(sidecar.proc.pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        latencies = [_complete(plugin, f"while the sidecar hangs {i}")[0] for i in range(6)]
        during = plugin.metrics()
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
    timeouts = (during.get("tokcache_vllm_response_wait_timeouts_total", 0)
                - before.get("tokcache_vllm_response_wait_timeouts_total", 0))
    local = (during.get('tokcache_vllm_served_total{path="local"}', 0)
             - before.get('tokcache_vllm_served_total{path="local"}', 0))
    report(f"hung sidecar (SIGSTOP): completion latencies {[round(x, 2) for x in latencies]}s "
           f"(normal {fast:.2f}s, record wait {DEADLINE_S:g}s); {local:.0f} of 6 prompts tokenized in vLLM's "
           f"process meanwhile; {timeouts:.0f} record-wait timeouts, then breaker open")
    assert local == 6  # shared memory needs no sidecar to read
    # TOKCACHE_BREAKER_FAILURES=3, then responses stop waiting (a half-open probe after
    # TOKCACHE_BREAKER_RESET_S=1 may wait once more).
    assert 3 <= timeouts <= 4
    assert max(latencies) < fast + DEADLINE_S + 3.0  # one record wait, plus slack for a loaded 2-CPU machine
    assert min(latencies[3:]) < fast + 0.5  # breaker open: no wait at all
    assert _wait_sidecar_path_back(plugin)
