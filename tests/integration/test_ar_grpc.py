"""RecordOutput over gRPC: unary and streamed records give the same cache state; refusals are typed."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar_client import AsyncSidecarClient, InvalidArgumentError, OutputAssembler, SidecarClient
from tests.ar_helpers import noncanonical
from tests.integration.sidecar_proc import SidecarProcess
from tokcache.sidecar.engine.model import ModelEngine

ANSWERS = ["Step one:\n\n    run `make`\n\n", "Result: 100 passed\n\n\n  ok", "完成了。\n\n🎉 Done."]


@pytest.fixture(scope="module")
def engine(qwen3_path: Path) -> ModelEngine:
    return ModelEngine("qwen3", qwen3_path, store=None)  # only for its tokenizer helpers


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory, qwen3_path: Path) -> Iterator[str]:
    prefix = f"tkt-argrpc-{uuid.uuid4().hex[:8]}"
    proc = SidecarProcess(tmp_path_factory.mktemp("ar"), {"qwen3": qwen3_path}, prefix).start()
    yield proc.address
    assert proc.stop() == 0
    for p in Path("/dev/shm").glob(f"*{prefix}*"):
        p.unlink()


def _conversation(c: SidecarClient, engine: ModelEngine, salt: str, streamed: bool) -> list[list[int]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    seen = []
    records = []
    for answer in ANSWERS:
        r = c.tokenize("qwen3", messages=msgs, add_generation_prompt=True, cache_salt=salt, return_prompt_text=True)
        seen.append(r.token_ids)
        gen = noncanonical(engine, answer) + [151645]
        rec = {"prompt_text": r.prompt_text, "prompt_token_ids": r.token_ids, "output_text": answer,
               "output_token_ids": gen, "finish_reason": "stop", "cache_salt": salt}
        if streamed:
            records.append(rec)
            c.record_outputs("qwen3", records[-1:])
        else:
            c.record_output("qwen3", **rec)
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
    seen.append(c.tokenize("qwen3", messages=msgs, add_generation_prompt=True, cache_salt=salt).token_ids)
    return seen


def test_streamed_and_unary_records_give_the_same_state(address: str, engine: ModelEngine) -> None:
    with SidecarClient(address) as c:
        unary = _conversation(c, engine, uuid.uuid4().hex, streamed=False)
        streamed = _conversation(c, engine, uuid.uuid4().hex, streamed=True)
    assert unary == streamed
    # Each turn's prompt begins with the previous prompt + the generated ids.
    for t in range(1, len(unary)):
        gen = noncanonical(engine, ANSWERS[t - 1])
        assert unary[t][:len(unary[t - 1]) + len(gen)] == unary[t - 1] + gen


@pytest.mark.parametrize("zero_rpc", [False, True], ids=["record-output", "in-process"])
def test_refusals_are_typed_and_streams_continue(address: str, engine: ModelEngine, zero_rpc: bool) -> None:
    """The same refusals, by the same field, from the sidecar's RecordOutput(s) and from the
    writer in a client process whose model is open with a writable mapping (nothing sent)."""
    salt = uuid.uuid4().hex
    with SidecarClient(address, zero_rpc=zero_rpc) as c:
        r = c.tokenize("qwen3", text="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                       add_special_tokens=False, cache_salt=salt)
        assert r.served_by == ("local" if zero_rpc else "sidecar")
        good = {"prompt_text": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                "prompt_token_ids": r.token_ids, "output_text": "hello", "output_token_ids": [14990],
                "cache_salt": salt}
        with pytest.raises(InvalidArgumentError) as e:
            c.record_output("qwen3", **{**good, "output_text": "goodbye"})
        assert e.value.field == "output_token_ids"
        with pytest.raises(InvalidArgumentError) as e:
            c.record_output("qwen3", **{**good, "stop_reason": "</s>"})
        assert e.value.field == "stop_reason"
        with pytest.raises(InvalidArgumentError) as e:
            c.record_output("qwen3", **{**good, "output_token_ids": [-1]})
        assert e.value.field == "output_token_ids[0]"
        summary = c.record_outputs("qwen3", [good, {**good, "output_text": "bad"}, good])
        assert (summary.recorded, summary.refused) == (2, 1)
        assert summary.refusals[0][0] == 1 and "output_token_ids" in summary.refusals[0][1]
        # Where they were decided: in this process (refused, then two recorded) or by the sidecar.
        assert c.stats().get("records", {}) == ({"refused": 3, "recorded": 2} if zero_rpc else {})


def test_output_assembler_async(address: str, engine: ModelEngine) -> None:
    salt = uuid.uuid4().hex
    answer = "Line one.\n\nLine two.\n\n\n"
    gen = noncanonical(engine, answer)

    async def run() -> list[int]:
        async with AsyncSidecarClient(address) as c:
            msgs = [{"role": "user", "content": "stream please"}]
            r = await c.tokenize("qwen3", messages=msgs, add_generation_prompt=True, cache_salt=salt,
                                 return_prompt_text=True)
            asm = OutputAssembler("qwen3", prompt_text=r.prompt_text or "", prompt_token_ids=r.token_ids,
                                  cache_salt=salt)
            decode = engine.reference.tokenizer.decode
            prev = ""
            for k in range(0, len(gen), 3):  # deltas of 3 ids, text as the detokenizer would emit
                text = decode(gen[:k + 3])
                asm.add(text[len(prev):], gen[k:k + 3])
                prev = text
            asm.add("", [151645])
            res = await asm.arecord(c, finish_reason="stop")
            assert res.stop_token_dropped
            with pytest.raises(RuntimeError):
                asm.add("x", [1])
            msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "again"}]
            r2 = await c.tokenize("qwen3", messages=msgs, add_generation_prompt=True, cache_salt=salt)
            assert r2.decision.source == "ar"
            return r2.token_ids[len(r.token_ids):len(r.token_ids) + len(gen)]

    assert asyncio.run(run()) == gen
