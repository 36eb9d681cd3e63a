#!/usr/bin/env python3
"""Measure how far vLLM's re-tokenized multi-turn prompts diverge from the ids it generated.

A chat loop of N turns against a running vLLM OpenAI server (stdlib only, no deps):
turn k sends messages_k = messages_{k-1} + [assistant: answer_{k-1}] + [user: new question],
with temperature 1.0 and ``return_token_ids: true``. For each turn k>1 it compares the new
``prompt_token_ids`` with ``prev_prompt_ids + prev_generated_ids`` (what the engine holds KV for)
and prints the common-prefix length / length of that expected sequence, and how many prompt
tokens the engine's prefix cache served for that turn ("hit", from /metrics deltas; vLLM caches
whole blocks only: 128 tokens per block on the CPU backend by default). 100 % means the new prompt
is an exact token-prefix extension; anything less is where vLLM's prefix cache stops matching.
Prefix cache counters from /metrics are printed before and after.

    python e2e/measure_divergence.py --base http://127.0.0.1:8011 [--turns 6] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request

QUESTIONS = [
    "Write two short paragraphs about caching, separated by a blank line.",
    "Now list three bullet points about tokenizers.\n\nKeep it brief.",
    "Explain prefix caching in one sentence.",
    "Give me a tiny Python snippet that prints hello.",
    "What is a BPE merge? Answer with a line break in the middle.",
    "Summarise our conversation.",
    "Thanks! One more fact about GPUs, please.",
    "And one about CPUs.",
]


def post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        total = 0.0
        for m in re.finditer(r"^" + re.escape(name) + r"(\{[^}]*\})?\s+([0-9.eE+-]+)$", text, re.M):
            total += float(m.group(2))
        out[name] = total
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="http://127.0.0.1:8011")
    ap.add_argument("--model", default=None, help="served model name (default: first of /v1/models)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--cache-salt", default=None, help="vLLM cache_salt for every request")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per turn")
    args = ap.parse_args()

    model = args.model
    if model is None:
        with urllib.request.urlopen(args.base + "/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]

    before = metrics(args.base)
    messages: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
    prev_expected: list[int] | None = None
    rows = []
    print(f"model={model} turns={args.turns} max_tokens={args.max_tokens} temperature=1.0")
    print(
        f"{'turn':>4} {'prompt':>6} {'gen':>4} {'finish':>7} {'expected':>8} {'common':>6} "
        f"{'agree%':>7} {'hit':>5}  first divergence"
    )
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": QUESTIONS[(turn - 1) % len(QUESTIONS)]})
        body = {
            "model": model,
            "messages": messages,
            "temperature": 1.0,
            "max_tokens": args.max_tokens,
            "return_token_ids": True,
        }
        if args.cache_salt is not None:
            body["cache_salt"] = args.cache_salt
        if args.seed is not None:
            body["seed"] = args.seed + turn
        m0 = metrics(args.base)
        t0 = time.perf_counter()
        resp = post(args.base, "/v1/chat/completions", body)
        dt = time.perf_counter() - t0
        m1 = metrics(args.base)
        hits = int(m1["vllm:prefix_cache_hits_total"] - m0["vllm:prefix_cache_hits_total"])
        prompt_ids: list[int] = resp["prompt_token_ids"]
        choice = resp["choices"][0]
        gen_ids: list[int] = choice["token_ids"]
        answer: str = choice["message"]["content"] or ""
        row = {
            "turn": turn,
            "prompt_tokens": len(prompt_ids),
            "generated": len(gen_ids),
            "finish_reason": choice.get("finish_reason"),
            "latency_s": round(dt, 3),
            "prefix_cache_hit_tokens": hits,
        }
        detail = "-"
        if prev_expected is not None:
            cp = common_prefix(prompt_ids, prev_expected)
            row.update(expected=len(prev_expected), common=cp, agree_pct=round(100.0 * cp / len(prev_expected), 1))
            if cp < len(prev_expected):
                detail = f"at {cp}: expected {prev_expected[cp : cp + 4]} got {prompt_ids[cp : cp + 4]}"
            print(
                f"{turn:>4} {len(prompt_ids):>6} {len(gen_ids):>4} {str(row['finish_reason']):>7} "
                f"{len(prev_expected):>8} {cp:>6} {row['agree_pct']:>6.1f}% {hits:>5}  {detail}"
            )
        else:
            print(
                f"{turn:>4} {len(prompt_ids):>6} {len(gen_ids):>4} {str(row['finish_reason']):>7} "
                f"{'-':>8} {'-':>6} {'-':>7} {hits:>5}  (first turn)"
            )
        if args.json:
            print(json.dumps(row))
        rows.append(row)
        prev_expected = prompt_ids + gen_ids
        messages.append({"role": "assistant", "content": answer})

    after = metrics(args.base)
    print("\nprefix cache counters (before -> after, delta):")
    for k in before:
        print(f"  {k}: {before[k]:.0f} -> {after[k]:.0f} (+{after[k] - before[k]:.0f})")
    dq = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    dh = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    if dq:
        print(f"  hit rate this run: {100.0 * dh / dq:.1f}% of {dq:.0f} queried tokens")
    agree = [r["agree_pct"] for r in rows if "agree_pct" in r]
    if agree:
        print(
            f"turns with exact token-prefix extension: {sum(a == 100.0 for a in agree)}/{len(agree)}; "
            f"mean agreement {sum(agree) / len(agree):.1f}%"
        )


if __name__ == "__main__":
    sys.exit(main())
