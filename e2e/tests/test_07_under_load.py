"""Under load, no turn loses its ids: three rounds of 8 concurrent conversations x 5 turns, back to back.

The ``plugin`` server (one API server process) while vLLM, its sidecar and
this client share the machine's 2 CPUs. Before prompts were read in vLLM's
process, every prompt was a Tokenize RPC with a deadline; under this load
two of three such runs lost ids silently (75/120 and 79/120 turns extended
exactly; the third 120/120): sidecar calls missed their deadline, the
breaker opened and vLLM tokenized in-process meanwhile. A read in the
caller's process has no deadline to miss: every turn of every round must
extend the previous prompt + output exactly, no prompt falls back and the
breaker never opens.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from e2e.tests.harness import (
    ConvTurn,
    VllmServer,
    delta,
    labelled,
    run_conversations,
    timing,
    tokenize_timings,
)

ROUNDS, CONVS, TURNS = 3, 8, 5
PROMPTS = ROUNDS * CONVS * TURNS
LATER = ROUNDS * CONVS * (TURNS - 1)  # turns 2..5, which extend the turn before
SEED = 70_000
OPENS = "tokcache_vllm_breaker_opens_total"
# A response's wait for its record stored in its own process (p99 bound: see test_05's)
WAIT_P50_S, WAIT_P99_S = 0.001, 0.05


def test_three_rounds_of_concurrent_conversations_lose_no_ids(plugin: VllmServer,
                                                              decode: Callable[[list[int]], str],
                                                              report: Callable[[str], None]) -> None:
    m0 = plugin.metrics()
    rounds: list[list[ConvTurn]] = []
    lines = [f"== under load: {ROUNDS} rounds of {CONVS} concurrent conversations x {TURNS} turns, back to back "
             "(plugin, 1 API server; vLLM, sidecar and client on 2 CPUs)",
             f"{'round':>5} {'exact':>7} {'seconds':>7}  not exact (turns 2-{TURNS}: extend the turn before)"]
    for r in range(ROUNDS):
        t0 = time.monotonic()
        turns = run_conversations(plugin, convs=CONVS, turns=TURNS, stream=False, seed=SEED + 10_000 * r,
                                  decode=decode)
        rounds.append(turns)
        later = [t for t in turns if t.turn > 1]
        misses = [f"conv {t.conv} turn {t.turn}: {t.common}/{t.expected}" for t in later if not t.exact]
        lines.append(f"{r + 1:>5} {sum(t.exact for t in later):>4}/{len(later)} {time.monotonic() - t0:>7.1f}  "
                     + ("; ".join(misses[:6]) or "-"))
    m1 = plugin.metrics()
    every = [t for turns in rounds for t in turns if t.turn > 1]
    served = labelled(m1, m0, "served", "path")
    fallbacks = labelled(m1, m0, "fallback", "reason")
    opens = delta(m1, m0, OPENS)
    waits = timing(m0, m1, "tokcache_vllm_response_wait_seconds")
    per_turn = {k: [t.prefilled for turns in rounds for t in turns if t.turn == k and t.prefilled is not None]
                for k in range(1, TURNS + 1)}
    exact = sum(t.exact for t in every)
    lines += [f"{'all':>5} {exact:>4}/{LATER}  ({exact + ROUNDS * CONVS}/{PROMPTS} counting every conversation's "
              "first turn)",
              f"prompts served {served} ({100 * served.get('local', 0) / PROMPTS:.0f}% locally, in vLLM's process), "
              f"fallbacks {fallbacks}, breaker opens {opens:.0f}, "
              f"records {labelled(m1, m0, 'records', 'result')}",
              "time to the ids: " + "; ".join(f"{path} {t.text()}" for path, t in tokenize_timings(m0, m1).items()),
              f"responses held for their records: {waits.text()}, timeouts "
              f"{delta(m1, m0, 'tokcache_vllm_response_wait_timeouts_total'):.0f}",
              "prefilled per turn (median over the conversations): " + ", ".join(
                  f"t{k} {statistics.median(v):.0f}" for k, v in per_turn.items() if v)]
    report("\n".join(lines))

    assert all(t.exact for t in every), "\n".join(lines)
    assert fallbacks == {}, fallbacks
    assert opens == 0
    assert sum(served.values()) == PROMPTS, served
    # Each response waited for its record stored in its own process (records are never sent).
    assert waits.p50 is not None and waits.p99 is not None, waits
    assert waits.p50 <= WAIT_P50_S and waits.p99 <= WAIT_P99_S, waits.text()
