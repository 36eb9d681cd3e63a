"""PluginRuntime end to end against a fake sidecar: served ids -> request -> outputs -> RecordOutputs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sidecar_client.vllm._config import PluginConfig
from sidecar_client.vllm._runtime import PluginRuntime
from tests.vllm.fake_sidecar import FakeSidecar, ids_for, record_ids, run

FP = "a" * 32


@dataclass
class Out:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def decode(ids: list[int]) -> str:
    """A toy detokenizer: id 900 is half of a character (decodes to U+FFFD)."""
    return "".join("\ufffd" if i == 900 else chr(i) for i in ids)


def runtime_for(address: str) -> PluginRuntime:
    return PluginRuntime(PluginConfig(address=address, timeout_s=2.0), FP, decode=decode)


def test_served_prompt_is_recorded_with_exactly_the_served_text_and_ids(tmp_path: Path) -> None:
    async def main() -> None:
        async with FakeSidecar(tmp_path, {"m": FP}) as fake:
            rt = runtime_for(fake.address)
            ids = await rt.tokenize("prompt text", add_special_tokens=False, cache_salt="t")
            assert ids == ids_for("prompt text")
            prompt = {"type": "token", "prompt": "prompt text", "prompt_token_ids": list(ids), "cache_salt": "t"}
            rec = rt.start_request(prompt, delta=True, trace_headers={"traceparent": "00-a-b-01", "other": "x"})
            assert rec is not None
            for outs in ([Out(0, "A", [65]), Out(1, "C", [67])], [Out(0, "B", [66], "length")],
                         [Out(1, "D", [68, 900], "length")]):  # choice 1 ends mid-character
                rec.feed(outs)
            await rt.recorder.aclose()
            got = {r.output_text: (r, md) for r, md in fake.state.records}
            assert set(got) == {"AB", "CD"}
            r, md = got["AB"]
            assert r.prompt_text == "prompt text" and record_ids(r, "prompt_token_ids") == ids
            assert record_ids(r, "output_token_ids") == [65, 66] and r.cache_salt == "t"
            assert md["traceparent"] == "00-a-b-01" and "other" not in md
            assert record_ids(got["CD"][0], "output_token_ids") == [67, 68]  # the held-back id left out
            assert rt.stats.records["trimmed"] == 1 and rt.stats.records["recorded"] == 2
            assert rt.stats.tokenize["miss"] == 1 and rt.stats.cached_tokens == 3

    run(main())


def test_requests_not_tokenized_by_the_sidecar_are_not_recorded(tmp_path: Path) -> None:
    async def main() -> None:
        async with FakeSidecar(tmp_path, {"m": FP}) as fake:
            rt = runtime_for(fake.address)
            ids = await rt.tokenize("served", add_special_tokens=True, cache_salt=None)
            assert ids is not None
            assert rt.start_request({"prompt": "served", "prompt_token_ids": ids[:-1]}, delta=False,
                                    trace_headers=None) is None  # vLLM truncated them
            assert rt.start_request({"prompt": "never asked", "prompt_token_ids": [1]}, delta=False,
                                    trace_headers=None) is None
            assert rt.start_request(object(), delta=False, trace_headers=None) is None  # streaming input
            assert rt.stats.record_skips["not_served"] == 2

    run(main())


def test_stop_string_finishes_are_skipped_and_eos_is_sent(tmp_path: Path) -> None:
    async def main() -> None:
        async with FakeSidecar(tmp_path, {"m": FP}) as fake:
            rt = runtime_for(fake.address)
            for text in ("a", "b"):
                ids = await rt.tokenize(text, add_special_tokens=False, cache_salt=None)
                assert ids is not None
                rec = rt.start_request({"prompt": text, "prompt_token_ids": ids}, delta=False, trace_headers=None)
                assert rec is not None
                finish = Out(0, "x", [120, 7], "stop", "\n") if text == "a" else Out(0, "y", [121, 2], "stop", None)
                rec.feed([finish])
            await rt.recorder.aclose()
            assert rt.stats.record_skips["stop_string"] == 1
            assert [(r.output_text, record_ids(r, "output_token_ids")) for r, _ in fake.state.records] == \
                [("y", [121, 2])]  # EOS id kept: the sidecar drops it after checking it is absent from the text

    run(main())


def test_prompts_vllm_would_truncate_fall_back(tmp_path: Path) -> None:
    async def main() -> None:
        async with FakeSidecar(tmp_path, {"m": FP}) as fake:
            rt = runtime_for(fake.address)
            assert await rt.tokenize("0123456789", add_special_tokens=False, cache_salt=None, max_length=5) is None
            assert rt.stats.fallbacks["too_long"] == 1 and len(rt.served) == 0

    run(main())


def test_next_turn_tokenize_waits_for_the_previous_turns_record(tmp_path: Path) -> None:
    """An agent sends turn N+1 the moment turn N ends: its Tokenize must see turn N's record."""
    async def main() -> None:
        async with FakeSidecar(tmp_path, {"m": FP}) as fake:
            rt = runtime_for(fake.address)
            ids = await rt.tokenize("turn1:", add_special_tokens=False, cache_salt=None)
            assert ids is not None
            rec = rt.start_request({"prompt": "turn1:", "prompt_token_ids": ids}, delta=False, trace_headers=None)
            assert rec is not None
            fake.state.record_delay = 0.2
            rec.feed([Out(0, "ok", [111, 107], "length")])
            await rt.tokenize("turn1:ok|turn2:", add_special_tokens=False, cache_salt=None)
            assert fake.state.events[-2:] == ["record", "tokenize"] and rt.stats.record_waits == 1
            await rt.tokenize("unrelated", add_special_tokens=False, cache_salt=None)
            assert rt.stats.record_waits == 1
            await rt.recorder.aclose()

    run(main())
