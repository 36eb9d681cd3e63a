"""The gRPC servicer: requests in, engine calls, status codes out, each RPC observed.

Handlers run on the asyncio event loop and do their CPU work inline: a
Tokenize is tens to hundreds of microseconds, less than a hop to a thread
pool would cost, and the GIL would serialise the work anyway. Parallelism
across cores comes from several server processes on one segment.

Status mapping (messages name the field)::

    UnknownModel     NOT_FOUND
    InvalidRequest   INVALID_ARGUMENT   (TemplateError too, with the template's text)
    RequestTooLarge  RESOURCE_EXHAUSTED
    still loading    UNAVAILABLE
    text_base        FAILED_PRECONDITION (an older client's request delta: it resends the whole text)
    anything else    INTERNAL (logged with traceback; the server keeps serving)

Every RPC is counted and timed (Prometheus) and, when tracing is on, emitted
as a span with the cache decision as ``tokcache.*`` attributes — never the
text or the salt itself — and child spans for render/lookup/encode/insert.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
from google.protobuf.unknown_fields import UnknownFieldSet  # type: ignore[import-untyped,unused-ignore]

from tokcache.engine.errors import EngineError, InvalidRequest, RequestTooLarge, UnknownModel
from tokcache.engine.lookup import PendingWait, TierNeeded
from tokcache.sidecar.engine.model import Decision, ModelEngine, Outcome
from tokcache.sidecar.telemetry import Metrics, Tracing
from tokcache.sidecar.tier import ArTier
from tokcache.sidecar.wire import MODE_FROM_PROTO, chat_from_proto, source_to_proto, unpack_ids
from tokcache.v1 import tokenizer_pb2 as pb
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

__all__ = ["TokenizerService"]


class _Unavailable(Exception):
    """The sidecar cannot take requests now (loading, draining): UNAVAILABLE, retryable."""


class _OldDelta(Exception):
    """A request delta (``text_base``) from an older client: FAILED_PRECONDITION, which such a
    client answers by resending the whole text (as it did when a sidecar lost its base)."""


# TokenizeRequest's removed ``text_base`` (reserved): an older client may still send it.
_TEXT_BASE = 10


def _has_text_base(request: pb.TokenizeRequest) -> bool:
    """Whether ``request`` carries the removed ``text_base`` (kept as an unknown field:
    read as a whole prompt, its text would be only the new suffix)."""
    return any(f.field_number == _TEXT_BASE for f in UnknownFieldSet(request))


def _trace_metadata(msg: pb.TokenizeStreamRequest) -> tuple[tuple[str, str], ...]:
    """A stream request's own trace context, shaped like call metadata (empty if it has none)."""
    return tuple((k, v) for k, v in (("traceparent", msg.traceparent), ("tracestate", msg.tracestate)) if v)


@dataclass
class _Call:
    """What one RPC observed: its status, span attributes and phase stamps."""

    method: str
    start_ns: int = field(default_factory=time.time_ns)
    start_pc: int = field(default_factory=time.perf_counter_ns)
    code: str = "OK"
    error: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, tuple[int, int]] = field(default_factory=dict)
    # A Tokenize whose cache entries are written after the response went out.
    engine: ModelEngine | None = None
    outcome: Outcome | None = None


def _decision_attrs(engine: ModelEngine, d: Decision, salt: str) -> dict[str, Any]:
    return {
        "tokcache.model": engine.name,
        "tokcache.fingerprint": engine.fingerprint,
        "tokcache.source": d.source,
        "tokcache.cached_tokens": d.cached_tokens,
        "tokcache.cached_chars": d.cached_chars,
        "tokcache.encoded_chars": d.encoded_chars,
        "tokcache.ar_spliced_tokens": d.ar_spliced_tokens,
        "tokcache.boundary_count": d.boundaries,
        "tokcache.salt_present": bool(salt),
        "tokcache.backend": engine.encoder.name,
    }


class TokenizerService(pb_grpc.TokenizerServicer):  # generated base class, untyped
    """Serves ``tokcache.v1.Tokenizer``. ``engines`` is filled once loading is done."""

    def __init__(self, default_mode: str = "kv-stable", *, metrics: Metrics | None = None,
                 tracing: Tracing | None = None, tier: ArTier | None = None) -> None:
        self.engines: dict[str, ModelEngine] = {}
        # The cluster tier for recorded outputs (None: off): read when no local AR applies to
        # a kv-stable Tokenize, written after each verified RecordOutput.
        self.tier = tier
        self.ready = False
        self.default_mode = default_mode
        self.metrics = metrics or Metrics()
        self.tracing = tracing or Tracing()
        # Drain state, touched only on the event loop: once draining, new RPCs
        # get UNAVAILABLE (retryable) while the ones in flight finish.
        self.draining = False
        self.inflight = 0
        self.last_rpc = time.monotonic()
        # Open TokenizeStream handlers waiting for their next request (ended on drain).
        self._idle_streams: set[asyncio.Task[Any]] = set()

    def end_streams(self) -> int:
        """End the streams that wait for a request (call once draining): their clients
        see the stream end and fall back to unary calls, which the drain answers. Streams
        busy with a request end after their reply. Returns how many were ended."""
        idle = list(self._idle_streams)
        for task in idle:
            task.cancel()
        return len(idle)

    def set_engines(self, engines: Mapping[str, ModelEngine]) -> None:
        """Publish the loaded models (called once, on the event loop)."""
        self.engines = dict(engines)
        for engine in self.engines.values():
            self.metrics.add_model(engine.name, engine.fingerprint, engine.encoder.name,
                                   not engine.boundary_check.disabled_reason)
        self.ready = True

    # -- plumbing -----------------------------------------------------------

    def _begin(self, method: str) -> _Call:
        self.inflight += 1
        self.last_rpc = time.monotonic()
        return _Call(method)

    def _end(self, call: _Call) -> float:
        """The request is answered: no longer in flight; its server-side seconds."""
        self.inflight -= 1
        return (time.perf_counter_ns() - call.start_pc) / 1e9

    def _settle(self, call: _Call, seconds: float, metadata: Any) -> None:
        """Once the reply is on its way: a Tokenize's store write, then count and trace."""
        if call.outcome is not None and call.code == "OK":
            self._after_response(call, seconds, metadata)
        else:
            self._observe(call, seconds, metadata)

    def _finish(self, call: _Call, context: Context) -> None:
        seconds = self._end(call)
        metadata = context.invocation_metadata() if self.tracing.enabled else None
        if call.outcome is not None and call.code == "OK":
            # Write-behind: the store write runs once the handler has returned and
            # gRPC is sending the response, so the caller does not wait for it.
            asyncio.get_running_loop().call_soon(self._after_response, call, seconds, metadata)
        else:
            self._observe(call, seconds, metadata)

    def _after_response(self, call: _Call, seconds: float, metadata: Any) -> None:
        """Store a Tokenize's new entries, then count and trace it (decision complete)."""
        assert call.outcome is not None and call.engine is not None
        try:
            call.outcome.commit()
        except Exception:  # never raised by design (store errors degrade); a bug must not kill the loop
            log.exception("storing the entries of a Tokenize failed")
        d = call.outcome.decision
        self.metrics.observe_decision(call.engine.name, d)
        call.phases.update(d.timings)
        self._observe(call, seconds, metadata)

    def _observe(self, call: _Call, seconds: float, metadata: Any) -> None:
        self.metrics.observe_rpc(call.method, call.code, seconds)
        if self.tracing.enabled:
            self.tracing.record(call.method, metadata, call.start_ns, call.start_pc,
                                call.attrs, call.phases, call.code, call.error)

    @staticmethod
    def _status(call: _Call, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status a failed request ends with (logged when it is a bug)."""
        if isinstance(exc, _Unavailable):
            code = grpc.StatusCode.UNAVAILABLE
        elif isinstance(exc, _OldDelta):
            code = grpc.StatusCode.FAILED_PRECONDITION
        elif isinstance(exc, UnknownModel):
            code = grpc.StatusCode.NOT_FOUND
        elif isinstance(exc, InvalidRequest):
            code = grpc.StatusCode.INVALID_ARGUMENT
        elif isinstance(exc, RequestTooLarge):
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
        else:
            log.exception("internal error in %s", call.method, exc_info=exc)
            code = grpc.StatusCode.INTERNAL
        message = str(exc) if isinstance(exc, (EngineError, _Unavailable, _OldDelta)) else f"internal error: {exc!r}"
        call.code, call.error = code.name, message
        return code, message

    async def _abort(self, call: _Call, context: Context, exc: BaseException) -> NoReturn:
        code, message = self._status(call, exc)
        await context.abort(code, message)
        raise AssertionError("unreachable")  # abort raises

    def _ready_engine(self, model: str) -> ModelEngine:
        if not self.ready or self.draining:
            raise _Unavailable("sidecar is shutting down" if self.draining else "sidecar is loading tokenizers")
        if not model:
            raise InvalidRequest("model", "is required")
        engine = self.engines.get(model)
        if engine is None:
            raise UnknownModel(model)
        return engine

    async def _engine(self, call: _Call, model: str, context: Context) -> ModelEngine:
        try:
            return self._ready_engine(model)
        except _Unavailable as exc:
            call.code = "UNAVAILABLE"
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            raise AssertionError("unreachable") from exc

    def _render(self, call: _Call, engine: ModelEngine, chat: pb.ChatInput) -> str:
        t0 = time.perf_counter_ns()
        messages, options = chat_from_proto(chat)
        text = engine.render(messages, **options)
        call.phases["render"] = (t0, time.perf_counter_ns())
        return text

    # -- RPCs ---------------------------------------------------------------

    async def _tokenize(self, call: _Call, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """One Tokenize, its store write deferred to ``call.outcome``; raises on bad input."""
        engine = self._ready_engine(request.model)
        if _has_text_base(request):
            raise _OldDelta("text_base: this sidecar no longer takes request deltas; send the whole text")
        which = request.WhichOneof("input")
        if which == "text":
            text = request.text
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        elif which == "chat":
            text = self._render(call, engine, request.chat)
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else False
        else:
            raise InvalidRequest("input", "one of text or chat is required")
        if request.mode not in (0, *MODE_FROM_PROTO):
            raise InvalidRequest("mode", f"unknown mode {request.mode}")
        mode = MODE_FROM_PROTO.get(request.mode, self.default_mode)
        tier_attrs: dict[str, Any] | None = None
        wait = PendingWait()
        while True:
            may_wait = wait.open
            try:
                out = engine.tokenize(text, add_special_tokens=add_special, salt=request.cache_salt,
                                      mode=mode, defer_store=True, tier=self.tier is not None and not tier_attrs)
            except TierNeeded as need:
                tier_attrs = await self._ask_tier(call, engine, need)
                out = engine.tokenize(text, add_special_tokens=add_special, salt=request.cache_salt,
                                      mode=mode, defer_store=True)
            if not (out.decision.ar_pending and may_wait):
                break
            # The text continues an output whose record a vLLM process sent before its
            # response went (Store.mark): that record is on its way to this sidecar. Read again
            # once it may have landed, as a client reading in its own process does; nothing of
            # this read was stored (defer_store).
            await asyncio.sleep(wait.poll())
        waited = wait.outcome(may_wait)
        if waited is not None:
            self.metrics.observe_pending(engine.name, waited)
        call.engine, call.outcome = engine, out
        d = out.decision
        if self.tracing.enabled:  # span attributes only; the metrics read the decision itself
            call.attrs = _decision_attrs(engine, d, request.cache_salt)
            call.attrs["tokcache.num_tokens"] = out.num_tokens
            call.attrs["tokcache.mode"] = mode
            if tier_attrs:
                call.attrs.update(tier_attrs)
            if waited is not None:
                call.attrs["tokcache.record_pending"] = waited
        return pb.TokenizeResponse(
            token_ids=out.ids,
            num_tokens=out.num_tokens,
            fingerprint=engine.fingerprint,
            backend=engine.encoder.name,
            prompt_text=text if (request.return_prompt_text and which == "chat") else "",
            decision=pb.CacheDecision(
                source=source_to_proto(d.source),
                cached_tokens=d.cached_tokens,
                cached_chars=d.cached_chars,
                encoded_chars=d.encoded_chars,
                ar_spliced_tokens=d.ar_spliced_tokens,
                boundaries=d.boundaries,
                l1_disabled_reason=d.l1_disabled_reason,
            ),
        )

    async def _ask_tier(self, call: _Call, engine: ModelEngine, need: TierNeeded) -> dict[str, Any]:
        """Fetch the candidate segment entries from the cluster tier, keep the verified ones
        in the node's segment (the lookup that follows splices them); span attributes."""
        assert self.tier is not None
        t0 = time.perf_counter_ns()
        fetched = await self.tier.fetch(engine.fingerprint, [key for key, _ in need.candidates])
        stored, invalid = engine.accept_tier(need.candidates, fetched.values)
        call.phases["tier"] = (t0, time.perf_counter_ns())
        self.metrics.observe_tier_records(engine.name, stored, invalid)
        if invalid:
            log.warning("cluster tier: %d entr%s for model %s failed verification (tampered, or another "
                        "tokenizer's); not used", invalid, "y" if invalid == 1 else "ies", engine.name)
        return {"tokcache.tier_result": fetched.result, "tokcache.tier_keys": fetched.asked,
                "tokcache.tier_records": stored, "tokcache.tier_invalid": invalid,
                "tokcache.tier_seconds": fetched.seconds}

    async def Tokenize(self, request: pb.TokenizeRequest, context: Context) -> pb.TokenizeResponse:
        call = self._begin("Tokenize")
        try:
            return await self._tokenize(call, request)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await self._abort(call, context, exc)
        finally:
            self._finish(call, context)

    async def TokenizeStream(self, request_iterator: Any, context: Context) -> None:
        """Tokenize requests off one stream, one reply each, in order.

        Each request is counted and traced as a Tokenize (span attribute
        ``tokcache.transport=stream``), under the trace context it carries or
        else the stream's, and its store write runs once its reply is written. A draining sidecar
        answers UNAVAILABLE and ends the stream, so the client reconnects.
        """
        task = asyncio.current_task()
        assert task is not None
        messages = aiter(request_iterator)
        while not self.draining:
            self._idle_streams.add(task)
            try:
                msg = await anext(messages)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not self.draining:
                    raise
                # end_streams() woke us: end the RPC with OK (a cancelled handler would
                # leave it open, and server.stop would wait out the grace period). Returning
                # ends the task normally; 3.11+ also counts cancel requests, taken back here.
                if sys.version_info >= (3, 11):
                    task.uncancel()
                return
            finally:
                self._idle_streams.discard(task)
            call = self._begin("Tokenize")  # one Tokenize to metrics and traces, whatever the transport
            try:
                reply = pb.TokenizeStreamResponse(response=await self._tokenize(call, msg.request))
            except Exception as exc:
                code, message = self._status(call, exc)
                reply = pb.TokenizeStreamResponse(error=pb.StreamError(code=code.name, message=message))
            seconds = self._end(call)
            metadata = (_trace_metadata(msg) or context.invocation_metadata()) if self.tracing.enabled else None
            call.attrs["tokcache.transport"] = "stream"
            try:
                await context.write(reply)
            finally:
                self._settle(call, seconds, metadata)
            if call.code == "UNAVAILABLE":
                return

    async def Render(self, request: pb.RenderRequest, context: Context) -> pb.RenderResponse:
        call = self._begin("Render")
        try:
            engine = await self._engine(call, request.model, context)
            text = self._render(call, engine, request.chat)
            try:  # a "\ud800" escape in JSON content renders to a lone surrogate
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequest("chat", f"the rendered prompt is not valid Unicode at index {exc.start} "
                                             "(a lone surrogate, e.g. from a \\ud800 escape in JSON)") from exc
            call.attrs = {"tokcache.model": engine.name, "tokcache.fingerprint": engine.fingerprint}
            return pb.RenderResponse(prompt_text=text, fingerprint=engine.fingerprint)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await self._abort(call, context, exc)
        finally:
            self._finish(call, context)

    def _record(self, engine: ModelEngine, r: pb.RecordOutputRequest,
                call: _Call | None = None) -> pb.RecordOutputResponse:
        for name in ("prompt_token_ids", "output_token_ids"):
            if len(getattr(r, name)) % 4:
                raise InvalidRequest(name, "length is not a multiple of 4 (little-endian uint32 ids)")
        which = r.WhichOneof("stop_reason_kind")
        try:
            out = engine.record_output(
                prompt_text=r.prompt_text, prompt_ids=r.prompt_token_ids,
                output_text=r.output_text, output_ids=unpack_ids(r.output_token_ids),
                finish_reason=r.finish_reason,
                stop_token_id=r.stop_token_id if which == "stop_token_id" else None,
                stop_string=r.stop_string if which == "stop_string" else None,
                salt=r.cache_salt, prompt_add_special_tokens=r.prompt_add_special_tokens)
        except EngineError:
            self.metrics.records.labels(engine.name, "refused").inc()
            raise
        self.metrics.records.labels(engine.name, "recorded").inc()
        return pb.RecordOutputResponse(recorded_tokens=out.recorded_tokens,
                                       stop_token_dropped=out.stop_token_dropped, entries=out.entries)

    async def RecordOutput(self, request: pb.RecordOutputRequest, context: Context) -> pb.RecordOutputResponse:
        call = self._begin("RecordOutput")
        try:
            engine = await self._engine(call, request.model, context)
            call.attrs = {"tokcache.model": engine.name, "tokcache.fingerprint": engine.fingerprint,
                          "tokcache.salt_present": bool(request.cache_salt)}
            resp = self._record(engine, request, call)
            call.attrs["tokcache.recorded_tokens"] = resp.recorded_tokens
            return resp
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await self._abort(call, context, exc)
        finally:
            self._finish(call, context)

    async def RecordOutputs(self, request_iterator: Any, context: Context) -> pb.RecordOutputsResponse:
        call = self._begin("RecordOutputs")
        summary = pb.RecordOutputsResponse()
        index = 0
        try:
            async for request in request_iterator:
                try:
                    engine = await self._engine(call, request.model, context)
                    self._record(engine, request)
                    summary.recorded += 1
                except grpc.aio.AbortError:
                    raise
                except EngineError as exc:
                    summary.refused += 1
                    summary.refusals.add(index=index, reason=str(exc))
                except Exception as exc:  # a bug must not end the stream for the others
                    log.exception("RecordOutputs item %d failed", index)
                    summary.refused += 1
                    summary.refusals.add(index=index, reason=f"internal error: {exc!r}")
                index += 1
            call.attrs = {"tokcache.recorded": summary.recorded, "tokcache.refused": summary.refused}
            return summary
        finally:
            self._finish(call, context)

    async def ListModels(self, request: pb.ListModelsRequest, context: Context) -> pb.ListModelsResponse:
        call = self._begin("ListModels")
        try:
            models: list[Any] = []
            for engine in self.engines.values():
                info = engine.info()
                models.append(pb.ModelInfo(
                    name=info["name"], fingerprint=info["fingerprint"], backend=info["backend"],
                    vocab_size=info["vocab_size"], boundary_tokens=info["boundary_tokens"],
                    l1_disabled_reason=info["l1_disabled_reason"], has_chat_template=info["has_chat_template"],
                    shm_name=info["shm_name"], model_dir=str(engine.path.resolve()), default_mode=self.default_mode,
                ))
            return pb.ListModelsResponse(models=models)
        finally:
            self._finish(call, context)
