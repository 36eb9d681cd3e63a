"""asyncio client over ``grpc.aio``; same methods as :class:`SidecarClient`, awaitable."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc

from sidecar_client import _core
from sidecar_client._models import ModelInfo, RecordResult, RecordSummary, TokenizeResult
from sidecar_client._results import ResultCache
from sidecar_client._tokenize_stream import AsyncTokenizeStream
from sidecar_client.errors import translate
from tokcache.v1 import tokenizer_pb2 as pb
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc

__all__ = ["AsyncSidecarClient"]


class AsyncSidecarClient:
    """Talks to a tokcache sidecar from one event loop (create it inside the loop)."""

    def __init__(self, address: str | None = None, *, timeout: float | None = 30.0,
                 metadata: Sequence[tuple[str, str]] | None = None, stream: bool = True) -> None:
        self.address = address or _core.default_address()
        self.timeout = timeout
        self._metadata = tuple(metadata or ())
        self._channel = grpc.aio.insecure_channel(_core.channel_target(self.address),
                                                  options=_core.CHANNEL_OPTIONS)
        self._stub = pb_grpc.TokenizerStub(self._channel)
        self._stream = AsyncTokenizeStream(self._channel, self._metadata)
        self._stream.enabled = stream
        self._results = ResultCache()

    async def tokenize(self, model: str, *, text: str | None = None,
                       messages: Sequence[Mapping[str, Any]] | None = None,
                       tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False,
                       continue_final_message: bool = False,
                       chat_template_kwargs: Mapping[str, Any] | None = None,
                       add_special_tokens: bool | None = None, cache_salt: str | None = None,
                       mode: str | None = None, return_prompt_text: bool = False,
                       timeout: float | None = None) -> TokenizeResult:
        """See :meth:`SidecarClient.tokenize` (the stream is used when no other task is using it)."""
        plan = _core.TokenizePlan(self._results, model, text=text, messages=messages, tools=tools,
                                  add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message,
                                  chat_template_kwargs=chat_template_kwargs,
                                  add_special_tokens=add_special_tokens, cache_salt=cache_salt, mode=mode,
                                  return_prompt_text=return_prompt_text)
        wait = timeout if timeout is not None else self.timeout

        def unary(left: float | None) -> Any:
            return self._call(self._stub.Tokenize, plan.req, left)

        return plan.finish(await self._stream.send(plan, wait, unary))

    async def render(self, model: str, messages: Sequence[Mapping[str, Any]], *,
                     tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False,
                     continue_final_message: bool = False,
                     chat_template_kwargs: Mapping[str, Any] | None = None,
                     timeout: float | None = None) -> str:
        """See :meth:`SidecarClient.render`."""
        chat = _core.build_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template_kwargs=chat_template_kwargs)
        resp = await self._call(self._stub.Render, pb.RenderRequest(model=model, chat=chat), timeout)
        return str(resp.prompt_text)

    async def record_output(self, model: str, *, prompt_text: str, prompt_token_ids: Sequence[int],
                      output_text: str, output_token_ids: Sequence[int], finish_reason: str | None = "stop",
                      stop_reason: int | str | None = None, cache_salt: str | None = None,
                      prompt_add_special_tokens: bool = False, timeout: float | None = None) -> RecordResult:
        """Record what the model generated for ``prompt_text`` (the AR cache).

        ``stop_reason``: the stop token id, the stop string (such a record is
        refused: its ids run past the text) or None (EOS / length). The
        sidecar verifies the record first; a refusal raises
        :class:`~sidecar_client.errors.InvalidArgumentError` with the reason.
        """
        req = _core.build_record(model, prompt_text=prompt_text, prompt_token_ids=prompt_token_ids,
                                 output_text=output_text, output_token_ids=output_token_ids,
                                 finish_reason=finish_reason, stop_reason=stop_reason, cache_salt=cache_salt,
                                 prompt_add_special_tokens=prompt_add_special_tokens)
        resp = await self._call(self._stub.RecordOutput, req, timeout)
        return RecordResult(recorded_tokens=resp.recorded_tokens, stop_token_dropped=resp.stop_token_dropped,
                            entries=resp.entries)

    async def record_outputs(self, model: str, records: Iterable[Mapping[str, Any]], *,
                       timeout: float | None = None) -> RecordSummary:
        """Record many outputs on one stream; refused ones are listed, not raised.

        Each record is a mapping with the keyword arguments of :meth:`record_output`.
        """
        reqs = [_core.build_record(model, **_core.record_kwargs(r)) for r in records]
        resp = await self._call(self._stub.RecordOutputs, iter(reqs), timeout)
        return RecordSummary(recorded=resp.recorded, refused=resp.refused,
                             refusals=[(r.index, r.reason) for r in resp.refusals])

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """See :meth:`SidecarClient.list_models`."""
        return _core.read_models(await self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout))

    async def _call(self, method: Any, req: Any, timeout: float | None) -> Any:
        try:
            return await method(req, timeout=timeout if timeout is not None else self.timeout,
                                metadata=self._metadata or None)
        except grpc.RpcError as exc:
            raise translate(exc) from exc

    async def close(self) -> None:
        """Close the stream and the channel; idempotent."""
        self._stream.close()
        await self._channel.close()

    async def __aenter__(self) -> AsyncSidecarClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
