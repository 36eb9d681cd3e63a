"""What the sync and async clients share: building requests, reading responses.

No I/O here. Every ``build_*`` validates its arguments first (``_validate``), so a
malformed one is reported without a round trip, as InvalidArgumentError naming the
caller's own argument (``messages[2].tool_calls[0].function``), and the builders
below only convert arguments that passed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sidecar_client import _validate
from sidecar_client._models import CacheDecision, ModelInfo, TokenizeResult
from sidecar_client.errors import InvalidArgumentError
from tokcache.engine.ids import unpack_interned
from tokcache.v1 import tokenizer_pb2 as pb

__all__ = ["ADDRESS_ENV", "MAX_DEADLINE_S", "build_chat", "build_record", "build_records", "build_render",
           "build_tokenize", "channel_target", "check_timeout", "check_tokenize", "default_address", "grpc_timeout",
           "pack_ids", "read_models", "read_tokenize", "record_kwargs"]

ADDRESS_ENV = "TOKCACHE_ADDRESS"
DEFAULT_ADDRESS = "unix:///run/tokcache/tokcache.sock"

_MODES = {None: pb.TOKENIZE_MODE_UNSPECIFIED, "kv-stable": pb.TOKENIZE_MODE_KV_STABLE,
          "exact": pb.TOKENIZE_MODE_EXACT}
_SOURCES = {pb.CACHE_SOURCE_MISS: "miss", pb.CACHE_SOURCE_L0: "l0", pb.CACHE_SOURCE_L1: "l1",
            pb.CACHE_SOURCE_AR: "ar"}

# Channel options: large prompts, and no proxy lookups for a local socket.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.enable_http_proxy", 0),
]


def default_address() -> str:
    """``$TOKCACHE_ADDRESS`` or the conventional socket path."""
    return os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


def channel_target(address: str) -> str:
    """Accept ``unix:///p``, ``unix:p``, ``HOST:PORT``, and a bare ``/path.sock``."""
    if address.startswith("/"):
        return "unix://" + address
    return address


def _message(m: Mapping[str, Any]) -> pb.ChatMessage:
    """A message that passed :func:`_validate.chat` as its proto."""
    msg = pb.ChatMessage(role=m["role"])
    content = m.get("content")
    if isinstance(content, str):
        msg.content = content
    elif content is not None:
        msg.content_parts.parts.extend(pb.ContentPart(type=p["type"], text=p["text"]) for p in content)
        msg.content_parts.SetInParent()  # an empty list is still a list, not None
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = m.get(key)
        if value is not None:
            setattr(msg, key, value)
    for call in m.get("tool_calls") or ():
        fn = call["function"]
        tc = msg.tool_calls.add(id=call.get("id") or "", type=call.get("type") or "function")
        tc.function.name = fn["name"]
        args = fn["arguments"]
        if isinstance(args, str):
            tc.function.arguments = args
        else:
            tc.function.arguments_json = json.dumps(dict(args), ensure_ascii=False)
    extra = {k: v for k, v in m.items() if k not in _validate.TYPED_MESSAGE_KEYS}
    if extra:
        msg.extra_json = json.dumps(extra, ensure_ascii=False)
    return msg


def _chat(messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None,
          add_generation_prompt: bool, continue_final_message: bool,
          chat_template_kwargs: Mapping[str, Any] | None) -> pb.ChatInput:
    chat = pb.ChatInput(messages=[_message(m) for m in messages], add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message)
    if tools:
        chat.tools_json = json.dumps(list(tools), ensure_ascii=False)
    if chat_template_kwargs:
        chat.chat_template_kwargs_json = json.dumps(dict(chat_template_kwargs), ensure_ascii=False)
    return chat


def build_chat(messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None,
               add_generation_prompt: bool, continue_final_message: bool,
               chat_template_kwargs: Mapping[str, Any] | None) -> pb.ChatInput:
    """The ChatInput of ``render``'s chat arguments; InvalidArgumentError names a malformed one."""
    _validate.chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                   continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)
    return _chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                 continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)


def build_render(model: str, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None,
                 add_generation_prompt: bool, continue_final_message: bool,
                 chat_template_kwargs: Mapping[str, Any] | None) -> pb.RenderRequest:
    """``render``'s request; InvalidArgumentError names a malformed argument (``model`` too)."""
    _validate.model_name(model)
    return pb.RenderRequest(model=model, chat=build_chat(
        messages, tools=tools, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs))


def check_tokenize(model: str, *, text: str | None, messages: Sequence[Mapping[str, Any]] | None,
                   tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool,
                   continue_final_message: bool, chat_template_kwargs: Mapping[str, Any] | None,
                   add_special_tokens: bool | None, cache_salt: str | None, mode: str | None,
                   return_prompt_text: bool) -> None:
    """``tokenize``'s arguments (all but ``timeout``) checked without building a request, for a
    path that sends none (in-process, which finds a lone surrogate in ``text`` itself as it
    encodes it); :func:`build_tokenize` checks the same."""
    _validate.tokenize(model, text=text, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
                       add_special_tokens=add_special_tokens, cache_salt=cache_salt, mode=mode,
                       return_prompt_text=return_prompt_text, text_unicode=False)


def plain_text_call(model: object, text: object, messages: object, tools: object, add_generation_prompt: object,
                    continue_final_message: object, chat_template_kwargs: object, add_special_tokens: object,
                    cache_salt: object, mode: object, return_prompt_text: object, timeout: object) -> bool:
    """True for the common call — text, no chat options, ASCII model name and salt, a known
    mode, no timeout — whose arguments :func:`check_tokenize` and :func:`check_timeout`
    would pass without looking further: an in-process read skips them (~15 µs of checks
    on a ~200 µs call). Anything else returns False and is checked in full."""
    return (type(text) is str and type(model) is str and model != "" and model.isascii()
            and messages is None and tools is None and chat_template_kwargs is None
            and add_generation_prompt is False and continue_final_message is False and return_prompt_text is False
            and (add_special_tokens is None or add_special_tokens is True or add_special_tokens is False)
            and (cache_salt is None or (type(cache_salt) is str and cache_salt.isascii()))
            and (mode is None or mode == "kv-stable" or mode == "exact") and timeout is None)


def reads_locally(local: bool, model: Any, text: Any, messages: Any, tools: Any, add_generation_prompt: Any,
                  continue_final_message: Any, chat_template_kwargs: Any, add_special_tokens: Any,
                  cache_salt: Any, mode: Any, return_prompt_text: Any, timeout: Any) -> bool:
    """Whether a ``tokenize`` call is for the in-process read (``local``: the client has one),
    its arguments checked on the way: InvalidArgumentError for a malformed one. False for a call
    only the sidecar answers (chat messages, ``return_prompt_text``), checked by then as far as
    the timeout; the request builder checks the rest."""
    if local and plain_text_call(model, text, messages, tools, add_generation_prompt, continue_final_message,
                                 chat_template_kwargs, add_special_tokens, cache_salt, mode, return_prompt_text,
                                 timeout):
        return True
    check_timeout(timeout)
    if not (local and messages is None and isinstance(text, str) and not return_prompt_text
            and isinstance(model, str) and model):
        return False
    check_tokenize(model, text=text, messages=None, tools=tools, add_generation_prompt=add_generation_prompt,
                   continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
                   add_special_tokens=add_special_tokens, cache_salt=cache_salt, mode=mode,
                   return_prompt_text=return_prompt_text)
    return True


# gRPC turns a call's timeout into an absolute deadline in int64 nanoseconds: one past the
# year ~2262 wraps into the past and the call fails at once with DEADLINE_EXCEEDED (a
# timeout of 7.4e9 s did, on Python 3.10-3.13 alike). A valid timeout longer than this is
# given to gRPC as no deadline, which is what anyone asking for decades means.
MAX_DEADLINE_S = 1e9  # ~31.7 years


def grpc_timeout(seconds: float | None) -> float | None:
    """The timeout to hand gRPC for a call of ``seconds`` (None: no deadline)."""
    return None if seconds is None or seconds > MAX_DEADLINE_S else seconds


def check_timeout(timeout: float | None) -> None:
    """InvalidArgumentError unless ``timeout`` is None or a finite number of seconds >= 0."""
    _validate.timeout(timeout)


def build_tokenize(model: str, *, text: str | None, messages: Sequence[Mapping[str, Any]] | None,
                   tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool,
                   continue_final_message: bool, chat_template_kwargs: Mapping[str, Any] | None,
                   add_special_tokens: bool | None, cache_salt: str | None, mode: str | None,
                   return_prompt_text: bool, into: pb.TokenizeRequest | None = None) -> pb.TokenizeRequest:
    """The request message, validated first; filled into ``into`` (an empty message) when given."""
    _validate.tokenize(model, text=text, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
                       add_special_tokens=add_special_tokens, cache_salt=cache_salt, mode=mode,
                       return_prompt_text=return_prompt_text)
    req = pb.TokenizeRequest() if into is None else into
    req.model = model
    req.cache_salt = cache_salt or ""
    req.mode = _MODES[mode]
    req.return_prompt_text = return_prompt_text
    if text is not None:
        req.text = text
    else:
        assert messages is not None
        req.chat.CopyFrom(_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template_kwargs=chat_template_kwargs))
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req


def read_tokenize(resp: pb.TokenizeResponse, want_text: bool) -> TokenizeResult:
    d = resp.decision
    return TokenizeResult(
        # One int object per id value, shared by every result (tokcache.engine.ids.intern_ids),
        # as the in-process reads' results are: not ~14k new ints per 57 KB reply (unpacking
        # 16k ids into shared ints takes ~35 µs warm, into new ones ~90).
        token_ids=unpack_interned(resp.token_ids),
        fingerprint=resp.fingerprint,
        backend=resp.backend,
        prompt_text=resp.prompt_text if want_text else None,
        decision=CacheDecision(
            source=_SOURCES.get(d.source, "miss"),
            cached_tokens=d.cached_tokens,
            cached_chars=d.cached_chars,
            encoded_chars=d.encoded_chars,
            ar_spliced_tokens=d.ar_spliced_tokens,
            boundaries=d.boundaries,
            l1_disabled_reason=d.l1_disabled_reason,
        ),
    )


def read_models(resp: pb.ListModelsResponse) -> list[ModelInfo]:
    return [ModelInfo(name=m.name, fingerprint=m.fingerprint, backend=m.backend, vocab_size=m.vocab_size,
                      boundary_tokens=m.boundary_tokens, l1_disabled_reason=m.l1_disabled_reason,
                      has_chat_template=m.has_chat_template, shm_name=m.shm_name, model_dir=m.model_dir,
                      default_mode=m.default_mode)
            for m in resp.models]


def pack_ids(ids: Sequence[int], field: str) -> bytes:
    """ids → little-endian uint32 bytes; InvalidArgumentError names ``field`` (or ``field[i]``) if one
    is not an int in [0, 2**32)."""
    return _validate.token_ids(ids, field)


def build_record(model: str, *, prompt_text: str, prompt_token_ids: Sequence[int], output_text: str,
                 output_token_ids: Sequence[int], finish_reason: str | None, stop_reason: int | str | None,
                 cache_salt: str | None, prompt_add_special_tokens: bool, where: str = "") -> pb.RecordOutputRequest:
    """``record_output``'s request, validated first; ``where`` prefixes the fields errors name
    (``"records[3]."`` for an item of ``record_outputs``)."""
    prompt_ids, output_ids = _validate.record(
        model, prompt_text=prompt_text, prompt_token_ids=prompt_token_ids, output_text=output_text,
        output_token_ids=output_token_ids, finish_reason=finish_reason, stop_reason=stop_reason,
        cache_salt=cache_salt, prompt_add_special_tokens=prompt_add_special_tokens, where=where)
    req = pb.RecordOutputRequest(
        model=model, cache_salt=cache_salt or "", prompt_text=prompt_text, prompt_token_ids=prompt_ids,
        output_text=output_text, output_token_ids=output_ids, finish_reason=finish_reason or "",
        prompt_add_special_tokens=prompt_add_special_tokens)
    if isinstance(stop_reason, str):
        req.stop_string = stop_reason
    elif stop_reason is not None:
        req.stop_token_id = int(stop_reason)
    return req


def build_records(model: str, records: Iterable[Mapping[str, Any]]) -> list[pb.RecordOutputRequest]:
    """``record_outputs``' requests, one per item; errors name ``records[i].<key>``."""
    _validate.model_name(model)
    return [build_record(model, **_validate.record_item(r, f"records[{i}]"), where=f"records[{i}].")
            for i, r in enumerate(_validate.records(records))]


def record_kwargs(record: Mapping[str, Any]) -> dict[str, Any]:
    """An item of ``record_outputs`` as :func:`build_record`'s keyword arguments, defaults filled.

    Its index is not known here, so a malformed item is reported as ``records``
    (:func:`build_records` names ``records[i].<key>``).
    """
    try:
        return _validate.record_item(record, "records[?]")
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"records: {exc.details}", field="records") from None
