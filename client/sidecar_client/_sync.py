"""Blocking client over a ``grpc`` channel."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from sidecar_client import _core
from sidecar_client._local import MIN_WRITE_BYTES, LocalPaths, RecordPending
from sidecar_client._models import ModelInfo, RecordResult, RecordSummary, TokenizeResult
from sidecar_client._tokenize_stream import SyncTokenizeStream
from sidecar_client.errors import TokcacheError, translate
from tokcache.engine.lookup import PendingWait
from tokcache.v1 import tokenizer_pb2 as pb
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc

__all__ = ["SidecarClient"]


class SidecarClient:
    """Talks to a tokcache sidecar. Thread-safe (one channel, shared); close when done.

    ``address``: ``unix:///run/tokcache/tokcache.sock`` or ``HOST:PORT``;
    default ``$TOKCACHE_ADDRESS``. ``timeout``: seconds per call (None = no deadline).
    ``stream``: send Tokenize over one long-lived ``TokenizeStream`` when it is free
    (default; about half the per-call cost of the unary RPC), else always unary.

    ``zero_rpc`` (default True): tokenize text in this process from the sidecar's shared
    memory whenever its segment can be mapped here (same node, same /dev/shm) and a
    ``tokenizer.json`` with the segment's fingerprint is at hand — from ``tokenizers``
    (model name -> directory or file) or the directory the sidecar loaded it from. The
    ids are the ones the sidecar would return (same lookup, same segment).
    :meth:`record_output` verifies and stores the output in this process too, in one chain
    with its prompt's entries, when the segment is writable here; a process that records its
    outputs leaves its reads' entries to their records. Other reads store their entries
    themselves when they encoded at least ``min_write_bytes`` UTF-8 bytes (default 4096;
    1024 when nothing of the text was cached): this process's next turn does not encode
    them again, and another process's re-encoding costs less than a smaller write. Chat
    messages, and every request when the segment cannot be used (logged once, counted in
    :meth:`stats`), go over RPC.

    The gRPC channel is opened by the first call that needs it, and closed once a model's
    calls are served in this process with write access (after the handshake): an idle
    channel keeps gRPC's threads running (~0.5 ms of CPU a second). A later RPC opens it
    again, and it then stays open.
    """

    def __init__(self, address: str | None = None, *, timeout: float | None = 30.0,
                 metadata: Sequence[tuple[str, str]] | None = None, stream: bool = True,
                 zero_rpc: bool = True, tokenizers: Mapping[str, str | Path] | None = None,
                 min_write_bytes: int = MIN_WRITE_BYTES) -> None:
        self.address = address or _core.default_address()
        self.timeout = timeout
        self._metadata = tuple(metadata or ())
        self._stream_enabled = stream
        # The channel, its stub and stream (None: closed; see the class). _rpc_lock guards the
        # three, _inflight (calls using them) and _released (closed once already).
        self._chan: grpc.Channel | None = None
        self._stub_: pb_grpc.TokenizerStub | None = None
        self._stream_: SyncTokenizeStream | None = None
        self._inflight = 0
        self._released = False
        self._rpc_lock = threading.Lock()
        self._local = (LocalPaths(dict(tokenizers or {}), learn=self._learn, min_write_bytes=min_write_bytes)
                       if zero_rpc else None)
        self._models_at = -float("inf")

    def _rpc(self) -> tuple[pb_grpc.TokenizerStub, SyncTokenizeStream]:
        """The stub and stream, the channel opened first if it is closed; the caller counts
        itself in flight (``_inflight``) until its call is done."""
        with self._rpc_lock:
            if self._chan is None:
                self._chan = grpc.insecure_channel(_core.channel_target(self.address),
                                                      options=_core.CHANNEL_OPTIONS)
                self._stub_ = pb_grpc.TokenizerStub(self._chan)
                self._stream_ = SyncTokenizeStream(self._chan, self._metadata)
                self._stream_.enabled = self._stream_enabled
            self._inflight += 1
            assert self._stub_ is not None and self._stream_ is not None
            return self._stub_, self._stream_

    @property
    def _channel(self) -> grpc.Channel:
        """The channel, opened if it is closed (for a caller that makes its own calls on it)."""
        self._rpc()
        self._done()
        assert self._chan is not None
        return self._chan

    @property
    def _stream(self) -> SyncTokenizeStream:
        """The TokenizeStream, its channel opened if it is closed."""
        _, stream = self._rpc()
        self._done()
        return stream

    def _done(self, *_args: Any) -> None:  # noqa: ANN401 - also a future's done callback
        with self._rpc_lock:
            self._inflight -= 1

    def _release(self) -> None:
        """Close the channel (once: see the class) if no call is using it."""
        with self._rpc_lock:
            if self._released or self._inflight or self._chan is None:
                return
            self._released = True
            channel, stream = self._chan, self._stream_
            self._chan = self._stub_ = self._stream_ = None
            if stream is not None:
                self._stream_enabled = stream.enabled  # (a sidecar without the stream turned it off)
        if stream is not None:
            stream.close()
        channel.close()

    def _learn(self, model: str, text: str, salt: str, mode: str) -> None:
        """A read's write without write access: the sidecar tokenizes (and stores) the text."""
        req = pb.TokenizeRequest(model=model, text=text, cache_salt=salt, add_special_tokens=False,
                                 mode=pb.TOKENIZE_MODE_EXACT if mode == "exact" else pb.TOKENIZE_MODE_KV_STABLE)
        stub, _ = self._rpc()
        try:
            future = stub.Tokenize.future(req, timeout=_core.grpc_timeout(self.timeout),
                                          metadata=self._metadata or None)
        except BaseException:
            self._done()
            raise
        future.add_done_callback(self._done)

    def _local_result(self, model: str, text: str, add_special_tokens: bool | None, cache_salt: str | None,
                      mode: str | None) -> TokenizeResult | None:
        local = self._local
        assert local is not None
        if not local.knows(model) and time.monotonic() - self._models_at > 1.0:
            self._models_at = time.monotonic()
            try:
                local.set_models(self.list_models())
            except TokcacheError:
                pass  # the RPC path reports it
        try:  # the common case first: no recorded output on its way, no wait made
            out = local.tokenize(model, text, add_special_tokens=add_special_tokens, cache_salt=cache_salt,
                                 mode=mode, trace=self._metadata, may_wait=True)
            if out is not None and not self._released and local.writes_directly(model) is not None:
                self._release()
            return out
        except RecordPending:  # an output this text continues is on its way to the sidecar
            pass
        wait = PendingWait()
        while True:
            time.sleep(wait.poll())
            may_wait = wait.open
            try:
                out = local.tokenize(model, text, add_special_tokens=add_special_tokens, cache_salt=cache_salt,
                                     mode=mode, trace=self._metadata, may_wait=may_wait)
            except RecordPending:
                continue
            outcome = wait.outcome(may_wait)
            if outcome is not None:
                local.stats.pending[outcome] += 1
            return out

    def stats(self) -> dict[str, dict[str, int]]:
        """What the in-process path did: ``tokenize`` by source, ``fallbacks`` to RPC by
        reason, ``writes`` and ``records`` by outcome (see ``LocalStats``)."""
        return self._local.stats.snapshot() if self._local is not None else {}

    def mark_pending(self, model: str, records: Sequence[tuple[str, str, str]], seconds: float) -> int:
        """Mark records as on their way to the sidecar for ``seconds`` (0: withdraw the marks).

        ``records``: (prompt_text, output_text, cache_salt) of outputs whose RecordOutput
        is sent but not answered yet, e.g. because a response could not wait longer for it.
        Until a mark expires or its record is stored, a read in any process of the node
        whose text continues such an output waits for it (at most ``PENDING_WAIT_S``, polling)
        instead of re-encoding the output. Needs a segment this process may write; returns
        how many marks were put (0 without in-process reads). Never raises.
        """
        return self._local.mark_pending(model, records, seconds) if self._local is not None else 0

    def flush(self, timeout: float | None = None) -> bool:
        """Store what in-process reads kept for records that have not come (prompts whose
        output was never recorded); True. ``timeout`` is accepted for compatibility: the
        writes are made in this thread."""
        if self._local is not None:
            self._local.flush()
        return True

    def tokenize(self, model: str, *, text: str | None = None,
                 messages: Sequence[Mapping[str, Any]] | None = None,
                 tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False,
                 continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
                 add_special_tokens: bool | None = None, cache_salt: str | None = None, mode: str | None = None,
                 return_prompt_text: bool = False, timeout: float | None = None) -> TokenizeResult:
        """Token ids of ``text``, or of ``messages`` rendered with the model's chat template.

        ``add_special_tokens`` defaults to True for text and False for chat (as
        transformers and vLLM). ``mode``: "kv-stable" | "exact" | None (server default).
        Raises a :class:`~sidecar_client.errors.TokcacheError` subclass on failure.
        Text is tokenized in this process when ``zero_rpc`` allows (see the class);
        otherwise, and for chat messages, over the client's ``TokenizeStream`` when no
        other thread is using it, else over the unary ``Tokenize``.
        """
        if _core.reads_locally(self._local is not None, model, text, messages, tools, add_generation_prompt,
                               continue_final_message, chat_template_kwargs, add_special_tokens, cache_salt, mode,
                               return_prompt_text, timeout):
            assert isinstance(text, str)
            local = self._local_result(model, text, add_special_tokens, cache_salt, mode)
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

        stub, stream = self._rpc()
        try:
            def unary(left: float | None) -> Any:
                return self._call_on(stub.Tokenize, req, left)

            return _core.read_tokenize(stream.send(sreq, wait, unary), return_prompt_text)
        finally:
            self._done()

    def render(self, model: str, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False,
               continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
               timeout: float | None = None) -> str:
        """The prompt text of ``messages`` (== transformers ``apply_chat_template(tokenize=False)``)."""
        _core.check_timeout(timeout)
        req = _core.build_render(model, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message,
                                  chat_template_kwargs=chat_template_kwargs)
        resp = self._call("Render", req, timeout)
        return str(resp.prompt_text)

    def record_output(self, model: str, *, prompt_text: str, prompt_token_ids: Sequence[int],
                      output_text: str, output_token_ids: Sequence[int], finish_reason: str | None = "stop",
                      stop_reason: int | str | None = None, cache_salt: str | None = None,
                      prompt_add_special_tokens: bool = False, timeout: float | None = None) -> RecordResult:
        """Record what the model generated for ``prompt_text`` (the AR cache).

        ``stop_reason``: the stop token id, the stop string (such a record is
        refused: its ids run past the text) or None (EOS / length). The
        record is verified first (the checks ``RecordOutput`` makes); a refusal raises
        :class:`~sidecar_client.errors.InvalidArgumentError` with the reason. Verified and
        stored in this process when its segment is writable here (no RPC: a prompt this
        client just tokenized is recognised, not sent again), else by the sidecar.
        """
        _core.check_timeout(timeout)
        if self._local is not None:
            local = self._local.record(model, prompt_text=prompt_text, prompt_token_ids=prompt_token_ids,
                                       output_text=output_text, output_token_ids=output_token_ids,
                                       finish_reason=finish_reason, stop_reason=stop_reason, cache_salt=cache_salt,
                                       prompt_add_special_tokens=prompt_add_special_tokens)
            if local is not None:
                return local
        req = _core.build_record(model, prompt_text=prompt_text, prompt_token_ids=prompt_token_ids,
                                 output_text=output_text, output_token_ids=output_token_ids,
                                 finish_reason=finish_reason, stop_reason=stop_reason, cache_salt=cache_salt,
                                 prompt_add_special_tokens=prompt_add_special_tokens)
        resp = self._call("RecordOutput", req, timeout)
        return RecordResult(recorded_tokens=resp.recorded_tokens, stop_token_dropped=resp.stop_token_dropped,
                            entries=resp.entries)

    def record_outputs(self, model: str, records: Iterable[Mapping[str, Any]], *,
                       timeout: float | None = None) -> RecordSummary:
        """Record many outputs on one stream; refused ones are listed, not raised.

        Each record is a mapping with the keyword arguments of :meth:`record_output`. Stored
        in this process when it can (see :meth:`record_output`), else on one stream.
        """
        _core.check_timeout(timeout)
        if self._local is not None:
            done = self._local.record_many(model, records)
            if done is not None:
                return done
        reqs = _core.build_records(model, records)
        resp = self._call("RecordOutputs", iter(reqs), timeout)
        return RecordSummary(recorded=resp.recorded, refused=resp.refused,
                             refusals=[(r.index, r.reason) for r in resp.refusals])

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The models the sidecar serves, with tokenizer fingerprints."""
        _core.check_timeout(timeout)
        return _core.read_models(self._call("ListModels", pb.ListModelsRequest(), timeout))

    def _call(self, name: str, req: Any, timeout: float | None) -> Any:
        """The unary or client-streaming RPC ``name``; errors translated."""
        stub, _ = self._rpc()
        try:
            return self._call_on(getattr(stub, name), req, timeout)
        finally:
            self._done()

    def _call_on(self, method: Any, req: Any, timeout: float | None) -> Any:
        try:
            return method(req, timeout=_core.grpc_timeout(timeout if timeout is not None else self.timeout),
                          metadata=self._metadata or None)
        except grpc.RpcError as exc:
            raise translate(exc) from exc

    def close(self) -> None:
        """Store pending writes, unmap shared memory, close the stream and the channel; idempotent."""
        if self._local is not None:
            self._local.close()
        with self._rpc_lock:
            channel, stream = self._chan, self._stream_
            self._chan = self._stub_ = self._stream_ = None
            self._released = True
        if stream is not None:
            stream.close()
        if channel is not None:
            channel.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
