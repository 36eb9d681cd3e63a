"""TokenizeStream: the clients' default path, against the real sidecar, and its fallbacks.

The clients send Tokenize over one long-lived stream when it is free and fall
back to the unary RPC when it is busy, broken, or missing on the server. These
tests check that the answers never change with the path, that errors arrive as
the same typed exceptions, and that restarts, drains and deadlines are handled.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import tokenizers
from google.protobuf.unknown_fields import UnknownFieldSet

from sidecar_client import (
    AsyncSidecarClient,
    DeadlineExceeded,
    InvalidArgumentError,
    ResourceExhaustedError,
    SidecarClient,
    SidecarUnavailable,
    UnknownModelError,
    _tokenize_stream,
)
from tests.integration.sidecar_proc import SidecarProcess
from tokcache.v1 import tokenizer_pb2 as pb
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory, qwen3_path: Path) -> Iterator[SidecarProcess]:
    tmp = tmp_path_factory.mktemp("stream")
    prefix = f"tkt-stream-{uuid.uuid4().hex[:8]}"
    proc = SidecarProcess(tmp, {"qwen3": qwen3_path}, prefix, "--max-text-bytes", "1MiB").start()
    yield proc
    code = proc.stop()
    for p in Path("/dev/shm").glob(f"*{prefix}*"):
        p.unlink()
    assert code == 0, proc.log()


def _texts(n: int, tag: str) -> list[str]:
    """A growing conversation's prompts: each extends the one before."""
    out, text = [], "<|im_start|>system\nYou are terse.<|im_end|>\n"
    for i in range(n):
        text += f"<|im_start|>user\n{tag} question {i}: 你好  \n\n{'x ' * (i * 7)}<|im_end|>\n<|im_start|>assistant\n"
        out.append(text)
        text += f"answer {i}\n\n<|im_end|>\n"
    return out


def test_raw_stream_replies_in_order_with_errors_in_band(sidecar: SidecarProcess, qwen3_path: Path) -> None:
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    requests = [
        pb.TokenizeRequest(model="qwen3", text="hello <|im_end|> world", add_special_tokens=False),
        pb.TokenizeRequest(model="nope", text="x"),
        pb.TokenizeRequest(model="qwen3"),
        pb.TokenizeRequest(model="qwen3", text="x" * (2 << 20)),
        pb.TokenizeRequest(model="qwen3", text="still served after errors", add_special_tokens=False),
    ]
    with grpc.insecure_channel(sidecar.address) as ch:
        stub = pb_grpc.TokenizerStub(ch)
        replies = list(stub.TokenizeStream(iter([pb.TokenizeStreamRequest(request=r) for r in requests])))
    assert len(replies) == len(requests)
    kinds = [r.WhichOneof("result") for r in replies]
    assert kinds == ["response", "error", "error", "error", "response"]
    assert [r.error.code for r in replies[1:4]] == ["NOT_FOUND", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"]
    assert replies[2].error.message.startswith("input")
    for i in (0, 4):
        ids = list(memoryview(replies[i].response.token_ids).cast("I"))
        assert ids == ref.encode(requests[i].text, add_special_tokens=False).ids


def test_sync_client_streams_and_matches_unary(sidecar: SidecarProcess, qwen3_path: Path) -> None:
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    salt = uuid.uuid4().hex
    with SidecarClient(sidecar.address, zero_rpc=False) as c, grpc.insecure_channel(sidecar.address) as ch:
        stub = pb_grpc.TokenizerStub(ch)
        sources = []
        for text in _texts(8, "sync"):
            r = c.tokenize("qwen3", text=text, add_special_tokens=False, cache_salt=salt)
            assert c._stream._replies is not None  # the stream carried it
            assert r.token_ids == ref.encode(text, add_special_tokens=False).ids
            sources.append(r.decision.source)
            unary = stub.Tokenize(pb.TokenizeRequest(model="qwen3", text=text, add_special_tokens=False,
                                                     cache_salt=salt))
            assert list(memoryview(unary.token_ids).cast("I")) == r.token_ids
            assert unary.decision.source == pb.CACHE_SOURCE_L0  # the streamed read stored its entries first
        assert sources[0] == "miss" and set(sources[1:]) == {"l1"}
        # Errors are the unary call's typed errors, and the stream survives them.
        with pytest.raises(UnknownModelError, match="nope"):
            c.tokenize("nope", text="x")
        with pytest.raises(InvalidArgumentError) as e:
            c.tokenize("qwen3", messages=[{"role": "user", "content": "x"}],
                       add_generation_prompt=True, continue_final_message=True)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ResourceExhaustedError):
            c.tokenize("qwen3", text="x" * (2 << 20))
        stream = c._stream._replies
        assert c.tokenize("qwen3", text="after errors").token_ids == ref.encode("after errors").ids
        assert c._stream._replies is stream


def test_concurrent_threads_share_one_client(sidecar: SidecarProcess, qwen3_path: Path) -> None:
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = {f"t{i}": _texts(6, f"thread {i}") for i in range(6)}
    with SidecarClient(sidecar.address, zero_rpc=False) as c:
        def run(name: str) -> list[list[int]]:
            return [c.tokenize("qwen3", text=t, add_special_tokens=False).token_ids for t in texts[name]]

        with futures.ThreadPoolExecutor(6) as pool:
            got = dict(zip(texts, pool.map(run, texts), strict=True))
    for name, ts in texts.items():
        assert got[name] == [ref.encode(t, add_special_tokens=False).ids for t in ts], name


def test_async_client_streams_and_falls_back_when_busy(sidecar: SidecarProcess, qwen3_path: Path) -> None:
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = _texts(12, "async")

    async def run() -> list[list[int]]:
        async with AsyncSidecarClient(sidecar.address, zero_rpc=False) as c:
            first = await c.tokenize("qwen3", text=texts[0], add_special_tokens=False)
            assert c._stream._call_obj is not None
            many = await asyncio.gather(*(c.tokenize("qwen3", text=t, add_special_tokens=False) for t in texts))
            with pytest.raises(UnknownModelError):
                await c.tokenize("missing", text="x")
            return [first.token_ids] + [r.token_ids for r in many]

    got = asyncio.run(run())
    want = [ref.encode(t, add_special_tokens=False).ids for t in texts]
    assert got == [want[0], *want]


def test_restart_and_drain_are_survived(tmp_path: Path, qwen3_path: Path, shm_prefix: str) -> None:
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    proc = SidecarProcess(tmp_path, {"qwen3": qwen3_path}, shm_prefix).start()
    try:
        with SidecarClient(proc.address, timeout=10, zero_rpc=False) as c:
            assert c.tokenize("qwen3", text="before").token_ids == ref.encode("before").ids
            assert c._stream._replies is not None
            # SIGTERM drains: the idle stream is ended at once, so shutdown does not wait out
            # the grace period, and the client's next call finds no sidecar.
            t0 = time.monotonic()
            assert proc.stop(signal.SIGTERM) == 0
            assert time.monotonic() - t0 < 5, proc.log()
            with pytest.raises(SidecarUnavailable):
                c.tokenize("qwen3", text="during the outage")
            proc.start()
            assert c.tokenize("qwen3", text="after").token_ids == ref.encode("after").ids
            assert c.tokenize("qwen3", text="after again").token_ids == ref.encode("after again").ids
            assert c._stream._replies is not None  # a new stream
    finally:
        proc.stop()


class _OldSidecar(pb_grpc.TokenizerServicer):
    """A server of the API before TokenizeStream, or one whose stream never answers."""

    def __init__(self, stream_hangs: bool) -> None:
        self.stream_hangs = stream_hangs
        self.unary_calls = 0

    def Tokenize(self, request: pb.TokenizeRequest, context: Any) -> pb.TokenizeResponse:
        self.unary_calls += 1
        return pb.TokenizeResponse(token_ids=(7).to_bytes(4, "little"), num_tokens=1)

    def TokenizeStream(self, request_iterator: Any, context: Any) -> Any:
        if not self.stream_hangs:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        for _ in request_iterator:  # read requests, never reply
            pass
        return iter(())


def _serve(servicer: _OldSidecar, sock: Path) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_TokenizerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    return server


def test_server_without_stream_gets_unary_calls(tmp_path: Path) -> None:
    servicer = _OldSidecar(stream_hangs=False)
    server = _serve(servicer, tmp_path / "old.sock")
    try:
        # UNIMPLEMENTED turns streaming off. (grpc.aio sometimes reports a stream the server
        # ended at once as INTERNAL instead: that call falls back too and the next one retries;
        # a fresh-clone run on 3.10 saw it three times in a row, so the async client gets up to
        # ten calls to learn it, every one answered.)
        with SidecarClient(f"unix://{tmp_path}/old.sock", zero_rpc=False) as c:
            got = [c.tokenize("m", text=t).token_ids for t in "abc"]
            assert not c._stream.enabled
        assert got == [[7]] * 3 and servicer.unary_calls == 3

        async def run() -> list[list[int]]:
            async with AsyncSidecarClient(f"unix://{tmp_path}/old.sock", zero_rpc=False) as ac:
                ids = [(await ac.tokenize("m", text=t)).token_ids for t in "def"]
                while ac._stream.enabled and len(ids) < 10:
                    ids.append((await ac.tokenize("m", text="g")).token_ids)
                assert not ac._stream.enabled
                return ids

        ids = asyncio.run(run())
        assert ids == [[7]] * len(ids)
    finally:
        server.stop(None)


def test_a_stream_that_never_answers_hits_the_deadline(tmp_path: Path) -> None:
    servicer = _OldSidecar(stream_hangs=True)
    server = _serve(servicer, tmp_path / "hang.sock")
    try:
        with SidecarClient(f"unix://{tmp_path}/hang.sock", zero_rpc=False) as c:
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                c.tokenize("m", text="a", timeout=0.2)
            # The watchdog looks twice a second while idle, 20 times while a call waits.
            assert time.monotonic() - t0 < 2.0
            assert c._stream._replies is None  # dropped; the next call opens a new one

        async def run() -> None:
            async with AsyncSidecarClient(f"unix://{tmp_path}/hang.sock", zero_rpc=False) as ac:
                t1 = time.monotonic()
                with pytest.raises(DeadlineExceeded):
                    await ac.tokenize("m", text="a", timeout=0.2)
                assert time.monotonic() - t1 < 1.0

        asyncio.run(run())
    finally:
        server.stop(None)
    assert threading.active_count() < 50


def _old_request(text: str, **fields: bytes) -> pb.TokenizeRequest:
    """A TokenizeRequest as a client from before the deltas were removed sent it: the
    removed fields (``text_base`` = 10, ``known_results`` = 8, ``keep_result`` = 9)
    travel as fields this sidecar's schema no longer has."""
    raw = pb.TokenizeRequest(model="qwen3", text=text, add_special_tokens=False).SerializeToString()
    if "text_base" in fields:
        raw += bytes([10 << 3 | 2, len(fields["text_base"])]) + fields["text_base"]
    if "known_results" in fields:
        raw += bytes([8 << 3 | 2, len(fields["known_results"])]) + fields["known_results"] + bytes([9 << 3, 1])
    return pb.TokenizeRequest.FromString(raw)  # unknown fields are kept, and sent again


def test_an_older_clients_deltas_are_refused_or_ignored(sidecar: SidecarProcess, qwen3_path: Path) -> None:
    """A request delta from an older client is FAILED_PRECONDITION naming text_base (that
    client then resends the whole text): its text is only a suffix and must never be
    tokenized as the prompt. Offered results and keep_result are ignored: full replies."""
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    text = _texts(3, "old client")[-1]
    delta = _old_request("only the new turn", text_base=b"\x05" * 16)
    with grpc.insecure_channel(sidecar.address) as ch:
        stub = pb_grpc.TokenizerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Tokenize(delta)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details().startswith("text_base"), e.value.details()
        replies = list(stub.TokenizeStream(iter([pb.TokenizeStreamRequest(request=delta),
                                                 pb.TokenizeStreamRequest(request=_old_request(text))])))
        assert replies[0].error.code == "FAILED_PRECONDITION" and replies[0].error.message.startswith("text_base")
        assert list(memoryview(replies[1].response.token_ids).cast("I")) == ref.encode(
            text, add_special_tokens=False).ids  # the resend of the whole text
        offered = stub.Tokenize(_old_request(text, known_results=b"\x06" * 16))
        assert list(memoryview(offered.token_ids).cast("I")) == ref.encode(text, add_special_tokens=False).ids
        assert offered.num_tokens == len(offered.token_ids) // 4
        assert not list(UnknownFieldSet(offered))  # no result_handle, base_handle, base_tokens


def test_async_stream_survives_a_killed_sidecar(tmp_path: Path, qwen3_path: Path, shm_prefix: str) -> None:
    """The e2e run caught this: a stream whose sidecar died stayed finished, and every later write
    raised InvalidStateError. A finished stream is now replaced, and a write race is a fallback."""
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    proc = SidecarProcess(tmp_path, {"qwen3": qwen3_path}, shm_prefix).start()

    async def run() -> None:
        async with AsyncSidecarClient(proc.address, timeout=10, zero_rpc=False) as c:
            assert (await c.tokenize("qwen3", text="before")).token_ids == ref.encode("before").ids
            first = c._stream._call_obj
            assert first is not None
            proc.stop(signal.SIGKILL)
            await asyncio.sleep(0.2)
            for _ in range(3):
                with pytest.raises(SidecarUnavailable):  # never an InvalidStateError
                    await c.tokenize("qwen3", text="while dead")
            proc.start()
            for text in ("after", "after again", "and again"):
                assert (await c.tokenize("qwen3", text=text)).token_ids == ref.encode(text).ids
            assert c._stream._call_obj is not None and c._stream._call_obj is not first

    try:
        asyncio.run(run())
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def big_sidecar(tmp_path_factory: pytest.TempPathFactory, qwen3_path: Path) -> Iterator[SidecarProcess]:
    """A sidecar that takes 8 MiB prompts (the default limit)."""
    tmp = tmp_path_factory.mktemp("stream-big")
    prefix = f"tkt-big-{uuid.uuid4().hex[:8]}"
    proc = SidecarProcess(tmp, {"qwen3": qwen3_path}, prefix, "--shm-size", "64MiB").start()
    yield proc
    code = proc.stop()
    for p in Path("/dev/shm").glob(f"*{prefix}*"):
        p.unlink()
    assert code == 0, proc.log()


def _big_chat() -> list[dict[str, str]]:
    """~3.6 MB that nothing has cached: tens of ms of work for the sidecar, and megabytes each way.

    Chat messages: a client sends them over RPC whether or not it can map the segment."""
    text = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog, 12345. 你好 " * 60_000
    return [{"role": "user", "content": text}]


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# A stream call must honour its deadline as a unary call does: with a watchdog that polled every
# 0.5 s while idle, 3.6 MB with timeout=0.005 came back OK after 0.154 s on the stream, where the
# unary call raised at 0.009 s. A call with the deadline must give up well before the sidecar
# could have answered it. That is measured against the same client's undeadlined calls of the
# same size, interleaved, as a ratio of medians: a fixed bound (0.1 s) failed once at 0.1035 s on
# a loaded machine, where every call was slow. Here the deadlined calls take ~20 ms (mostly
# sending 3.6 MB) and full ones 100-160 ms.
DEADLINE_S = 0.005
DEADLINE_SHARE = 0.5


def test_sync_stream_holds_a_tiny_deadline(big_sidecar: SidecarProcess) -> None:
    with SidecarClient(big_sidecar.address, timeout=30, zero_rpc=False) as c:
        c.tokenize("qwen3", messages=_chat("warm the stream up"))
        assert c._stream._replies is not None
        took, full = [], []
        for _ in range(3):
            t0 = time.monotonic()
            c.tokenize("qwen3", messages=_big_chat())
            full.append(time.monotonic() - t0)
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                c.tokenize("qwen3", messages=_big_chat(), timeout=DEADLINE_S)
            took.append(time.monotonic() - t0)
        assert statistics.median(took) < DEADLINE_SHARE * statistics.median(full), (took, full)
        # The stream was cancelled and dropped; the next call opens a new one and is served.
        assert c.tokenize("qwen3", messages=_chat("after")).token_ids
        assert c._stream._replies is not None


def test_async_stream_holds_a_tiny_deadline(big_sidecar: SidecarProcess) -> None:
    async def run() -> tuple[list[float], list[float]]:
        took, full = [], []
        async with AsyncSidecarClient(big_sidecar.address, timeout=30, zero_rpc=False) as c:
            await c.tokenize("qwen3", messages=_chat("warm the stream up"))
            assert c._stream._call_obj is not None
            for _ in range(3):
                t0 = time.monotonic()
                await c.tokenize("qwen3", messages=_big_chat())
                full.append(time.monotonic() - t0)
                t0 = time.monotonic()
                with pytest.raises(DeadlineExceeded):
                    await c.tokenize("qwen3", messages=_big_chat(), timeout=DEADLINE_S)
                took.append(time.monotonic() - t0)
            assert (await c.tokenize("qwen3", messages=_chat("after"))).token_ids
            assert c._stream._call_obj is not None
        return took, full

    took, full = asyncio.run(run())
    assert statistics.median(took) < DEADLINE_SHARE * statistics.median(full), (took, full)


def test_a_reply_after_the_deadline_is_not_returned(big_sidecar: SidecarProcess,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cancellation at the deadline switched off, the reply does arrive, late: it
    must still raise DeadlineExceeded, as a unary call's late reply does."""
    chat = _big_chat()
    with SidecarClient(big_sidecar.address, timeout=30, zero_rpc=False) as c:
        c._stream._alarm.arm = lambda call, deadline: None  # type: ignore[method-assign]
        with pytest.raises(DeadlineExceeded):
            c.tokenize("qwen3", messages=chat, timeout=DEADLINE_S)
        assert c._stream._replies is not None  # the stream is still in step: kept
        assert c.tokenize("qwen3", messages=_chat("after"), timeout=10).token_ids

    async def no_timeout(timeout: float | None, step: Any) -> Any:
        return await step

    monkeypatch.setattr(_tokenize_stream, "_within", no_timeout)

    async def run() -> None:
        async with AsyncSidecarClient(big_sidecar.address, timeout=30, zero_rpc=False) as c:
            with pytest.raises(DeadlineExceeded):
                await c.tokenize("qwen3", messages=_big_chat(), timeout=DEADLINE_S)
            assert c._stream._call_obj is not None
            assert (await c.tokenize("qwen3", messages=_chat("after"), timeout=10)).token_ids

    asyncio.run(run())


def test_an_idle_dropped_client_ends_its_alarm_thread(big_sidecar: SidecarProcess) -> None:
    def alarms() -> int:
        return sum(t.name == "tokcache-stream-alarm" for t in threading.enumerate())

    before = alarms()
    c = SidecarClient(big_sidecar.address, zero_rpc=False)
    c.tokenize("qwen3", messages=_chat("x"), timeout=10)
    assert alarms() == before + 1
    del c  # never closed
    deadline = time.monotonic() + 5
    while alarms() > before and time.monotonic() < deadline:
        gc.collect()  # the client may sit in a reference cycle
        time.sleep(0.02)
    assert alarms() == before
