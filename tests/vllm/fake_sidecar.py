"""An in-process fake sidecar (grpc.aio server on a unix socket) for the plugin's link tests.

It serves fixed models and answers Tokenize with ``len(text)`` ids counting up,
so tests can control fingerprints, delays and failures without the real engine.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tokcache.v1 import tokenizer_pb2 as pb
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc


@dataclass
class FakeState:
    models: dict[str, str]  # name -> fingerprint
    delay: float = 0.0
    fail: grpc.StatusCode | None = None
    refuse: bool = False
    tokenize_calls: list[tuple[pb.TokenizeRequest, dict[str, str]]] = field(default_factory=list)
    records: list[tuple[pb.RecordOutputRequest, dict[str, str]]] = field(default_factory=list)
    list_calls: int = 0
    record_delay: float = 0.0
    events: list[str] = field(default_factory=list)  # "tokenize" / "record", in completion order


# grpc.aio binds its completion-queue poller to the first event loop it runs on; a
# fresh loop per test (asyncio.run) makes later tests flaky. All gRPC tests share one.
_LOOP: asyncio.AbstractEventLoop | None = None


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on the one event loop the gRPC tests share."""
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    return _LOOP.run_until_complete(coro)


def ids_for(text: str) -> list[int]:
    return [100 + i for i in range(len(text))]


class FakeServicer(pb_grpc.TokenizerServicer):  # type: ignore[misc]
    def __init__(self, state: FakeState) -> None:
        self.state = state

    async def _gate(self, context: Any) -> None:
        if self.state.delay:
            await asyncio.sleep(self.state.delay)
        if self.state.fail is not None:
            await context.abort(self.state.fail, "injected failure")

    async def ListModels(self, request: Any, context: Any) -> pb.ListModelsResponse:
        self.state.list_calls += 1
        await self._gate(context)
        return pb.ListModelsResponse(models=[pb.ModelInfo(name=n, fingerprint=f, backend="fake", vocab_size=1000)
                                             for n, f in self.state.models.items()])

    async def Tokenize(self, request: pb.TokenizeRequest, context: Any) -> pb.TokenizeResponse:
        await self._gate(context)
        self.state.tokenize_calls.append((request, dict(context.invocation_metadata())))
        self.state.events.append("tokenize")
        if request.model not in self.state.models:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model}")
        ids = ids_for(request.text)
        source = pb.CACHE_SOURCE_L0 if len(self.state.tokenize_calls) > 1 else pb.CACHE_SOURCE_MISS
        return pb.TokenizeResponse(token_ids=array("I", ids).tobytes(), num_tokens=len(ids),
                                   fingerprint=self.state.models[request.model],
                                   decision=pb.CacheDecision(source=source, cached_tokens=3, ar_spliced_tokens=1))

    async def RecordOutputs(self, request_iterator: Any, context: Any) -> pb.RecordOutputsResponse:
        metadata = dict(context.invocation_metadata())
        n = 0
        async for r in request_iterator:
            self.state.records.append((r, metadata))
            n += 1
        await self._gate(context)
        await asyncio.sleep(self.state.record_delay)
        self.state.events.append("record")
        if self.state.refuse:
            return pb.RecordOutputsResponse(recorded=0, refused=n, refusals=[
                pb.RecordRefusal(index=i, reason="output_token_ids: refused by the fake") for i in range(n)])
        return pb.RecordOutputsResponse(recorded=n, refused=0)


class FakeSidecar:
    """``async with FakeSidecar(tmp_path, {"m": "fp"}) as fake: fake.address``"""

    def __init__(self, tmp: Path, models: dict[str, str]) -> None:
        self.state = FakeState(models)
        self.address = f"unix://{tmp / 'fake.sock'}"
        self.server: grpc.aio.Server | None = None

    async def start(self) -> FakeSidecar:
        self.server = grpc.aio.server()
        pb_grpc.add_TokenizerServicer_to_server(FakeServicer(self.state), self.server)
        self.server.add_insecure_port(self.address)
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)
            self.server = None

    async def __aenter__(self) -> FakeSidecar:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def record_ids(r: pb.RecordOutputRequest, field_name: str) -> list[int]:
    a = array("I")
    a.frombytes(getattr(r, field_name))
    return a.tolist()


def names(items: Iterable[Any]) -> list[str]:
    return [getattr(i, "name", str(i)) for i in items]
