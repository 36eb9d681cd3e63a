"""The plugin against one vLLM version's real classes (``e2e/run_versions.sh`` runs it per version).

What runs is vLLM's: its plugin loader finds the entry point, its registries build the renderer
from a real ``ModelConfig`` of the tiny model, its GPU-less render server (the app and state of
``vllm launch render``) answers ``/v1/chat/completions/render`` and ``/v1/completions/render``,
and its ``AsyncLLM.generate`` runs, fed real ``RequestOutput`` objects through its real
``RequestOutputCollector``, in DELTA and FINAL_ONLY. Only the engine core is absent: its place
is taken by ``add_request``, which checks that the wrapper passed what vLLM's own accepts.

Outcomes are read where users see them: ids equal to the sidecar's tokenization, the next
turn's ids extending the previous prompt + generated ids (the record is in the shared cache),
the plugin's counters and its start line.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.tests.harness import Sidecar
from e2e.versions.conftest import Lines, build_render_server, render_server_args
from sidecar_client import SidecarClient

EOS = 151645
# Generated as 198 198 ("\n" "\n"); re-encoded, "\n\n" is one token (271): a record must keep it.
SPLIT_NEWLINES = [198, 198]
SYSTEM = "You are a terse assistant."


@pytest.fixture(scope="module")
def server(expected_version: str, plugin_env: None, lines: Lines, model_dir: Path,
           loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    """vLLM's render server app for the tiny model, with ``--tokenizer-mode tokcache``."""
    from vllm.plugins import load_general_plugins

    from sidecar_client.vllm._renderer import forget_process_state

    load_general_plugins()  # vLLM's loader: finds the tokcache entry point, calls register()
    forget_process_state()
    app = loop.run_until_complete(build_render_server(render_server_args(model_dir)))
    yield app
    forget_process_state()


async def post(app: Any, path: str, body: dict[str, Any]) -> Any:
    import httpx

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://render") as client:
        r = await client.post(path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def stats() -> dict[str, Any]:
    from sidecar_client.vllm._renderer import get_runtime

    runtime = get_runtime()
    assert runtime is not None, "the plugin is not running in this process"
    return runtime.stats.snapshot()


def test_registries_and_start_line(server: Any, expected_version: str, lines: Lines) -> None:
    from prometheus_client import REGISTRY
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    assert RENDERER_REGISTRY.renderers["tokcache"] == ("sidecar_client.vllm._renderer", "TokcacheRenderer")
    assert TokenizerRegistry.tokenizers["tokcache"] == TokenizerRegistry.tokenizers["hf"]
    renderer = server.state.online_renderer.renderer
    assert type(renderer).__name__ == "TokcacheRenderer"
    start = [m for m in lines.at("INFO", "WARNING", "ERROR") if "deadline" in m and "sidecar" in m]
    assert start == [m for m in start if m.startswith(f"tokcache: vLLM {expected_version} is verified")]
    assert len(start) == 1, lines.at("INFO", "WARNING", "ERROR")
    assert not lines.at("WARNING", "ERROR")
    assert REGISTRY.get_sample_value("tokcache_vllm_plugin_state",
                                     {"vllm": expected_version, "state": "verified", "hook": ""}) == 1.0


def test_render_endpoints_return_the_sidecars_ids(server: Any, sidecar: Sidecar, model_dir: Path,
                                                  loop: asyncio.AbstractEventLoop) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List two colours.\n\n"}]
    before = stats()
    chat = loop.run_until_complete(post(server, "/v1/chat/completions/render", {"model": "tiny", "messages": messages}))
    text = "Once upon a time\n\nthere was"
    cmpl = loop.run_until_complete(post(server, "/v1/completions/render", {"model": "tiny", "prompt": text}))
    # The rendered chat text, by vLLM's own renderer (what the sidecar is asked to tokenize).
    (_, (engine_input,)) = loop.run_until_complete(server.state.online_renderer.render_chat(
        ChatCompletionRequest(model="tiny", messages=messages)))
    with SidecarClient(sidecar.address) as client:
        want_chat = client.tokenize("qwen3", text=engine_input["prompt"], add_special_tokens=False, mode="kv-stable")
        want_cmpl = client.tokenize("qwen3", text=text, add_special_tokens=True, mode="kv-stable")
    assert chat["token_ids"] == want_chat.token_ids == engine_input["prompt_token_ids"]
    assert [r["token_ids"] for r in cmpl] == [want_cmpl.token_ids]
    after = stats()
    served = sum(after["served"].values()) - sum(before["served"].values())
    assert served == 3 and after["fallbacks"] == before["fallbacks"] == {}


def output(index: int, text: str, ids: list[int], finish: str | None) -> Any:
    from vllm.outputs import CompletionOutput

    return CompletionOutput(index=index, text=text, token_ids=ids, cumulative_logprob=None, logprobs=None,
                            finish_reason=finish, stop_reason=None)


class Engine:
    """What stands in for the engine core under vLLM's real ``AsyncLLM.generate``.

    ``add_request`` checks the arguments against vLLM's own ``add_request`` and returns vLLM's
    ``RequestOutputCollector``, into which the scripted ``RequestOutput``s are put as the
    output handler would (DELTA chunks one by one; the collector merges what piles up).
    """

    def __init__(self, chunks: list[list[Any]], prompt_ids: list[int]) -> None:
        self.chunks = chunks
        self.prompt_ids = prompt_ids
        self.calls: list[dict[str, Any]] = []

    def instance(self) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        llm = AsyncLLM.__new__(AsyncLLM)  # no engine core: only what generate() touches is set
        llm.log_requests = False
        llm.add_request = self.add_request
        llm.abort = self.abort
        return llm

    async def add_request(self, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.outputs import RequestOutput
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.output_processor import RequestOutputCollector

        inspect.signature(AsyncLLM.add_request).bind(None, request_id, prompt, params, *args, **kwargs)
        self.calls.append({"request_id": request_id, "prompt": prompt, **kwargs})
        q = RequestOutputCollector(params.output_kind, request_id)

        async def produce() -> None:
            for i, outs in enumerate(self.chunks):
                q.put(RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=self.prompt_ids,
                                    prompt_logprobs=None, outputs=outs, finished=i == len(self.chunks) - 1))
                await asyncio.sleep(0.005)

        asyncio.get_running_loop().create_task(produce())
        return q

    async def abort(self, request_id: str, internal: bool = False) -> None:
        raise AssertionError(f"request {request_id} aborted")


async def generate(engine: Engine, engine_input: dict[str, Any], kind: Any, request_id: str) -> list[Any]:
    """Call ``AsyncLLM.generate`` (the plugin's wrapper around vLLM's) as the chat server does."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    real = inspect.signature(AsyncLLM.generate)
    extra = {k: None for k in ("session_id", "kv_hints", "reasoning_ended") if k in real.parameters}
    params = SamplingParams(max_tokens=64, output_kind=kind)
    return [out async for out in AsyncLLM.generate(engine.instance(), engine_input, params, request_id,
                                                   trace_headers=None, priority=0, data_parallel_rank=None,
                                                   **extra)]


async def render(server: Any, messages: list[dict[str, str]]) -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    _, (engine_input,) = await server.state.online_renderer.render_chat(
        ChatCompletionRequest(model="tiny", messages=messages))
    return dict(engine_input)


def test_generate_records_delta_and_final_only(server: Any, model_dir: Path, sidecar: Sidecar,
                                               loop: asyncio.AbstractEventLoop) -> None:
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    assert getattr(AsyncLLM.generate, "tokcache_wrapped", False), "the renderer did not wrap AsyncLLM.generate"
    tok = tokenizer(model_dir)
    enc = lambda s: list(tok.encode(s, add_special_tokens=False))  # noqa: E731
    before = stats()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello, then stop."}]
    # Turn 1, streamed (DELTA): three chunks, the last with EOS and the finish.
    first = loop.run_until_complete(render(server, messages))
    gen1 = enc("Hello") + SPLIT_NEWLINES + enc("World")
    text1 = tok.decode(gen1)
    assert enc(text1) != gen1  # re-encoding would lose the generated ids
    chunks = [[output(0, tok.decode(gen1[:1]), gen1[:1], None)],
              [output(0, tok.decode(gen1[1:3]), gen1[1:3], None)],
              [output(0, tok.decode(gen1[3:]), gen1[3:] + [EOS], "stop")]]
    engine = Engine(chunks, first["prompt_token_ids"])
    outs = loop.run_until_complete(generate(engine, first, RequestOutputKind.DELTA, "chatcmpl-v1"))
    assert "".join(o.outputs[0].text for o in outs) == text1 and outs[-1].finished
    assert engine.calls and engine.calls[0]["prompt"]["prompt_token_ids"] == first["prompt_token_ids"]

    # Turn 2 (non-streamed, FINAL_ONLY): its prompt extends turn 1's prompt + generated ids.
    messages += [{"role": "assistant", "content": text1}, {"role": "user", "content": "Again, twice."}]
    second = loop.run_until_complete(render(server, messages))
    ids2 = second["prompt_token_ids"]
    assert ids2[:len(first["prompt_token_ids"]) + len(gen1)] == first["prompt_token_ids"] + gen1
    gen2 = enc("Hi") + SPLIT_NEWLINES + enc("Hi") + SPLIT_NEWLINES
    text2 = tok.decode(gen2)
    engine = Engine([[output(0, text2, gen2 + [EOS], "stop")]], ids2)
    outs = loop.run_until_complete(generate(engine, second, RequestOutputKind.FINAL_ONLY, "chatcmpl-v2"))
    assert len(outs) == 1 and outs[0].outputs[0].text == text2

    # Turn 3 over the render endpoint: the render server's ids extend turn 2's prompt + output.
    messages += [{"role": "assistant", "content": text2}, {"role": "user", "content": "Thanks."}]
    third = loop.run_until_complete(post(server, "/v1/chat/completions/render", {"model": "tiny",
                                                                                 "messages": messages}))
    assert third["token_ids"][:len(ids2) + len(gen2)] == ids2 + gen2
    after = stats()
    assert after["records"].get("recorded", 0) - before["records"].get("recorded", 0) == 2
    assert after["tokenize"].get("ar", 0) - before["tokenize"].get("ar", 0) == 2
    assert after["fallbacks"] == {}
    # The sidecar itself agrees: turn 3's text is served from the recorded output.
    third_text = loop.run_until_complete(render(server, messages))["prompt"]
    with SidecarClient(sidecar.address) as client:
        res = client.tokenize("qwen3", text=third_text, add_special_tokens=False, mode="kv-stable")
    assert res.decision.source == "ar" and res.token_ids == third["token_ids"]


def test_derender_records_for_the_next_render(server: Any, model_dir: Path, sidecar: Sidecar,
                                              loop: asyncio.AbstractEventLoop) -> None:
    """The scale-out loop: render, generate elsewhere (ids), /derender here, render the next turn."""
    tok = tokenizer(model_dir)
    enc = lambda s: list(tok.encode(s, add_special_tokens=False))  # noqa: E731
    before = stats()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Answer on two lines."}]
    first = loop.run_until_complete(post(server, "/v1/chat/completions/render", {"model": "tiny",
                                                                                 "messages": messages}))
    gen = enc("Fine") + SPLIT_NEWLINES + enc("thanks")
    derendered = loop.run_until_complete(post(server, "/v1/chat/completions/derender", {
        "model": "tiny", "prompt_token_ids": first["token_ids"],
        "generate_response": {"request_id": first["request_id"],
                              "choices": [{"index": 0, "token_ids": gen + [EOS], "finish_reason": "stop"}]}}))
    answer = derendered["choices"][0]["message"]["content"]
    assert answer == tok.decode(gen)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    second = loop.run_until_complete(post(server, "/v1/chat/completions/render", {"model": "tiny",
                                                                                  "messages": messages}))
    assert second["token_ids"][:len(first["token_ids"]) + len(gen)] == first["token_ids"] + gen

    # Completions of a chat rendered by the client, the prompt ids given inside the generate
    # response, finished by length. The next prompt continues after the template's end of turn.
    text = "<|im_start|>user\nCount with me: one<|im_end|>\n<|im_start|>assistant\n"
    (cmpl,) = loop.run_until_complete(post(server, "/v1/completions/render", {"model": "tiny", "prompt": text}))
    gen = enc(" two") + SPLIT_NEWLINES + enc("three")
    out = loop.run_until_complete(post(server, "/v1/completions/derender", {
        "model": "tiny", "generate_responses": [{
            "request_id": cmpl["request_id"], "prompt_token_ids": cmpl["token_ids"],
            "choices": [{"index": 0, "token_ids": gen, "finish_reason": "length"}]}]}))
    assert out["choices"][0]["text"] == tok.decode(gen)
    following = text + out["choices"][0]["text"] + "<|im_end|>\n<|im_start|>user\nMore<|im_end|>\n"
    (again,) = loop.run_until_complete(post(server, "/v1/completions/render", {"model": "tiny",
                                                                               "prompt": following}))
    assert again["token_ids"][:len(cmpl["token_ids"]) + len(gen)] == cmpl["token_ids"] + gen
    after = stats()
    assert after["records"].get("recorded", 0) - before["records"].get("recorded", 0) == 2
    assert after["tokenize"].get("ar", 0) - before["tokenize"].get("ar", 0) == 2
    assert after["fallbacks"] == {} and after["record_skips"] == before["record_skips"]

    # Without prompt ids nothing can be recorded: vLLM's answer is unchanged, the skip counted.
    bare = loop.run_until_complete(post(server, "/v1/chat/completions/derender", {
        "model": "tiny", "generate_response": {"request_id": "bare",
                                               "choices": [{"index": 0, "token_ids": gen, "finish_reason": "stop"}]}}))
    assert bare["choices"][0]["message"]["content"] == tok.decode(gen)
    skips = stats()["record_skips"]
    assert skips.get("no_prompt_ids", 0) - before["record_skips"].get("no_prompt_ids", 0) == 1


def test_an_unverified_version_whose_hooks_check_out_runs_with_one_warning(
        server: Any, model_dir: Path, sidecar: Sidecar, lines: Lines, monkeypatch: pytest.MonkeyPatch,
        loop: asyncio.AbstractEventLoop) -> None:
    import vllm
    from prometheus_client import REGISTRY

    from sidecar_client.vllm._renderer import forget_process_state

    forget_process_state()  # vLLM starts again, calling itself a version not verified
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    first = len(lines.records)
    app = loop.run_until_complete(build_render_server(render_server_args(model_dir)))
    messages = [{"role": "user", "content": "Unverified:\n\nstill served"}]
    chat = loop.run_until_complete(post(app, "/v1/chat/completions/render", {"model": "tiny", "messages": messages}))
    prompt = loop.run_until_complete(render(app, messages))["prompt"]
    loud = [(r.levelname, r.getMessage()) for r in lines.records[first:] if r.levelname in ("WARNING", "ERROR")]
    assert len(loud) == 1 and loud[0][0] == "WARNING", loud
    assert loud[0][1].startswith("tokcache: vLLM 0.99.0 is not a verified version (verified: 0.32, 0.33, 0.34); "
                                 "its hook points check out; sidecar unix://")
    with SidecarClient(sidecar.address) as client:
        want = client.tokenize("qwen3", text=prompt, add_special_tokens=False, mode="kv-stable")
    assert chat["token_ids"] == want.token_ids and sum(stats()["served"].values()) == 2
    assert REGISTRY.get_sample_value("tokcache_vllm_plugin_state",
                                     {"vllm": "0.99.0", "state": "unverified", "hook": ""}) == 1.0
    forget_process_state()


def test_a_removed_hook_is_one_error_line_and_vllms_own_tokenization(
        server: Any, model_dir: Path, expected_version: str, lines: Lines, monkeypatch: pytest.MonkeyPatch,
        loop: asyncio.AbstractEventLoop) -> None:
    from prometheus_client import REGISTRY
    from vllm.v1.engine.async_llm import AsyncLLM

    from sidecar_client.vllm._renderer import forget_process_state, get_runtime

    forget_process_state()  # vLLM starts again, in a process whose AsyncLLM lacks generate
    monkeypatch.delattr(AsyncLLM, "generate")
    first = len(lines.records)
    app = loop.run_until_complete(build_render_server(render_server_args(model_dir)))
    messages = [{"role": "user", "content": "Two lines:\n\nend"}]
    chat = loop.run_until_complete(post(app, "/v1/chat/completions/render", {"model": "tiny", "messages": messages}))
    prompt = loop.run_until_complete(render(app, messages))["prompt"]
    errors = [r.getMessage() for r in lines.records[first:] if r.levelname == "ERROR"]
    # Deleted from AsyncLLM, generate is EngineClient's abstract one: not what the plugin wraps.
    hook = "AsyncLLM.generate is not an async generator"
    assert errors == [f"tokcache: vLLM {expected_version} is verified (verified: 0.32, 0.33, 0.34); hook {hook}; "
                      "vLLM tokenizes every prompt itself (counted: "
                      'tokcache_vllm_fallback_total{reason="hook_missing"})']
    assert get_runtime() is None
    assert chat["token_ids"] == list(tokenizer(model_dir).encode(prompt, add_special_tokens=False))  # vLLM's own
    assert REGISTRY.get_sample_value("tokcache_vllm_fallback_total", {"reason": "hook_missing"}) == 2.0
    assert REGISTRY.get_sample_value("tokcache_vllm_plugin_state", {
        "vllm": expected_version, "state": "hook_missing", "hook": hook}) == 1.0
    forget_process_state()
