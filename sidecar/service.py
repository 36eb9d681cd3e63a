"""The gRPC servicer: requests in, engine calls, status codes out.

Handlers run on the asyncio event loop and do their CPU work inline: a
Tokenize is tens to hundreds of microseconds, less than a hop to a thread
pool would cost, and the GIL would serialise the work anyway. Parallelism
across cores comes from several server processes on one segment.

Status mapping (messages name the field)::

    UnknownModel     NOT_FOUND
    InvalidRequest   INVALID_ARGUMENT   (TemplateError too, with the template's text)
    RequestTooLarge  RESOURCE_EXHAUSTED
    still loading    UNAVAILABLE
    anything else    INTERNAL (logged with traceback; the server keeps serving)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NoReturn

import grpc

from sidecar.engine.errors import EngineError, InvalidRequest, RequestTooLarge, UnknownModel
from sidecar.engine.model import ModelEngine
from sidecar.wire import MODE_FROM_PROTO, chat_from_proto, source_to_proto, unpack_ids
from tokcache.v1 import tokenizer_pb2 as pb
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["TokenizerService"]


class TokenizerService(pb_grpc.TokenizerServicer):
    """Serves ``tokcache.v1.Tokenizer``. ``engines`` is filled once loading is done."""

    def __init__(self, default_mode: str = "kv-stable") -> None:
        self.engines: dict[str, ModelEngine] = {}
        self.ready = False
        self.default_mode = default_mode

    def set_engines(self, engines: Mapping[str, ModelEngine]) -> None:
        """Publish the loaded models (called once, on the event loop)."""
        self.engines = dict(engines)
        self.ready = True

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
        if isinstance(exc, UnknownModel):
            code = grpc.StatusCode.NOT_FOUND
        elif isinstance(exc, InvalidRequest):
            code = grpc.StatusCode.INVALID_ARGUMENT
        elif isinstance(exc, RequestTooLarge):
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
        else:
            log.exception("internal error", exc_info=exc)
            code = grpc.StatusCode.INTERNAL
        await context.abort(code, str(exc) if isinstance(exc, EngineError) else f"internal error: {exc!r}")
        raise AssertionError("unreachable")  # abort raises

    async def _engine(self, model: str, context: grpc.aio.ServicerContext) -> ModelEngine:
        if not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "sidecar is loading tokenizers")
        if not model:
            raise InvalidRequest("model", "is required")
        engine = self.engines.get(model)
        if engine is None:
            raise UnknownModel(model)
        return engine

    def _render(self, engine: ModelEngine, chat: pb.ChatInput) -> str:
        messages, options = chat_from_proto(chat)
        return engine.render(messages, **options)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            engine = await self._engine(request.model, context)
            which = request.WhichOneof("input")
            if which == "text":
                text = request.text
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            elif which == "chat":
                text = self._render(engine, request.chat)
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else False
            else:
                raise InvalidRequest("input", "one of text or chat is required")
            mode = MODE_FROM_PROTO.get(request.mode, self.default_mode)
            if request.mode not in (0, *MODE_FROM_PROTO):
                raise InvalidRequest("mode", f"unknown mode {request.mode}")
            out = engine.tokenize(text, add_special_tokens=add_special, salt=request.cache_salt, mode=mode)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await self._abort(context, exc)
        d = out.decision
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

    async def Render(self, request: pb.RenderRequest, context: grpc.aio.ServicerContext) -> pb.RenderResponse:
        try:
            engine = await self._engine(request.model, context)
            text = self._render(engine, request.chat)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await self._abort(context, exc)
        return pb.RenderResponse(prompt_text=text, fingerprint=engine.fingerprint)

    def _record(self, engine: ModelEngine, r: pb.RecordOutputRequest) -> pb.RecordOutputResponse:
        for name in ("prompt_token_ids", "output_token_ids"):
            if len(getattr(r, name)) % 4:
                raise InvalidRequest(name, "length is not a multiple of 4 (little-endian uint32 ids)")
        which = r.WhichOneof("stop_reason_kind")
        out = engine.record_output(
            prompt_text=r.prompt_text, prompt_ids=unpack_ids(r.prompt_token_ids),
            output_text=r.output_text, output_ids=unpack_ids(r.output_token_ids),
            finish_reason=r.finish_reason,
            stop_token_id=r.stop_token_id if which == "stop_token_id" else None,
            stop_string=r.stop_string if which == "stop_string" else None,
            salt=r.cache_salt, prompt_add_special_tokens=r.prompt_add_special_tokens)
        return pb.RecordOutputResponse(recorded_tokens=out.recorded_tokens,
                                       stop_token_dropped=out.stop_token_dropped, entries=out.entries)

    async def RecordOutput(self, request: pb.RecordOutputRequest,
                           context: grpc.aio.ServicerContext) -> pb.RecordOutputResponse:
        try:
            engine = await self._engine(request.model, context)
            return self._record(engine, request)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await self._abort(context, exc)

    async def RecordOutputs(self, request_iterator: Any,
                            context: grpc.aio.ServicerContext) -> pb.RecordOutputsResponse:
        summary = pb.RecordOutputsResponse()
        index = 0
        async for request in request_iterator:
            try:
                engine = await self._engine(request.model, context)
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
        return summary

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        models: list[Any] = []
        for engine in self.engines.values():
            info = engine.info()
            models.append(pb.ModelInfo(
                name=info["name"], fingerprint=info["fingerprint"], backend=info["backend"],
                vocab_size=info["vocab_size"], boundary_tokens=info["boundary_tokens"],
                l1_disabled_reason=info["l1_disabled_reason"], has_chat_template=info["has_chat_template"],
            ))
        return pb.ListModelsResponse(models=models)
