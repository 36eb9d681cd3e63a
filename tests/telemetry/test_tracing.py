"""Spans of a real in-process gRPC server, checked with an in-memory exporter."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sidecar_client import AsyncSidecarClient, UnknownModelError
from tests.ar_helpers import noncanonical
from tokcache.sidecar.engine.model import ModelEngine
from tokcache.sidecar.service import TokenizerService
from tokcache.sidecar.telemetry import Metrics, Tracing, exporter_from_env
from tokcache.store import Store
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(scope="module")
def engine(qwen3_path: Path) -> Iterator[ModelEngine]:
    # Every cut keyed: the spans below name the decision of each turn of a short chat.
    eng = ModelEngine("qwen3", qwen3_path, store=None, key_grid=0)
    eng.store = Store.open(prefix=f"tkt-trace-{uuid.uuid4().hex[:8]}", fingerprint=eng.fingerprint, size=16 << 20)
    yield eng
    eng.store.unlink()
    eng.store.close()


def _run(engine: ModelEngine, tmp_path: Path, body: Any) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    service = TokenizerService(metrics=Metrics(), tracing=Tracing(SimpleSpanProcessor(exporter)))
    service.set_engines({"qwen3": engine})

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_TokenizerServicer_to_server(service, server)
        address = f"unix://{tmp_path}/t.sock"
        server.add_insecure_port(address)
        await server.start()
        try:
            async with AsyncSidecarClient(address, metadata=[("traceparent", TRACEPARENT)]) as c:
                await body(c)
        finally:
            await server.stop(None)

    asyncio.run(main())
    return exporter


def test_spans_carry_decisions_and_parent(engine: ModelEngine, tmp_path: Path) -> None:
    salt = uuid.uuid4().hex
    answer = "Fine.\n\n  indented\n\n\nend"
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "trace me " + salt}]

    async def body(c: AsyncSidecarClient) -> None:
        r1 = await c.tokenize("qwen3", messages=msgs, add_generation_prompt=True, cache_salt=salt,
                              return_prompt_text=True)  # miss
        await c.tokenize("qwen3", messages=msgs, add_generation_prompt=True, cache_salt=salt)  # l0
        await c.record_output("qwen3", prompt_text=r1.prompt_text or "", prompt_token_ids=r1.token_ids,
                              output_text=answer, output_token_ids=noncanonical(engine, answer), cache_salt=salt)
        more = msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": "go on"}]
        await c.tokenize("qwen3", messages=more, add_generation_prompt=True, cache_salt=salt)  # ar
        await c.tokenize("qwen3", messages=more + [{"role": "assistant", "content": "x"},
                                                   {"role": "user", "content": "y"}],
                         add_generation_prompt=True, cache_salt=salt)  # l1
        await c.tokenize("qwen3", messages=more, add_generation_prompt=True, cache_salt=salt, mode="exact")

    spans = _run(engine, tmp_path, body).get_finished_spans()
    rpcs = [s for s in spans if s.name.startswith("tokcache.v1.Tokenizer/")]
    assert [s.name.rsplit("/", 1)[1] for s in rpcs] == ["Tokenize", "Tokenize", "RecordOutput", "Tokenize",
                                                       "Tokenize", "Tokenize"]
    tok = [s for s in rpcs if s.name.endswith("/Tokenize")]
    assert [s.attributes["tokcache.source"] for s in tok] == ["miss", "l0", "ar", "l1", "miss"]
    # The client sent them over its TokenizeStream; the stream's metadata parented them.
    assert {s.attributes["tokcache.transport"] for s in tok} == {"stream"}
    for s in rpcs:
        assert format(s.context.trace_id, "032x") == TRACE_ID
        assert s.parent is not None and format(s.parent.span_id, "016x") == PARENT_ID
        assert s.attributes["rpc.grpc.status_code"] == "OK"
    miss, l0, ar = tok[0], tok[1], tok[2]
    assert miss.attributes["tokcache.cached_tokens"] == 0 and miss.attributes["tokcache.encoded_chars"] > 0
    assert l0.attributes["tokcache.cached_tokens"] == l0.attributes["tokcache.num_tokens"]
    assert ar.attributes["tokcache.ar_spliced_tokens"] >= len(noncanonical(engine, answer))
    for s in tok:
        assert s.attributes["tokcache.salt_present"] is True
        assert s.attributes["tokcache.fingerprint"] == engine.fingerprint
        assert s.attributes["tokcache.model"] == "qwen3" and s.attributes["tokcache.boundary_count"] > 0
        # Neither the salt nor any text is ever an attribute value.
        assert not any(isinstance(v, str) and (salt in v or "trace me" in v) for v in s.attributes.values())
    children = {s.name for s in spans if s.parent is not None and s.parent.span_id == miss.context.span_id}
    assert children == {"tokcache.render", "tokcache.lookup", "tokcache.encode", "tokcache.insert"}
    for s in spans:
        assert s.start_time <= s.end_time


def test_stream_requests_carry_their_own_trace_context(engine: ModelEngine, tmp_path: Path) -> None:
    from tokcache.v1 import tokenizer_pb2 as pb

    parents = ["1111111111111111", "2222222222222222"]

    async def body(c: AsyncSidecarClient) -> None:
        # A raw stream (the client sets each request's traceparent itself) to the client's server.
        async with grpc.aio.insecure_channel(c.address) as channel:
            call = channel.stream_stream("/tokcache.v1.Tokenizer/TokenizeStream",
                                         request_serializer=pb.TokenizeStreamRequest.SerializeToString,
                                         response_deserializer=pb.TokenizeStreamResponse.FromString)()
            for i, parent in enumerate(parents):
                await call.write(pb.TokenizeStreamRequest(
                    request=pb.TokenizeRequest(model="qwen3", text=f"own context {i}"),
                    traceparent=f"00-{TRACE_ID}-{parent}-01"))
                assert (await call.read()).WhichOneof("result") == "response"
            await call.done_writing()

    spans = _run(engine, tmp_path, body).get_finished_spans()
    tok = [s for s in spans if s.name == "tokcache.v1.Tokenizer/Tokenize"]
    assert [format(s.parent.span_id, "016x") for s in tok if s.parent is not None] == parents


def test_error_spans_have_status(engine: ModelEngine, tmp_path: Path) -> None:
    async def body(c: AsyncSidecarClient) -> None:
        with pytest.raises(UnknownModelError):
            await c.tokenize("nope", text="x")

    spans = _run(engine, tmp_path, body).get_finished_spans()
    assert spans[-1].attributes["rpc.grpc.status_code"] == "NOT_FOUND"
    assert not spans[-1].status.is_ok


def test_exporter_selection() -> None:
    assert exporter_from_env({}) is None
    assert exporter_from_env({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}) is None
    assert type(exporter_from_env({"OTEL_TRACES_EXPORTER": "console"})).__name__ == "ConsoleSpanExporter"
    assert type(exporter_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})).__name__ == "OTLPSpanExporter"
    assert exporter_from_env({"OTEL_TRACES_EXPORTER": "zipkin-ish"}) is None
    assert not Tracing().enabled
