"""asyncio client over ``grpc.aio``; same methods as :class:`SidecarClient`, awaitable."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from sidecar_client import _core
from sidecar_client._local import MIN_WRITE_BYTES, LocalPaths, RecordPending
from sidecar_client._models import ModelInfo, RecordResult, RecordSummary, TokenizeResult
from sidecar_client._tokenize_stream import AsyncTokenizeStream
from sidecar_client.errors import TokcacheError, translate
from tokcache.engine.lookup import PendingWait
from tokcache.v1 import tokenizer_pb2 as pb
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc

__all__ = ["AsyncSidecarClient"]


class AsyncSidecarClient:
    """Talks to a tokcache sidecar from one event loop (create it inside the loop).

    Same options as :class:`SidecarClient` (``zero_rpc``, ``tokenizers``, ``min_write_bytes``: text is tokenized
    in this process from the sidecar's shared memory when possible), plus
    ``channel_options`` appended to the client's gRPC channel options (e.g. a short
    reconnect backoff). In-process tokenization and recording run on the calling task: they
    take tens to hundreds of microseconds, less than a hop to an executor would cost. The
    gRPC channel is opened when a call needs it and closed once, when a model is served in
    this process with write access (see :class:`SidecarClient`).
    """

    def __init__(self, address: str | None = None, *, timeout: float | None = 30.0,
                 metadata: Sequence[tuple[str, str]] | None = None, stream: bool = True,
                 zero_rpc: bool = True, tokenizers: Mapping[str, str | Path] | None = None,
                 min_write_bytes: int = MIN_WRITE_BYTES,
                 channel_options: Sequence[tuple[str, Any]] = ()) -> None:
        self.address = address or _core.default_address()
        self.timeout = timeout
        self._metadata = tuple(metadata or ())
        self._channel_options = [*_core.CHANNEL_OPTIONS, *channel_options]
        self._stream_enabled = stream
        # The channel, its stub and stream (None: closed; see the class), the calls using them,
        # and whether it was closed once. (One event loop: no lock.)
        self._chan: grpc.aio.Channel | None = None
        self._stub_: pb_grpc.TokenizerStub | None = None
        self._stream_: AsyncTokenizeStream | None = None
        self._inflight = 0
        self._released = False
        self._closing: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self._learning: set[asyncio.Task[Any]] = set()
        self.local = (LocalPaths(dict(tokenizers or {}), learn=self._learn, min_write_bytes=min_write_bytes)
                      if zero_rpc else None)
        self._models_at = -float("inf")

    def _rpc(self) -> tuple[pb_grpc.TokenizerStub, AsyncTokenizeStream]:
        """The stub and stream, the channel opened first if it is closed; the caller counts
        itself in flight (``_inflight``) until its call is done (:meth:`_done`)."""
        if self._chan is None:
            self._chan = grpc.aio.insecure_channel(_core.channel_target(self.address), options=self._channel_options)
            self._stub_ = pb_grpc.TokenizerStub(self._chan)
            self._stream_ = AsyncTokenizeStream(self._chan, self._metadata)
            self._stream_.enabled = self._stream_enabled
        self._inflight += 1
        assert self._stub_ is not None and self._stream_ is not None
        return self._stub_, self._stream_

    def _done(self) -> None:
        self._inflight -= 1

    @property
    def _stream(self) -> AsyncTokenizeStream:
        """The TokenizeStream, its channel opened if it is closed."""
        _, stream = self._rpc()
        self._done()
        return stream

    def _release(self) -> None:
        """Close the channel (once: see the class) if no call is using it."""
        if self._released or self._inflight or self._chan is None:
            return
        self._released = True
        channel, stream = self._chan, self._stream_
        self._chan = self._stub_ = self._stream_ = None
        if stream is not None:
            self._stream_enabled = stream.enabled
            stream.close()
        task = self._loop.create_task(channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _learn(self, model: str, text: str, salt: str, mode: str) -> None:
        """A read's write without write access: the sidecar tokenizes (and stores) the text;
        nobody waits for the reply."""
        req = pb.TokenizeRequest(model=model, text=text, cache_salt=salt, add_special_tokens=False,
                                 mode=pb.TOKENIZE_MODE_EXACT if mode == "exact" else pb.TOKENIZE_MODE_KV_STABLE)

        def start() -> None:
            task = self._loop.create_task(self._learn_call(req))
            self._learning.add(task)
            task.add_done_callback(self._learning.discard)

        try:
            self._loop.call_soon_threadsafe(start)
        except RuntimeError:
            pass  # the loop is closed: the entry is simply not stored

    async def _learn_call(self, req: pb.TokenizeRequest) -> None:
        stub, _ = self._rpc()
        try:
            await stub.Tokenize(req, timeout=_core.grpc_timeout(self.timeout), metadata=self._metadata or None)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            self._done()

    async def _local_result(self, model: str, text: str, add_special_tokens: bool | None,
                            cache_salt: str | None, mode: str | None,
                            trace: Sequence[tuple[str, str]] = ()) -> TokenizeResult | None:
        local = self.local
        assert local is not None
        if not local.knows(model) and time.monotonic() - self._models_at > 1.0:
            self._models_at = time.monotonic()
            try:
                local.set_models(await self.list_models())
            except TokcacheError:
                pass  # the RPC path reports it
        job = local.claim_open(model)
        if job is not None:
            # Opening maps the segment and loads the encoder (~1 s, several on a busy node): in a
            # worker thread, so the event loop serves other requests meanwhile (over RPC: the
            # model is claimed as being opened). This request waits for it; shielded, as a
            # cancelled call must not cancel a claimed open before it runs (the model would
            # stay "being opened" for good).
            try:
                opening = self._loop.run_in_executor(None, job)
            except RuntimeError:  # the loop's executor was shut down: this request goes over RPC
                job.cancel()
                local.count_fallback(model)
                return None
            else:
                await asyncio.shield(opening)
        try:  # the common case first: no recorded output on its way, no wait made
            out = local.tokenize(model, text, add_special_tokens=add_special_tokens, cache_salt=cache_salt,
                                 mode=mode, trace=trace, may_wait=True)
            if out is not None and not self._released and local.writes_directly(model) is not None:
                self._release()
            return out
        except RecordPending:  # an output this text continues is on its way to the sidecar
            pass
        wait = PendingWait()
        while True:
            await asyncio.sleep(wait.poll())
            may_wait = wait.open
            try:
                out = local.tokenize(model, text, add_special_tokens=add_special_tokens, cache_salt=cache_salt,
                                     mode=mode, trace=trace, may_wait=may_wait)
            except RecordPending:
                continue
            outcome = wait.outcome(may_wait)
            if outcome is not None:
                local.stats.pending[outcome] += 1
            return out

    def stats(self) -> dict[str, dict[str, int]]:
        """See :meth:`SidecarClient.stats`."""
        return self.local.stats.snapshot() if self.local is not None else {}

    def mark_pending(self, model: str, records: Sequence[tuple[str, str, str]], seconds: float) -> int:
        """See :meth:`SidecarClient.mark_pending`. Not a coroutine: one put per record under
        the segment's writer lock, each waiting for it at most ``INLINE_LOCK_S``."""
        return self.local.mark_pending(model, records, seconds) if self.local is not None else 0

    async def flush(self, timeout: float | None = None) -> bool:
        """See :meth:`SidecarClient.flush` (the writes are made on the calling task)."""
        if self.local is not None:
            self.local.flush()
        return True

    async def tokenize(self, model: str, *, text: str | None = None,
                       messages: Sequence[Mapping[str, Any]] | None = None,
                       tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False,
                       continue_final_message: bool = False,
                       chat_template_kwargs: Mapping[str, Any] | None = None,
                       add_special_tokens: bool | None = None, cache_salt: str | None = None,
                       mode: str | None = None, return_prompt_text: bool = False,
                       timeout: float | None = None,
                       metadata: Sequence[tuple[str, str]] | None = None) -> TokenizeResult:
        """See :meth:`SidecarClient.tokenize` (the stream is used when no other task is using it).

        ``metadata``: extra gRPC metadata for this call (e.g. W3C ``traceparent``), also
        carried on the stream message.
        """
        if _core.reads_locally(self.local is not None, model, text, messages, tools, add_generation_prompt,
                               continue_final_message, chat_template_kwargs, add_special_tokens, cache_salt, mode,
                               return_prompt_text, timeout):
            assert isinstance(text, str)
            local = await self._local_result(model, text, add_special_tokens, cache_salt, mode,
                                             (*self._metadata, *metadata) if metadata else self._metadata)
            if local is not None:
                return local
        sreq = pb.TokenizeStreamRequest()
        req = _core.build_tokenize(model, text=text, messages=messages, tools=tools,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message,
                                   chat_template_kwargs=chat_template_kwargs, add_special_tokens=add_special_tokens,
                                   cache_salt=cache_salt, mode=mode, return_prompt_text=return_prompt_text,
                                   into=sreq.request)
        wait = timeout if timeout is not None else self.timeout
        extra = tuple(metadata or ())
        for key, value in extra:
            if key in ("traceparent", "tracestate"):
                setattr(sreq, key, value)

        stub, stream = self._rpc()
        try:
            def unary(left: float | None) -> Any:
                return self._call_on(stub.Tokenize, req, left, extra)

            return _core.read_tokenize(await stream.send(sreq, wait, unary), return_prompt_text)
        finally:
            self._done()

    async def render(self, model: str, messages: Sequence[Mapping[str, Any]], *,
                     tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False,
                     continue_final_message: bool = False,
                     chat_template_kwargs: Mapping[str, Any] | None = None,
                     timeout: float | None = None) -> str:
        """See :meth:`SidecarClient.render`."""
        _core.check_timeout(timeout)
        req = _core.build_render(model, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message,
                                  chat_template_kwargs=chat_template_kwargs)
        resp = await self._call("Render", req, timeout)
        return str(resp.prompt_text)

    async def record_output(self, model: str, *, prompt_text: str, prompt_token_ids: Sequence[int],
                      output_text: str, output_token_ids: Sequence[int], finish_reason: str | None = "stop",
                      stop_reason: int | str | None = None, cache_salt: str | None = None,
                      prompt_add_special_tokens: bool = False, timeout: float | None = None) -> RecordResult:
        """Record what the model generated for ``prompt_text`` (the AR cache).

        ``stop_reason``: the stop token id, the stop string (such a record is
        refused: its ids run past the text) or None (EOS / length). The
        record is verified first; a refusal raises
        :class:`~sidecar_client.errors.InvalidArgumentError` with the reason. Stored on the
        calling task, in this process, when the segment is writable here (see
        :meth:`SidecarClient.record_output`), else by the sidecar.
        """
        _core.check_timeout(timeout)
        if self.local is not None:
            local = self.local.record(model, prompt_text=prompt_text, prompt_token_ids=prompt_token_ids,
                                      output_text=output_text, output_token_ids=output_token_ids,
                                      finish_reason=finish_reason, stop_reason=stop_reason, cache_salt=cache_salt,
                                      prompt_add_special_tokens=prompt_add_special_tokens)
            if local is not None:
                return local
        req = _core.build_record(model, prompt_text=prompt_text, prompt_token_ids=prompt_token_ids,
                                 output_text=output_text, output_token_ids=output_token_ids,
                                 finish_reason=finish_reason, stop_reason=stop_reason, cache_salt=cache_salt,
                                 prompt_add_special_tokens=prompt_add_special_tokens)
        resp = await self._call("RecordOutput", req, timeout)
        return RecordResult(recorded_tokens=resp.recorded_tokens, stop_token_dropped=resp.stop_token_dropped,
                            entries=resp.entries)

    async def record_outputs(self, model: str, records: Iterable[Mapping[str, Any]], *,
                             timeout: float | None = None,
                             metadata: Sequence[tuple[str, str]] | None = None) -> RecordSummary:
        """Record many outputs on one stream; refused ones are listed, not raised.

        Each record is a mapping with the keyword arguments of :meth:`record_output`. Stored
        on the calling task when it can be (see :meth:`record_output`), else on one stream.
        """
        _core.check_timeout(timeout)
        if self.local is not None:
            done = self.local.record_many(model, records)
            if done is not None:
                return done
        reqs = _core.build_records(model, records)
        resp = await self._call("RecordOutputs", iter(reqs), timeout, tuple(metadata or ()))
        return RecordSummary(recorded=resp.recorded, refused=resp.refused,
                             refusals=[(r.index, r.reason) for r in resp.refusals])

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """See :meth:`SidecarClient.list_models`."""
        _core.check_timeout(timeout)
        return _core.read_models(await self._call("ListModels", pb.ListModelsRequest(), timeout))

    async def _call(self, name: str, req: Any, timeout: float | None,
                    metadata: Sequence[tuple[str, str]] = ()) -> Any:
        """The unary or client-streaming RPC ``name``; errors translated."""
        stub, _ = self._rpc()
        try:
            return await self._call_on(getattr(stub, name), req, timeout, metadata)
        finally:
            self._done()

    async def _call_on(self, method: Any, req: Any, timeout: float | None,
                       metadata: Sequence[tuple[str, str]] = ()) -> Any:
        try:
            return await method(req, timeout=_core.grpc_timeout(timeout if timeout is not None else self.timeout),
                                metadata=(*self._metadata, *metadata) or None)
        except grpc.RpcError as exc:
            raise translate(exc) from exc

    async def close(self) -> None:
        """Store pending writes, unmap shared memory, close the stream and the channel; idempotent."""
        if self.local is not None:
            await asyncio.to_thread(self.local.close)
        channel, stream = self._chan, self._stream_
        self._chan = self._stub_ = self._stream_ = None
        self._released = True
        if stream is not None:
            stream.close()
        if channel is not None:
            await channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def __aenter__(self) -> AsyncSidecarClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
