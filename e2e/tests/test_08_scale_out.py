"""vLLM's scale-out layout: a GPU-less render server with the plugin, a generate server on token ids.

The loop a KV-aware router runs, over HTTP, every hop a real vLLM process:
``render``'s ``/v1/chat/completions/render`` (tokcache's ids) -> ``plugin``'s
``/inference/v1/generate`` (ids in, ids out) -> ``render``'s ``/v1/chat/completions/derender``
(the text, and the plugin records the output) -> the next turn's render. With the record,
every turn's ids extend the previous prompt + generated ids, including the turns whose output
re-encodes to other ids.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e.tests.harness import BANNED, QUESTIONS, VllmServer, delta, labelled

TURNS = 5


def test_render_generate_derender_turns_extend(render: VllmServer, plugin: VllmServer, model_dir: Path,
                                               decode: Callable[[list[int]], str],
                                               report: Callable[[str], None]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    m0 = render.metrics()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    previous: list[int] | None = None
    rows, exact, non_canonical = [], 0, 0
    for turn in range(TURNS):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        rendered = render.post("/v1/chat/completions/render", {
            "model": render.model, "messages": messages, "max_tokens": 40, "temperature": 1.0, "seed": turn,
            "logit_bias": BANNED})
        ids = rendered["token_ids"]
        if previous is not None:
            exact += ids[:len(previous)] == previous
        # The generate server takes the rendered request as it is, under its own model name.
        generated = plugin.post("/inference/v1/generate", {**rendered, "model": plugin.model})
        (choice,) = generated["choices"]
        out_ids = list(choice["token_ids"])
        answer = render.post("/v1/chat/completions/derender", {
            "model": render.model, "generate_response": generated, "prompt_token_ids": ids,
        })["choices"][0]["message"]["content"]
        gen = out_ids[:-1] if choice["finish_reason"] == "stop" and choice.get("stop_reason") is None else out_ids
        non_canonical += list(tok.encode(decode(gen), add_special_tokens=False)) != gen
        rows.append(f"turn {turn + 1}: prompt {len(ids)} ids, generated {len(out_ids)} ({choice['finish_reason']})")
        previous = ids + gen
        messages.append({"role": "assistant", "content": answer})
    m1 = render.metrics()
    records = labelled(m1, m0, "records", "result")
    tokenize = labelled(m1, m0, "tokenize", "source")
    fallbacks = delta(m1, m0, "tokcache_vllm_fallback_total")
    report("scale-out (render server + generate server, vLLM's /render -> /inference/v1/generate -> /derender)\n"
           + "\n".join(rows) + f"\nturns whose ids extend the previous prompt + output: {exact}/{TURNS - 1}; "
           f"outputs that re-encode to other ids: {non_canonical}/{TURNS}\nrender server: records {records}, "
           f"tokenize {tokenize}, fallbacks {fallbacks:.0f}")
    assert exact == TURNS - 1
    assert records.get("recorded", 0) == TURNS and fallbacks == 0
    assert tokenize.get("ar", 0) == TURNS - 1
