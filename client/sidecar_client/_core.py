"""What the sync and async clients share: building requests, reading responses.

No I/O here. Messages are OpenAI-style dicts; they are validated before
sending so a bad field is reported without a round trip, with the same field
names the server uses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar_client._models import CacheDecision, ModelInfo, TokenizeResult
from sidecar_client._results import ResultCache, group_of
from sidecar_client.errors import InvalidArgumentError, SidecarInternalError
from tokcache.ids import pack_ids as _pack_ids
from tokcache.ids import unpack_ids
from tokcache.v1 import tokenizer_pb2 as pb

__all__ = ["ADDRESS_ENV", "TokenizePlan", "assemble_ids", "build_chat", "build_record", "build_tokenize",
           "channel_target", "default_address", "pack_ids", "read_models", "read_tokenize", "record_kwargs",
           "unpack_ids"]

ADDRESS_ENV = "TOKCACHE_ADDRESS"
DEFAULT_ADDRESS = "unix:///run/tokcache/tokcache.sock"

_MODES = {None: pb.TOKENIZE_MODE_UNSPECIFIED, "kv-stable": pb.TOKENIZE_MODE_KV_STABLE,
          "exact": pb.TOKENIZE_MODE_EXACT}
_SOURCES = {pb.CACHE_SOURCE_MISS: "miss", pb.CACHE_SOURCE_L0: "l0", pb.CACHE_SOURCE_L1: "l1",
            pb.CACHE_SOURCE_AR: "ar"}
_TYPED_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}

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


def _bad(field: str, message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{field}: {message}", field=field)


def _message(m: Any, i: int) -> pb.ChatMessage:
    where = f"chat.messages[{i}]"
    if not isinstance(m, Mapping):
        raise _bad(where, f"expected a mapping, got {type(m).__name__}")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise _bad(f"{where}.role", "is required (a non-empty string)")
    msg = pb.ChatMessage(role=role)
    content = m.get("content")
    if isinstance(content, str):
        msg.content = content
    elif isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("text", ""), str):
                raise _bad(f"{where}.content[{j}]", "expected {'type': 'text', 'text': str}")
            parts.append(pb.ContentPart(type=str(part.get("type", "")), text=part.get("text", "")))
        msg.content_parts.parts.extend(parts)
        msg.content_parts.SetInParent()
    elif content is not None:
        raise _bad(f"{where}.content", f"expected str, list of parts or None, got {type(content).__name__}")
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = m.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise _bad(f"{where}.{key}", f"expected str, got {type(value).__name__}")
            setattr(msg, key, value)
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, Sequence):
            raise _bad(f"{where}.tool_calls", "expected a list")
        for j, call in enumerate(calls):
            if not isinstance(call, Mapping):
                raise _bad(f"{where}.tool_calls[{j}]", "expected a mapping")
            fn = call.get("function") or {}
            if not isinstance(fn, Mapping):
                raise _bad(f"{where}.tool_calls[{j}].function", "expected a mapping")
            tc = msg.tool_calls.add(id=str(call.get("id") or ""), type=str(call.get("type") or "function"))
            tc.function.name = str(fn.get("name") or "")
            args = fn.get("arguments")
            if isinstance(args, str):
                tc.function.arguments = args
            elif isinstance(args, Mapping):
                tc.function.arguments_json = json.dumps(args, ensure_ascii=False)
            elif args is not None:
                raise _bad(f"{where}.tool_calls[{j}].function.arguments", "expected str or mapping")
    extra = {k: v for k, v in m.items() if k not in _TYPED_KEYS}
    if extra:
        try:
            msg.extra_json = json.dumps(extra, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise _bad(f"{where}", f"extra keys are not JSON-serialisable: {exc}") from exc
    return msg


def build_chat(messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None,
               add_generation_prompt: bool, continue_final_message: bool,
               chat_template_kwargs: Mapping[str, Any] | None) -> pb.ChatInput:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise _bad("chat.messages", "expected a non-empty list of messages")
    chat = pb.ChatInput(
        messages=[_message(m, i) for i, m in enumerate(messages)],
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    try:
        if tools:
            chat.tools_json = json.dumps(list(tools), ensure_ascii=False)
        if chat_template_kwargs:
            chat.chat_template_kwargs_json = json.dumps(dict(chat_template_kwargs), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise _bad("chat.tools", f"not JSON-serialisable: {exc}") from exc
    return chat


def build_tokenize(model: str, *, text: str | None, messages: Sequence[Mapping[str, Any]] | None,
                   tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool,
                   continue_final_message: bool, chat_template_kwargs: Mapping[str, Any] | None,
                   add_special_tokens: bool | None, cache_salt: str | None, mode: str | None,
                   return_prompt_text: bool, into: pb.TokenizeRequest | None = None) -> pb.TokenizeRequest:
    """The request message, validated; filled into ``into`` (an empty message) when given."""
    if not isinstance(model, str) or not model:
        raise _bad("model", "is required")
    if (text is None) == (messages is None):
        raise _bad("input", "give exactly one of text or messages")
    if mode not in _MODES:
        raise _bad("mode", f"expected 'kv-stable' or 'exact', got {mode!r}")
    req = pb.TokenizeRequest() if into is None else into
    req.model = model
    req.cache_salt = cache_salt or ""
    req.mode = _MODES[mode]
    req.return_prompt_text = return_prompt_text
    if text is not None:
        if not isinstance(text, str):
            raise _bad("text", f"expected str, got {type(text).__name__}")
        req.text = text
    else:
        assert messages is not None
        req.chat.CopyFrom(build_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message,
                                     chat_template_kwargs=chat_template_kwargs))
    if add_special_tokens is not None:
        req.add_special_tokens = bool(add_special_tokens)
    return req


def assemble_ids(resp: pb.TokenizeResponse, known: Mapping[bytes, tuple[int, ...]] | None) -> list[int]:
    """The reply's ids as a new list: unpacked, or a delta on a result the client offered.

    Raises SidecarInternalError when a delta names a result that was not offered or
    the count does not add up (a server bug; the ids would be wrong).
    """
    ids = unpack_ids(resp.token_ids)
    if resp.base_handle:
        base = (known or {}).get(resp.base_handle)
        n = resp.base_tokens
        if base is None or n > len(base):
            raise SidecarInternalError("delta reply on a result this client did not offer")
        full = list(base)  # one pass over the ints we hold; the rest is pointer work
        del full[n:]
        full += ids
        ids = full
    if len(ids) != resp.num_tokens:
        raise SidecarInternalError(f"reply has {len(ids)} ids, says {resp.num_tokens}")
    return ids


def read_tokenize(resp: pb.TokenizeResponse, want_text: bool,
                  known: Mapping[bytes, tuple[int, ...]] | None = None) -> TokenizeResult:
    d = resp.decision
    return TokenizeResult(
        token_ids=assemble_ids(resp, known),
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
                      has_chat_template=m.has_chat_template) for m in resp.models]


def pack_ids(ids: Sequence[int], field: str) -> bytes:
    """ids → little-endian uint32 bytes; InvalidArgumentError names the field if one is out of range."""
    try:
        return _pack_ids(ids)
    except (OverflowError, TypeError) as exc:
        raise _bad(field, f"ids must be integers in [0, 2**32): {exc}") from exc


def build_record(model: str, *, prompt_text: str, prompt_token_ids: Sequence[int], output_text: str,
                 output_token_ids: Sequence[int], finish_reason: str | None, stop_reason: int | str | None,
                 cache_salt: str | None, prompt_add_special_tokens: bool) -> pb.RecordOutputRequest:
    if not isinstance(model, str) or not model:
        raise _bad("model", "is required")
    for name, value in (("prompt_text", prompt_text), ("output_text", output_text)):
        if not isinstance(value, str):
            raise _bad(name, f"expected str, got {type(value).__name__}")
    req = pb.RecordOutputRequest(
        model=model, cache_salt=cache_salt or "", prompt_text=prompt_text,
        prompt_token_ids=pack_ids(prompt_token_ids, "prompt_token_ids"), output_text=output_text,
        output_token_ids=pack_ids(output_token_ids, "output_token_ids"), finish_reason=finish_reason or "",
        prompt_add_special_tokens=prompt_add_special_tokens)
    if isinstance(stop_reason, bool):
        raise _bad("stop_reason", "expected a token id, a stop string or None")
    if isinstance(stop_reason, int):
        if not 0 <= stop_reason < 2**32:
            raise _bad("stop_reason", "token id out of range")
        req.stop_token_id = stop_reason
    elif isinstance(stop_reason, str):
        req.stop_string = stop_reason
    elif stop_reason is not None:
        raise _bad("stop_reason", "expected a token id, a stop string or None")
    return req


def record_kwargs(record: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults for the optional keys of a record mapping (record_outputs)."""
    out = {"finish_reason": "stop", "stop_reason": None, "cache_salt": None, "prompt_add_special_tokens": False}
    out.update(record)
    return out


class TokenizePlan:
    """One ``tokenize`` call's request, with the deltas the client's kept results allow.

    ``sreq`` is the stream message, ``req`` its TokenizeRequest (also what a unary
    call sends). When the sidecar no longer holds the ``text_base`` result
    (UnknownResultError), :meth:`resend_whole_text` turns the request back into
    a plain one for a single retry.
    """

    def __init__(self, results: ResultCache, model: str, *, text: str | None,
                 messages: Sequence[Mapping[str, Any]] | None, tools: Sequence[Mapping[str, Any]] | None,
                 add_generation_prompt: bool, continue_final_message: bool,
                 chat_template_kwargs: Mapping[str, Any] | None, add_special_tokens: bool | None,
                 cache_salt: str | None, mode: str | None, return_prompt_text: bool) -> None:
        self._results = results
        self._text = text
        self._want_text = return_prompt_text
        self.group = group_of(model, text, messages, cache_salt, mode, add_special_tokens) \
            if isinstance(model, str) and (text is None or isinstance(text, str)) else None
        self.known = results.offer(self.group)
        self.base, cut = results.text_base(self.group, text) if isinstance(text, str) else (b"", 0)
        self.sreq = pb.TokenizeStreamRequest()
        self.req = build_tokenize(model, text=text[cut:] if cut and text is not None else text, messages=messages,
                                  tools=tools, add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message,
                                  chat_template_kwargs=chat_template_kwargs, add_special_tokens=add_special_tokens,
                                  cache_salt=cache_salt, mode=mode, return_prompt_text=return_prompt_text,
                                  into=self.sreq.request)
        self.req.known_results.extend(self.known)
        self.req.keep_result = self.group is not None
        if self.base:
            self.req.text_base = self.base

    def resend_whole_text(self) -> bool:
        """Drop the request delta (the sidecar lost its base); False when there was none."""
        if not self.base or self._text is None:
            return False
        self._results.forget(self.base)
        self.req.text = self._text
        self.req.ClearField("text_base")
        self.base = b""
        return True

    def finish(self, resp: pb.TokenizeResponse) -> TokenizeResult:
        """The result of the reply; keeps it for the next request's deltas."""
        result = read_tokenize(resp, self._want_text, self.known)
        self._results.add(self.group, resp.result_handle, result.token_ids, self._text)
        return result
