"""The cluster tier on spans: two in-process servers ("nodes", each its own segment) and a real
redis-server. A's RecordOutput stores the output in A's segment and says nothing of the tier:
A's tier feed, following the segment's log, writes it through; Tokenize on B says what the
tier gave it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sidecar_client import AsyncSidecarClient
from tests.ar_helpers import noncanonical
from tests.redis_servers import RedisServer, server
from tokcache.sidecar.engine.model import ModelEngine
from tokcache.sidecar.service import TokenizerService
from tokcache.sidecar.telemetry import Metrics, Tracing
from tokcache.sidecar.tier import ArTier, TierFeed, TierUrl
from tokcache.store import Store
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc


@pytest.fixture
def redis_node(tmp_path: Path) -> Iterator[RedisServer]:
    with server(tmp_path / "redis") as s:
        yield s


def _engine(qwen3_path: Path) -> ModelEngine:
    eng = ModelEngine("qwen3", qwen3_path, store=None)
    eng.store = Store.open(prefix=f"tkt-tspan-{uuid.uuid4().hex[:8]}", fingerprint=eng.fingerprint, size=16 << 20)
    return eng


def test_tier_attributes_on_record_and_tokenize_spans(qwen3_path: Path, tmp_path: Path,
                                                      redis_node: RedisServer) -> None:
    engines = {"a": _engine(qwen3_path), "b": _engine(qwen3_path)}
    exporters = {k: InMemorySpanExporter() for k in engines}
    salt = uuid.uuid4().hex
    answer = "Sure.\n\n  spaced out\n\n\nanswer"
    text = f"<|im_start|>user\nspans {salt}<|im_end|>\n<|im_start|>assistant\n"
    nxt = text + answer + "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    gen = noncanonical(engines["a"], answer)

    async def main() -> tuple[list[int], list[int]]:
        servers, tiers, addresses = [], {}, {}
        for k, eng in engines.items():
            tiers[k] = ArTier(TierUrl.parse(redis_node.url), timeout_s=0.5)
            await tiers[k].start()
            service = TokenizerService(metrics=Metrics(), tracing=Tracing(SimpleSpanProcessor(exporters[k])),
                                       tier=tiers[k])
            service.set_engines({"qwen3": eng})
            srv = grpc.aio.server()
            pb_grpc.add_TokenizerServicer_to_server(service, srv)
            addresses[k] = f"unix://{tmp_path}/{k}.sock"
            srv.add_insecure_port(addresses[k])
            await srv.start()
            servers.append(srv)
        try:
            eng_a = engines["a"]
            feed = TierFeed(tiers["a"], lambda: [(eng_a.fingerprint, eng_a.store)])
            feed.start()
            async with AsyncSidecarClient(addresses["a"], zero_rpc=False) as a, \
                    AsyncSidecarClient(addresses["b"], zero_rpc=False) as b:
                r = await a.tokenize("qwen3", text=text, add_special_tokens=False, cache_salt=salt)
                await a.record_output("qwen3", prompt_text=text, prompt_token_ids=r.token_ids, output_text=answer,
                                      output_token_ids=gen, cache_salt=salt)
                # Written through by the feed within FOLLOW_S, asynchronously: wait for it, bounded.
                deadline = time.monotonic() + 10
                while not db.keys(f"tokcache:ar:{eng_a.fingerprint}:*") and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert db.keys(f"tokcache:ar:{eng_a.fingerprint}:*"), "the feed never wrote the record through"
                await feed.stop()
                got = await b.tokenize("qwen3", text=nxt, add_special_tokens=False, cache_salt=salt)
                assert got.decision.source == "ar"
                return r.token_ids + gen, got.token_ids
        finally:
            for srv in servers:
                await srv.stop(None)
            for tier in tiers.values():
                await tier.close()

    db = redis.Redis.from_url(redis_node.url)
    try:
        before, after = asyncio.run(main())
        assert after[:len(before)] == before
    finally:
        db.close()
        for eng in engines.values():
            assert eng.store is not None
            eng.store.unlink()
            eng.store.close()
    a_spans = {s.name.rsplit("/", 1)[1]: s for s in exporters["a"].get_finished_spans()
               if s.name.startswith("tokcache.v1.Tokenizer/")}
    attrs = a_spans["RecordOutput"].attributes or {}
    assert "tokcache.tier_write" not in attrs  # the feed writes it through, not the handler
    # A's first Tokenize had nothing recorded anywhere: it asked, and missed.
    first = a_spans["Tokenize"].attributes or {}
    assert first["tokcache.tier_result"] == "miss" and first["tokcache.tier_records"] == 0
    b_finished = exporters["b"].get_finished_spans()
    (tok,) = [s for s in b_finished if s.name == "tokcache.v1.Tokenizer/Tokenize"]
    attrs = tok.attributes or {}
    assert attrs["tokcache.tier_result"] == "hit" and attrs["tokcache.source"] == "ar"
    assert attrs["tokcache.tier_records"] >= 1 and attrs["tokcache.tier_invalid"] == 0
    assert attrs["tokcache.tier_keys"] >= 1 and 0 < attrs["tokcache.tier_seconds"] < 0.5
    children = [s.name for s in b_finished if s.parent is not None and s.parent.span_id == tok.context.span_id]
    assert "tokcache.tier" in children
