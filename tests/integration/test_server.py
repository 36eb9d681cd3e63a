"""The real server on a unix socket, driven by the real client (sync and async)."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tokenizers

import sidecar_client
from sidecar_client import (
    AsyncSidecarClient,
    InvalidArgumentError,
    ResourceExhaustedError,
    SidecarClient,
    SidecarUnavailable,
    UnknownModelError,
)
from tests.integration.sidecar_proc import SidecarProcess


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory, qwen3_path: Path, llama32_path: Path) -> Iterator[SidecarProcess]:
    import uuid

    tmp = tmp_path_factory.mktemp("sidecar")
    prefix = f"tkt-int-{uuid.uuid4().hex[:8]}"
    proc = SidecarProcess(tmp, {"qwen3": qwen3_path, "llama": llama32_path}, prefix,
                          "--max-text-bytes", "1MiB", "--max-messages", "50").start()
    yield proc
    code = proc.stop()
    for p in Path("/dev/shm").glob(f"*{prefix}*"):
        p.unlink()
    assert code == 0, proc.log()


@pytest.fixture
def client(sidecar: SidecarProcess) -> Iterator[SidecarClient]:
    # min_write_bytes=0: reads in this process store what they learned however short
    # (these tests check cache decisions on short texts).
    with SidecarClient(sidecar.address, min_write_bytes=0) as c:
        yield c


def _ref(path: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


CHAT = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files.\n\n  indented  \t tabs 你好 🎉"},
]
TOOLS = [{"type": "function", "function": {"name": "ls", "description": "list files",
                                            "parameters": {"type": "object", "properties": {}}}}]


def test_list_models(client: SidecarClient, qwen3_path: Path) -> None:
    models = {m.name: m for m in client.list_models()}
    assert set(models) == {"qwen3", "llama"}
    assert models["qwen3"].backend == "fastokens"
    assert models["qwen3"].has_chat_template and models["qwen3"].boundary_tokens >= 20
    assert len(models["qwen3"].fingerprint) == 32


def test_text_tokenize_and_decisions(client: SidecarClient, qwen3_path: Path, llama32_path: Path) -> None:
    import uuid

    salt = uuid.uuid4().hex
    for model, path in (("qwen3", qwen3_path), ("llama", llama32_path)):
        ref = _ref(path)
        t1 = "<|im_start|>user\nhello  world<|im_end|>\n<|eot_id|>x"
        r1 = client.tokenize(model, text=t1, cache_salt=salt)
        assert r1.token_ids == ref.encode(t1).ids  # default add_special_tokens=True for text
        assert r1.decision.source == "miss"
        t2 = t1 + "<|im_start|>assistant\nsure<|eot_id|>"
        r2 = client.tokenize(model, text=t2, cache_salt=salt, add_special_tokens=False)
        assert r2.token_ids == ref.encode(t2, add_special_tokens=False).ids
        assert r2.decision.source == "l1" and r2.decision.cached_tokens > 0
        # A client that records no outputs stores each read's entries in the request: the same
        # text read again (with the tokenizer's special tokens this time) is cached whole.
        r3 = client.tokenize(model, text=t2, cache_salt=salt, add_special_tokens=True)
        assert r3.token_ids == ref.encode(t2, add_special_tokens=True).ids
        assert r3.decision.source == "l0"


def test_chat_tokenize_matches_transformers(client: SidecarClient, qwen3_path: Path, llama32_path: Path) -> None:
    from transformers import AutoTokenizer

    for model, path in (("qwen3", qwen3_path), ("llama", llama32_path)):
        hf = AutoTokenizer.from_pretrained(str(path))
        want = hf.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
        r = client.tokenize(model, messages=CHAT, tools=TOOLS, add_generation_prompt=True, return_prompt_text=True)
        assert r.token_ids == list(want)
        assert r.prompt_text == hf.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert client.render(model, CHAT, tools=TOOLS, add_generation_prompt=True) == r.prompt_text


def test_chat_with_tool_calls_parts_and_kwargs(client: SidecarClient, qwen3_path: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(qwen3_path))
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": "", "reasoning_content": "think first",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "ls", "arguments": {"path": ".", "deep": [1, {"x": None}]}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"files": ["a.py"]}'},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nDone."},
        {"role": "user", "content": "thanks"},
    ]
    hf_msgs = [dict(m, content="part one\npart two") if i == 0 else m for i, m in enumerate(msgs)]
    for kwargs in ({}, {"enable_thinking": False}):
        want = hf.apply_chat_template(hf_msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                      return_dict=False, **kwargs)
        r = client.tokenize("qwen3", messages=msgs, tools=TOOLS, add_generation_prompt=True,
                            chat_template_kwargs=kwargs)
        assert r.token_ids == list(want)


def test_errors_name_the_field(client: SidecarClient) -> None:
    with pytest.raises(UnknownModelError, match="nope"):
        client.tokenize("nope", text="x")
    with pytest.raises(InvalidArgumentError) as e:
        client.tokenize("qwen3", messages=[{"content": "no role"}])
    assert e.value.field == "messages[0].role"
    with pytest.raises(InvalidArgumentError) as e:
        client.tokenize("qwen3", messages=[{"role": "user", "content": 42}])
    assert e.value.field == "messages[0].content"
    with pytest.raises(InvalidArgumentError, match="image_url"):
        client.tokenize("qwen3", messages=[{"role": "user", "content": [{"type": "image_url", "text": ""}]}])
    with pytest.raises(InvalidArgumentError, match="^messages: "):
        client.tokenize("qwen3", messages=[])
    with pytest.raises(ResourceExhaustedError, match="text"):
        client.tokenize("qwen3", text="x" * (2 << 20))
    with pytest.raises(ResourceExhaustedError, match="messages"):
        client.tokenize("qwen3", messages=[{"role": "user", "content": "x"}] * 51)
    # transformers refuses continue_final_message together with add_generation_prompt.
    with pytest.raises(InvalidArgumentError):
        client.tokenize("qwen3", messages=[{"role": "user", "content": "x"}],
                        add_generation_prompt=True, continue_final_message=True)
    # Still serving after all that.
    assert client.tokenize("qwen3", text="still alive").token_ids


def test_server_side_validation_of_raw_requests(sidecar: SidecarProcess) -> None:
    """Requests the client library would refuse, sent raw: the server names the field."""
    import grpc

    from tokcache.v1 import tokenizer_pb2 as pb
    from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc

    with grpc.insecure_channel(sidecar.address) as ch:
        stub = pb_grpc.TokenizerStub(ch)
        cases = [
            (pb.TokenizeRequest(model="qwen3"), grpc.StatusCode.INVALID_ARGUMENT, "input"),
            (pb.TokenizeRequest(text="x"), grpc.StatusCode.INVALID_ARGUMENT, "model"),
            (pb.TokenizeRequest(model="qwen3", chat=pb.ChatInput()), grpc.StatusCode.INVALID_ARGUMENT, "messages"),
            (pb.TokenizeRequest(model="qwen3", chat=pb.ChatInput(messages=[pb.ChatMessage(role="user")],
                                                                 tools_json="{")),
             grpc.StatusCode.INVALID_ARGUMENT, "tools"),
            (pb.TokenizeRequest(model="qwen3", chat=pb.ChatInput(messages=[pb.ChatMessage(role="user",
                                                                                          extra_json="[1]")])),
             grpc.StatusCode.INVALID_ARGUMENT, "messages[0]"),
            (pb.TokenizeRequest(model="qwen3", text="x", mode=7), grpc.StatusCode.INVALID_ARGUMENT, "mode"),
        ]
        for req, code, field in cases:
            with pytest.raises(grpc.RpcError) as e:
                stub.Tokenize(req)
            assert e.value.code() == code, (req, e.value.details())
            assert e.value.details().startswith(field), e.value.details()


def test_async_client_and_module_level(sidecar: SidecarProcess, qwen3_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _ref(qwen3_path)

    async def run() -> list[list[int]]:
        async with AsyncSidecarClient(sidecar.address) as c:
            rs = await asyncio.gather(*(c.tokenize("qwen3", text=f"async {i} <|im_end|> x") for i in range(20)))
            with pytest.raises(UnknownModelError):
                await c.tokenize("missing", text="x")
            assert (await c.render("qwen3", CHAT)).startswith("<|im_start|>system")
            return [r.token_ids for r in rs]

    got = asyncio.run(run())
    assert got == [ref.encode(f"async {i} <|im_end|> x").ids for i in range(20)]
    monkeypatch.setenv("TOKCACHE_ADDRESS", sidecar.address)
    assert sidecar_client.tokenize("qwen3", text="module level").token_ids == ref.encode("module level").ids


def test_unreachable_sidecar_is_a_typed_error(tmp_path: Path) -> None:
    with SidecarClient(f"unix://{tmp_path}/none.sock", timeout=1) as c:
        with pytest.raises(SidecarUnavailable):
            c.tokenize("qwen3", text="x")


# Three sidecar lives (SIGTERM, then SIGKILL) over one segment: process lifecycle, run once
# (tests/conftest.py); re-attaching a segment is checked on every Python by test_store_attach.
@pytest.mark.once
def test_restart_reattaches_warm_cache(tmp_path: Path, qwen3_path: Path, shm_prefix: str) -> None:
    text = "<|im_start|>user\n" + "warm cache " * 200 + "<|im_end|>\n<|im_start|>assistant\n"
    first = SidecarProcess(tmp_path, {"qwen3": qwen3_path}, shm_prefix).start()
    try:
        with SidecarClient(first.address, min_write_bytes=0) as c:
            assert c.tokenize("qwen3", text=text).decision.source == "miss"
    finally:
        assert first.stop() == 0
    # A SIGKILLed sidecar leaves the segment behind; the next one re-attaches.
    second = SidecarProcess(tmp_path, {"qwen3": qwen3_path}, shm_prefix).start()
    try:
        with SidecarClient(second.address) as c:
            r = c.tokenize("qwen3", text=text)
            assert r.decision.source == "l0"
            assert r.token_ids == _ref(qwen3_path).encode(text).ids
        second.stop(signal.SIGKILL)
        third = SidecarProcess(tmp_path, {"qwen3": qwen3_path}, shm_prefix).start()
        with SidecarClient(third.address) as c:
            assert c.tokenize("qwen3", text=text).decision.source == "l0"
        assert third.stop() == 0
    finally:
        second.kill()
    assert "re-attached warm" in second.log_path.read_text()


def test_config_file_and_env(tmp_path: Path, qwen3_path: Path, shm_prefix: str) -> None:
    cfg = tmp_path / "tokcache.toml"
    cfg.write_text(f'shm_size = "16MiB"\nmax_text_bytes = "1KiB"\n[models]\nq = "{qwen3_path}"\n')
    proc = SidecarProcess(tmp_path, {}, shm_prefix, "--config", str(cfg),
                          env={"TOKCACHE_MAX_TEXT_BYTES": "2KiB"}).start()
    try:
        with SidecarClient(proc.address) as c:
            assert [m.name for m in c.list_models()] == ["q"]
            c.tokenize("q", text="x" * 1500)  # env (2 KiB) beats the file (1 KiB)
            with pytest.raises(ResourceExhaustedError):
                c.tokenize("q", text="x" * 2100)
    finally:
        assert proc.stop() == 0
    json.dumps({})
