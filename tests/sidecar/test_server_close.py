"""A sidecar that stops before it served (a model that fails to load) ends the TokenizeStreams
clients opened meanwhile cleanly: no cancelled handler for gRPC to log as a traceback."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import pytest

from tokcache.sidecar.config import load_config
from tokcache.sidecar.server import Sidecar
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc


def test_idle_streams_end_cleanly_when_a_start_is_undone(tmp_path: Path, qwen3_path: Path, shm_prefix: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    address = f"unix://{tmp_path}/s.sock"
    config = load_config({"listen": address, "models": {"qwen3": str(qwen3_path)}, "shm_prefix": shm_prefix},
                         env={})
    errors: list[dict[str, object]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        sidecar = Sidecar(config)
        await sidecar.start()  # bound, NOT_SERVING: no model loaded yet
        channel = grpc.aio.insecure_channel(address)
        call = pb_grpc.TokenizerStub(channel).TokenizeStream()
        await call.wait_for_connection()
        for _ in range(50):  # until the stream's handler waits for its first request
            if sidecar.service._idle_streams:
                break
            await asyncio.sleep(0.02)
        assert sidecar.service._idle_streams, "the stream's handler never started"
        await sidecar.close()  # as a failed load undoes the start
        # The handler returned: the stream ended with OK, not cancelled under the server.
        assert await asyncio.wait_for(call.code(), 5) == grpc.StatusCode.OK
        await channel.close()

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    logged = [r for r in caplog.records if "CancelledError" in (r.getMessage() + str(r.exc_info))]
    assert not logged and not [e for e in errors if not _earlier_loops_event(e)], (logged, errors)


def _earlier_loops_event(context: dict[str, object]) -> bool:
    """grpc.aio's process-wide poller hands each completion to the loop its call was made on; a call
    an earlier test left behind belongs to that test's closed loop, and handing it over raises
    'Event loop is closed' inside *this* loop's callback (CI saw it once). That is grpc's leftover
    from another test, not a handler of this sidecar; every other error still fails the test."""
    exception = context.get("exception")
    return ("PollerCompletionQueue._handle_events" in str(context.get("message", ""))
            and isinstance(exception, RuntimeError) and str(exception) == "Event loop is closed")
