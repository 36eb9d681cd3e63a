"""A sidecar serving another tokenizer under the model's name is refused by the handshake.

The ``mismatch`` server runs ``--tokenizer-mode tokcache`` with
``TOKCACHE_MODEL=qwen3`` against a sidecar whose ``qwen3`` is the Llama 3.2
tokenizer: every prompt must be tokenized by vLLM itself, with a log line
saying why.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from e2e.tests.harness import BANNED, VllmServer, wait_until


def test_other_tokenizer_is_refused_and_vllm_serves_correctly(mismatch: VllmServer, baseline: VllmServer,
                                                              llama_dir: Path, model_dir: Path,
                                                              report: Callable[[str], None]) -> None:
    from tokcache.engine.tokenizer import fingerprint_of

    llama_fp = fingerprint_of(llama_dir / "tokenizer.json")
    qwen_fp = fingerprint_of(model_dir / "tokenizer.json")
    assert llama_fp != qwen_fp

    chat = {"model": mismatch.model, "messages": [{"role": "user", "content": "Hello\n\n\nthere"}],
            "max_tokens": 8, "return_token_ids": True, "logit_bias": BANNED}
    resp = mismatch.post("/v1/chat/completions", chat)
    assert resp["choices"][0]["token_ids"]
    text = "Plain text, with  odd   spacing\n\n\nand newlines"
    for path, body in (("/tokenize", {"prompt": text}),
                       ("/tokenize", {"messages": chat["messages"]})):
        got = mismatch.post(path, {"model": mismatch.model, **body})["tokens"]
        want = baseline.post(path, {"model": baseline.model, **body})["tokens"]
        assert got == want  # vLLM's own tokenizer, not Llama's ids
    assert resp["prompt_token_ids"] == baseline.post("/tokenize", {"model": baseline.model,
                                                                   "messages": chat["messages"]})["tokens"]
    cmpl = mismatch.post("/v1/completions", {"model": mismatch.model, "prompt": text, "max_tokens": 2})
    assert cmpl["choices"][0]["text"] is not None

    m = mismatch.metrics()
    assert m.get("tokcache_vllm_tokenize_total", 0) == 0
    assert m.get('tokcache_vllm_fallback_total{reason="handshake_refused"}', 0) >= 4
    assert any(k.startswith("tokcache_vllm_sidecar_info") and 'handshake="refused"' in k for k in m)
    assert wait_until(lambda: "sidecar path off (refused)" in mismatch.log_text(), 5)
    line = next(ln for ln in mismatch.log_text().splitlines() if "sidecar path off (refused)" in ln)
    assert llama_fp in line and qwen_fp in line and "a different tokenizer" in line
    report("handshake refused, vLLM served via fallback; its log says:\n" + re.sub(r"^.*?tokcache:", "tokcache:", line))
