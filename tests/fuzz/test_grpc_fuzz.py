"""Fuzz the gRPC API of a real sidecar: every request gets a status, the server stays up, memory stays bounded.

Requests are built at the protobuf wire level (tests/fuzz/wire.py) and sent through
generic ``unary_unary``/``stream_unary`` calls with identity serializers, so the server
sees exactly the bytes generated: random garbage, malformed messages, invalid UTF-8 and
lone surrogates in strings and JSON, deep nesting, ids at and past the vocabulary edge,
sizes past every limit. Each call has a deadline; a DEADLINE_EXCEEDED or UNAVAILABLE would
mean a hung or dead server and fails the test.

Default budget ~1 minute. ``TOKCACHE_FUZZ_SCALE=10`` runs every test 10 times (fresh
Hypothesis runs of the same size: one run's memory grows with the choices it made, so
longer runs are more runs, not bigger ones); ``TOKCACHE_FUZZ_REPORT=path.json`` writes
the counts. The test process fails itself past ``MAX_CLIENT_RSS`` rather than endanger
the machine.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz import wire
from tests.stress.harness import SidecarProc, channel, pack, rss, unlink_prefix
from tokcache.v1 import tokenizer_pb2 as pb

SCALE = float(os.environ.get("TOKCACHE_FUZZ_SCALE", "1"))
ROUNDS = list(range(max(1, int(SCALE))))
MAX_CLIENT_RSS = 2 << 30
DEADLINE = 60.0
SERVICE = "/tokcache.v1.Tokenizer/"
# Codes a request may get: the service's mapping of domain errors (INTERNAL would be a bug
# caught by the servicer; UNKNOWN an exception nothing caught), and RESOURCE_EXHAUSTED for
# messages over --max-request-bytes.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def fuzz(n: int) -> settings:
    """Settings for one round of a fuzz test: ``n`` examples."""
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.function_scoped_fixture, HealthCheck.large_base_example],
    )

codes: Counter[str] = Counter()
server_pids: list[int] = []
server_rss: list[tuple[int, int]] = []  # (requests so far, server RSS), every 500 requests


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProc]:
    prefix = f"tkfuzz-{uuid.uuid4().hex[:8]}"
    proc = SidecarProc(tmp_path_factory.mktemp("fuzz"), prefix, "--max-text-bytes", "1MiB",
                       "--max-messages", "50", "--max-request-bytes", "4MiB", shm_size="8MiB").start()
    proc.rss_start = proc.total_rss()  # type: ignore[attr-defined]
    server_pids.append(proc.pid)
    yield proc
    try:
        assert proc.stop() == 0, proc.log()
    finally:
        unlink_prefix(prefix)


@pytest.fixture(scope="module")
def ch(sidecar: SidecarProc) -> Iterator[grpc.Channel]:
    with channel(sidecar.address) as c:
        yield c


def _guard_memory() -> None:
    total = sum(codes.values())
    if total % 200 == 0 and rss(os.getpid()) > MAX_CLIENT_RSS:
        pytest.fail(f"the fuzz client itself passed {MAX_CLIENT_RSS >> 20} MiB RSS: generator bug")
    if total % 500 == 0 and server_pids:
        server_rss.append((total, rss(server_pids[0])))


def _unary(ch: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    _guard_memory()
    call: Any = ch.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
    details = ""
    try:
        call(payload, timeout=DEADLINE)
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
    codes[f"{method} {code.name}"] += 1
    assert code in ALLOWED, (method, code, details, payload[:200])
    return code


@pytest.mark.parametrize("round_", ROUNDS)
@fuzz(150)
@given(method=st.sampled_from(["Tokenize", "Render", "RecordOutput", "ListModels"]),
       payload=st.one_of(st.binary(max_size=200), st.binary(min_size=1000, max_size=5000)))
def test_random_bytes(ch: grpc.Channel, round_: int, method: str, payload: bytes) -> None:
    _unary(ch, method, payload)


@pytest.mark.parametrize("round_", ROUNDS)
@fuzz(900)
@given(payload=wire.tokenize_request())
def test_tokenize(ch: grpc.Channel, round_: int, payload: bytes) -> None:
    _unary(ch, "Tokenize", payload)


@pytest.mark.parametrize("round_", ROUNDS)
@fuzz(250)
@given(payload=wire.render_request())
def test_render(ch: grpc.Channel, round_: int, payload: bytes) -> None:
    _unary(ch, "Render", payload)


@pytest.mark.parametrize("round_", ROUNDS)
@fuzz(500)
@given(payload=wire.record_output_request())
def test_record_output(ch: grpc.Channel, round_: int, payload: bytes) -> None:
    _unary(ch, "RecordOutput", payload)


@pytest.mark.parametrize("round_", ROUNDS)
@fuzz(60)
@given(items=st.lists(st.one_of(wire.record_output_request(), st.binary(max_size=64)), max_size=8))
def test_record_outputs_stream(ch: grpc.Channel, round_: int, items: list[bytes]) -> None:
    call: Any = ch.stream_unary(SERVICE + "RecordOutputs", request_serializer=None, response_deserializer=None)
    try:
        call(iter(items), timeout=DEADLINE)
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
    codes[f"RecordOutputs {code.name}"] += 1
    assert code in ALLOWED


@pytest.mark.parametrize("round_", ROUNDS)
@fuzz(150)
@given(output=st.lists(st.one_of(st.sampled_from([wire.VOCAB - 1, wire.VOCAB, wire.VOCAB + 1, 2**32 - 1]),
                                 st.integers(0, 1000)), min_size=1, max_size=8),
       stop=st.one_of(st.none(), st.sampled_from([wire.VOCAB - 1, wire.VOCAB, 2**32 - 1, 151_645])))
def test_record_output_vocabulary_edge(ch: grpc.Channel, round_: int, output: list[int], stop: int | None) -> None:
    # A well-formed record whose only fault is the ids: refused as INVALID_ARGUMENT unless valid.
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]
    request = pb.RecordOutputRequest(model="qwen3", prompt_text=prompt, prompt_token_ids=pack(prompt_ids),
                                     output_text="ok", output_token_ids=pack(output), finish_reason="stop",
                                     cache_salt="fuzz-edge")
    if stop is not None:
        request.stop_token_id = stop
    code = _unary(ch, "RecordOutput", request.SerializeToString())
    if any(i >= wire.VOCAB for i in output):
        assert code is grpc.StatusCode.INVALID_ARGUMENT


def test_sizes_past_every_limit(ch: grpc.Channel) -> None:
    big = "a" * ((1 << 20) + 1)  # --max-text-bytes 1MiB
    cases = [
        ("Tokenize", pb.TokenizeRequest(model="qwen3", text=big), grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("Tokenize", pb.TokenizeRequest(model="qwen3", text="x" * (5 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("Tokenize", pb.TokenizeRequest(model="qwen3", chat=pb.ChatInput(
            messages=[pb.ChatMessage(role="user", content="m")] * 51)), grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("RecordOutput", pb.RecordOutputRequest(model="qwen3", prompt_text="p", output_text=big),
         grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("Tokenize", pb.TokenizeRequest(model="qwen3", text=""), grpc.StatusCode.OK),
        ("Tokenize", pb.TokenizeRequest(model="qwen3"), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for method, request, want in cases:
        assert _unary(ch, method, request.SerializeToString()) is want, (method, want)


def test_lone_surrogate_escapes_in_json(ch: grpc.Channel) -> None:
    # Valid JSON, valid UTF-8 on the wire, yet it renders to a lone surrogate (found by this fuzzer).
    tools = '[{"type": "function", "function": {"name": "\\ud800", "description": "x"}}]'
    call = pb.ToolCall(function=pb.ToolCallFunction(name="f", arguments_json='{"a": "\\udfff"}'))
    chats = [
        pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")], tools_json=tools),
        pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi"),
                               pb.ChatMessage(role="assistant", content="", tool_calls=[call])]),
    ]
    for chat in chats:
        for method, request in (("Render", pb.RenderRequest(model="qwen3", chat=chat)),
                                ("Tokenize", pb.TokenizeRequest(model="qwen3", chat=chat))):
            assert _unary(ch, method, request.SerializeToString()) is grpc.StatusCode.INVALID_ARGUMENT, method


def test_deep_nesting_is_invalid_argument(ch: grpc.Channel) -> None:
    # Deep enough to overflow a recursive walk (templates recurse into values): every JSON
    # field is refused by its depth, before rendering, never INTERNAL.
    nested: Any = "x"
    for i in range(400):
        nested = {"k": [nested, i]} if i % 2 else [nested]
    deep = json.dumps({"a": nested})
    user = pb.ChatMessage(role="user", content="hi")
    call = pb.ToolCall(function=pb.ToolCallFunction(name="f", arguments_json=deep))
    chats = {
        "arguments_json": pb.ChatInput(messages=[user, pb.ChatMessage(role="assistant", content="",
                                                                      tool_calls=[call])]),
        "extra_json": pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi", extra_json=deep)]),
        "tools_json": pb.ChatInput(messages=[user], tools_json=json.dumps([{"type": "function", "function": {
            "name": "f", "parameters": nested}}])),
        "chat_template_kwargs_json": pb.ChatInput(messages=[user], chat_template_kwargs_json=deep),
    }
    for field, chat in chats.items():
        for method, request in (("Render", pb.RenderRequest(model="qwen3", chat=chat)),
                                ("Tokenize", pb.TokenizeRequest(model="qwen3", chat=chat))):
            assert _unary(ch, method, request.SerializeToString()) is grpc.StatusCode.INVALID_ARGUMENT, (field,
                                                                                                          method)


def test_server_alive_correct_and_bounded(sidecar: SidecarProc, ch: grpc.Channel) -> None:
    """Runs last in this module: the server survived everything above and still answers right."""
    import tokenizers

    assert sidecar.alive()
    from tokcache.sidecar.bundled import qwen3_dir

    ref = tokenizers.Tokenizer.from_file(str(qwen3_dir() / "tokenizer.json"))
    text = "<|im_start|>user\nstill fine? 你好 🎉<|im_end|>\n"
    response = ch.unary_unary(SERVICE + "Tokenize", request_serializer=pb.TokenizeRequest.SerializeToString,
                              response_deserializer=pb.TokenizeResponse.FromString)(
        pb.TokenizeRequest(model="qwen3", text=text), timeout=DEADLINE)
    assert list(response.token_ids) == list(pack(ref.encode(text).ids))
    start, end = sidecar.rss_start, sidecar.total_rss()  # type: ignore[attr-defined]
    total = sum(codes.values())
    import resource

    client_max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    summary = {"requests": total, "codes": dict(sorted(codes.items())),
               "rss_start": start, "rss_end": end, "scale": SCALE, "rounds": len(ROUNDS),
               "server_rss_every_500": server_rss, "server_alive": sidecar.alive(),
               "client_max_rss": client_max_rss, "time": time.time()}
    print(json.dumps(summary, indent=1))
    report = os.environ.get("TOKCACHE_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps(summary, indent=2))
    assert total > 1000 * min(SCALE, 1)
    # Bounded: the largest requests allowed are 4 MiB; a leak per request would show as
    # hundreds of MiB after thousands of requests.
    assert end < start + (256 << 20), summary
