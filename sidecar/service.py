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
from sidecar.wire import MODE_FROM_PROTO, chat_from_proto, source_to_proto
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
