"""The point of tokcache: every turn's prompt ids extend the previous prompt + generated ids.

Same conversation (same questions, seeds, temperature 1.0 on a random model,
so answers are non-canonical token sequences) against vLLM tokenizing itself
(``baseline``: the plugin in observe-only mode, vLLM's ids) and with the plugin.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from e2e.tests.harness import BLOCK_SIZE, VllmServer, run_chat


def plugin_counters(server: VllmServer) -> str:
    """Non-zero tokcache_vllm_* counters, e.g. ``tokenize{source=ar}=5``."""
    out = []
    for key, value in sorted(server.metrics().items()):
        labelled = "{" in key or key == "tokcache_vllm_record_waits_total"
        if key.startswith("tokcache_vllm_") and "_total" in key and labelled and value:
            name = key.removeprefix("tokcache_vllm_").replace("_total", "").replace('"', "")
            out.append(f"{name}={value:.0f}")
    return ", ".join(out)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_every_turn_extends_the_previous_prompt_and_output(baseline: VllmServer, plugin: VllmServer, stream: bool,
                                                          decode: Callable[[list[int]], str],
                                                          report: Callable[[str], None]) -> None:
    seed = 2 if stream else 1
    base = run_chat(baseline, "baseline: vLLM's tokenizer (tokcache observe-only)", stream=stream, seed=seed,
                    decode=decode)
    tok = run_chat(plugin, "plugin: --tokenizer-mode tokcache", stream=stream, seed=seed, decode=decode)
    report(base.table())
    report(tok.table() + "\nplugin counters so far: " + plugin_counters(plugin))

    later = tok.turns[1:]
    assert all(t.agree == 100.0 for t in later), tok.table()
    # vLLM's prefix cache then reuses every full block of the previous prompt + output
    # (the last generated token never had its KV computed, hence the -1).
    for t in later:
        assert t.expected is not None
        assert t.hit >= (t.expected - 1) // BLOCK_SIZE * BLOCK_SIZE, tok.table()
    # ... while vLLM's own re-tokenization of the same kind of conversation diverges.
    assert any(t.agree is not None and t.agree < 100.0 for t in base.turns[1:]), base.table()
