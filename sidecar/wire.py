"""Proto ↔ domain conversion for the servicer, with field-naming validation.

The proto carries chat messages typed (role, content or parts, tool calls…)
and the free-form parts (tools, template kwargs, extra message keys) as JSON.
Here they become the plain dicts the chat template sees, exactly as
``transformers.apply_chat_template`` would receive them from a Python caller.

Errors name fields as the Python client's caller passed them and as the
renderer names them (``messages[2].role``, ``tools``, ``chat_template_kwargs``,
``messages[1].tool_calls[0].function.arguments``): one request, one naming,
whichever layer refuses it. A field carried as JSON says so in the message
(``tools: invalid JSON in tools_json: ...``) for raw gRPC callers.
"""

from __future__ import annotations

import json
from typing import Any

from tokcache.engine.errors import InvalidRequest
from tokcache.ids import unpack_ids
from tokcache.v1 import tokenizer_pb2 as pb

__all__ = ["MODE_FROM_PROTO", "chat_from_proto", "source_to_proto", "unpack_ids"]

MODE_FROM_PROTO: dict[int, str] = {
    pb.TOKENIZE_MODE_KV_STABLE: "kv-stable",
    pb.TOKENIZE_MODE_EXACT: "exact",
}

_SOURCE_TO_PROTO: dict[str, Any] = {
    "miss": pb.CACHE_SOURCE_MISS,
    "l0": pb.CACHE_SOURCE_L0,
    "l1": pb.CACHE_SOURCE_L1,
    "ar": pb.CACHE_SOURCE_AR,
}


def source_to_proto(source: str) -> Any:
    return _SOURCE_TO_PROTO[source]


# Deeper JSON than this is refused: templates walk values recursively, and a
# few hundred levels would exhaust the interpreter's stack mid-render.
MAX_JSON_DEPTH = 64


def _depth_ok(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return False
        stack.extend((c, depth + 1) for c in children)
    return True


def _json(text: str, field: str, proto_field: str, kind: type) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(field, f"invalid JSON in {proto_field}: {exc}") from exc
    if not isinstance(value, kind):
        raise InvalidRequest(field, f"{proto_field}: expected a JSON {'object' if kind is dict else 'array'}")
    if not _depth_ok(value, MAX_JSON_DEPTH):
        raise InvalidRequest(field, f"{proto_field}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _message(m: pb.ChatMessage, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not m.role:
        raise InvalidRequest(f"{where}.role", "is required")
    out: dict[str, Any] = {"role": m.role}
    kind = m.WhichOneof("content_kind")
    if kind == "content":
        out["content"] = m.content
    elif kind == "content_parts":
        parts = []
        for j, part in enumerate(m.content_parts.parts):
            if part.type != "text":
                raise InvalidRequest(f"{where}.content[{j}].type",
                                     f"unsupported content part type {part.type!r} (only 'text')")
            parts.append({"type": "text", "text": part.text})
        out["content"] = parts
    else:
        out["content"] = None
    if m.HasField("name"):
        out["name"] = m.name
    if m.HasField("tool_call_id"):
        out["tool_call_id"] = m.tool_call_id
    if m.HasField("reasoning_content"):
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            fn: dict[str, Any] = {"name": call.function.name}
            which = call.function.WhichOneof("arguments_kind")
            if which == "arguments_json":
                fn["arguments"] = _json(call.function.arguments_json, f"{where}.tool_calls[{j}].function.arguments",
                                        "arguments_json", dict)
            elif which == "arguments":
                fn["arguments"] = call.function.arguments
            entry: dict[str, Any] = {"type": call.type or "function", "function": fn}
            if call.id:
                entry["id"] = call.id
            calls.append(entry)
        out["tool_calls"] = calls
    if m.extra_json:
        extra = _json(m.extra_json, where, "extra_json (the message's other keys)", dict)
        clash = set(extra) & set(out)
        if clash:
            raise InvalidRequest(where, f"extra_json repeats typed fields {sorted(clash)}")
        out.update(extra)
    return out


def chat_from_proto(chat: pb.ChatInput) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, render options) from a ChatInput; InvalidRequest names the bad field."""
    if not chat.messages:
        raise InvalidRequest("messages", "at least one message is required")
    messages = [_message(m, i) for i, m in enumerate(chat.messages)]
    options: dict[str, Any] = {
        "add_generation_prompt": chat.add_generation_prompt,
        "continue_final_message": chat.continue_final_message,
    }
    if chat.tools_json:
        options["tools"] = _json(chat.tools_json, "tools", "tools_json", list)
    if chat.chat_template_kwargs_json:
        options["chat_template_kwargs"] = _json(
            chat.chat_template_kwargs_json, "chat_template_kwargs", "chat_template_kwargs_json", dict)
    return messages, options

