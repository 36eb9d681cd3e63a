"""Tokenization time per request inside vLLM: the plugin next to vLLM's own tokenizer, default and fastokens.

The same agent conversations (a 24.5 KB system prompt: instructions, 30 JSON
tool schemas, rules; 8 conversations at once x 6 turns, each turn sent when
the previous response ended) on three servers, one after the other:

- ``plugin``: ``--tokenizer-mode tokcache`` (prompts read in vLLM's process from
  the sidecar's shared memory: path ``local``; over gRPC: path ``sidecar``);
- ``baseline``: vLLM's default tokenizer (HF ``tokenizers``);
- ``fastokens``: vLLM with ``VLLM_USE_FASTOKENS=1``, ``FASTOKENS_SEGMENT_CACHE=64`` (MiB).

``baseline`` and ``fastokens`` run the plugin in observe-only mode
(``TOKCACHE_OBSERVE_ONLY=1``): vLLM tokenizes every prompt and the plugin
times the same call it would otherwise replace (path ``vllm``), so the three
are measured the same way, by the same histogram
(``tokcache_vllm_tokenize_seconds``, read from each server's ``/metrics``
before and after the run). Before the run each server answers one request
with the same system prompt (its KV blocks, and the caches a deployed agent's
system prompt would be in: the sidecar's records, fastokens' segments).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from e2e.tests.harness import (
    BANNED,
    TOKENIZE_SECONDS,
    ConvTurn,
    Timing,
    VllmServer,
    agent_system,
    delta,
    labelled,
    run_conversations,
    tokenize_timings,
)

CONVS, TURNS = 8, 6
PROMPTS = CONVS * TURNS
SEED = 50_000
SYSTEM = agent_system()


def _warm(server: VllmServer) -> None:
    server.post("/v1/chat/completions", {"model": server.model, "max_tokens": 1, "logit_bias": BANNED,
                                         "messages": [{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": "Hello."}]})


def _run(server: VllmServer, decode: Callable[[list[int]], str]) -> tuple[list[ConvTurn], dict[str, float],
                                                                          dict[str, float]]:
    _warm(server)
    m0 = server.metrics()
    turns = run_conversations(server, convs=CONVS, turns=TURNS, stream=False, seed=SEED, decode=decode,
                              system=SYSTEM)
    return turns, m0, server.metrics()


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.2f}"


def time_table(runs: Mapping[str, tuple[Sequence[ConvTurn], Mapping[str, float], Mapping[str, float]]],
               decode: Callable[[list[int]], str]) -> str:
    later = CONVS * (TURNS - 1)
    turns = [t for run, _, _ in runs.values() for t in run]
    short = min(turns, key=lambda t: len(t.reply.prompt_ids)).reply.prompt_ids
    long = max(turns, key=lambda t: len(t.reply.prompt_ids)).reply.prompt_ids
    lines = [f"== tokenization time per request inside vLLM: {CONVS} agent conversations x {TURNS} turns at once "
             f"(system prompt {len(SYSTEM.encode()) / 1000:.1f} KB; prompts {len(short)}-{len(long)} tokens, "
             f"{len(decode(short).encode()) / 1000:.1f}-{len(decode(long).encode()) / 1000:.1f} KB)",
             f"histogram {TOKENIZE_SECONDS} over the run, by path: p50/p90 interpolated in its buckets "
             "(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10 ms ...), mean = _sum/_count",
             f"{'server':<28} {'path':<8} {'prompts':>7} {'p50 ms':>7} {'p90 ms':>7} {'mean ms':>8} "
             f"{'>100 ms':>7} {'exact':>7}"]
    for name, (run, m0, m1) in runs.items():
        exact = f"{sum(t.exact for t in run if t.turn > 1)}/{later}"
        for path, t in tokenize_timings(m0, m1).items():
            lines.append(f"{name:<28} {path:<8} {t.count:>7} {_ms(t.p50):>7} {_ms(t.p90):>7} {_ms(t.mean):>8} "
                         f"{t.slow:>7} {exact:>7}")
            exact = ""
    return "\n".join(lines)


def _ratios(times: Mapping[str, Mapping[str, Timing]]) -> str:
    """vLLM's time per prompt over the plugin's (all its paths pooled by mean; p50 of its local path)."""
    plugin = times["tokcache (plugin)"]
    count = sum(t.count for t in plugin.values())
    mean = sum((t.mean or 0.0) * t.count for t in plugin.values()) / count if count else None
    local = plugin.get("local")
    out = []
    for name, by_path in times.items():
        vllm = by_path.get("vllm")
        if name == "tokcache (plugin)" or vllm is None or not mean or local is None or not local.p50:
            continue
        out.append(f"{name}: x{(vllm.p50 or 0.0) / local.p50:.1f} at p50, x{(vllm.mean or 0.0) / mean:.1f} "
                   "in the mean")
    return "vLLM's time per prompt over the plugin's: " + "; ".join(out)


def test_tokenize_time_plugin_vs_vllm_and_fastokens(plugin: VllmServer, baseline: VllmServer,
                                                    fastokens: VllmServer, decode: Callable[[list[int]], str],
                                                    report: Callable[[str], None]) -> None:
    runs = {"tokcache (plugin)": _run(plugin, decode),
            "vLLM default tokenizer": _run(baseline, decode),
            "vLLM VLLM_USE_FASTOKENS=1": _run(fastokens, decode)}
    tok, p0, p1 = runs["tokcache (plugin)"]
    served = labelled(p1, p0, "served", "path")
    times: dict[str, dict[str, Timing]] = {name: tokenize_timings(m0, m1) for name, (_, m0, m1) in runs.items()}
    report(time_table(runs, decode) + "\n"
           f"plugin: prompts served {served} ({100 * served.get('local', 0) / PROMPTS:.0f}% locally, in vLLM's "
           f"process), fallbacks {labelled(p1, p0, 'fallback', 'reason')}, decisions "
           f"{labelled(p1, p0, 'tokenize', 'source')}\n" + _ratios(times))

    # The plugin served every prompt (in vLLM's process or over RPC), none fell back ...
    assert delta(p1, p0, "tokcache_vllm_fallback_total") == 0, labelled(p1, p0, "fallback", "reason")
    assert sum(served.values()) == PROMPTS, served
    assert sum(t.count for path, t in times["tokcache (plugin)"].items() if path in ("local", "sidecar")) == PROMPTS
    # ... and every turn extends the previous prompt + output exactly.
    assert all(t.exact for t in tok if t.turn > 1), [(t.conv, t.turn, t.common, t.expected) for t in tok
                                                     if t.turn > 1 and not t.exact]
    # The observers timed every prompt vLLM tokenized, and used no sidecar.
    for name in ("vLLM default tokenizer", "vLLM VLLM_USE_FASTOKENS=1"):
        _, m0, m1 = runs[name]
        assert set(times[name]) == {"vllm"} and times[name]["vllm"].count == PROMPTS, times[name]
        assert labelled(m1, m0, "fallback", "reason") == {"observe_only": PROMPTS}
    # Same text, same ids: turn 1 (system + first question) on all three.
    first = {name: {tuple(t.reply.prompt_ids) for t in turns if t.turn == 1} for name, (turns, _, _) in runs.items()}
    assert all(len(ids) == 1 for ids in first.values()) and len(set().union(*first.values())) == 1
