"""Checks of every argument the client's methods take, before any other library code reads it.

One entry point per method (:func:`tokenize`, :func:`chat` for ``render``,
:func:`record` and :func:`records`/:func:`record_item` for ``record_outputs``,
:func:`model_name`, :func:`timeout`); each raises
:class:`~sidecar_client.errors.InvalidArgumentError` whose ``field`` is the
path of the caller's own argument — ``messages[2].tool_calls[0].function``,
``chat_template_kwargs.enable_thinking``, ``records[3].stop_reason`` — never a
proto name. Nothing here converts (but for packing ids, which is their check):
``_core`` builds requests from arguments that passed, so a malformed one never
reaches protobuf, ``json`` or the result cache to come out as a raw TypeError.

The shapes are the OpenAI chat format as transformers and vLLM take it:

* a message is a mapping with str keys, a non-empty str ``role``, and
  ``content`` that is a str or a list of ``{"type": "text", "text": str}``
  parts — or None/absent for an assistant message only (one that carries tool
  calls); templates read the content of every other message and fail on it;
* a tool call is a mapping whose ``function`` is a mapping with a str ``name``
  and ``arguments`` (a JSON str, or a mapping as transformers allows); ``id``
  and ``type`` are str when given;
* ``tools``, ``chat_template_kwargs``, argument mappings and a message's extra
  keys are JSON: dicts with str keys, lists, tuples, str, int, float, bool and
  None, no cycles, nested at most :data:`MAX_JSON_DEPTH` deep (the sidecar's
  limit) — ``json.dumps`` would turn a key ``1`` into ``"1"`` silently;
* flags are ``bool`` (``"no"`` is not False), token ids are ints in
  ``[0, 2**32)``, a timeout is a finite, non-negative number of seconds.

Every str (text, content, names, keys, salt) must encode to UTF-8: a lone
surrogate (``"\\ud800"``, what a bad JSON escape decodes to) cannot, and the
error gives its index. An ASCII str is checked in O(1); others cost one UTF-8
encode (~0.6 µs per KB).
"""

from __future__ import annotations

import math
import reprlib
from array import array
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from numbers import Integral
from typing import Any, NoReturn

from sidecar_client.errors import InvalidArgumentError
from tokcache.ids import le_bytes

__all__ = ["MAX_JSON_DEPTH", "MODES", "RECORD_FIELDS", "TYPED_MESSAGE_KEYS", "chat", "json_value", "key_path",
           "model_name", "record", "record_here", "record_item", "record_options", "record_prompt", "records",
           "string", "timeout", "token_ids", "tokenize"]

MODES = ("kv-stable", "exact")
# sidecar/wire.py MAX_JSON_DEPTH, counted the same way: the top-level JSON value is depth 1.
MAX_JSON_DEPTH = 64
# An int json.dumps writes is at most this long: str(int) refuses ~4300 digits by default.
_MAX_JSON_INT_BITS = 10_000
# record_output's keyword arguments, as keys of a record_outputs item; the first four are required.
RECORD_FIELDS = ("prompt_text", "prompt_token_ids", "output_text", "output_token_ids", "finish_reason",
                 "stop_reason", "cache_salt", "prompt_add_special_tokens")
_RECORD_DEFAULTS: dict[str, Any] = {"finish_reason": "stop", "stop_reason": None, "cache_salt": None,
                                    "prompt_add_special_tokens": False}
# Message keys with a typed proto field; the others travel as one JSON object (extra_json).
TYPED_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"})
_MAX_ID = 2**32
_NOT_A_LIST = (str, bytes, bytearray, memoryview)

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60


def _bad(field: str, message: str) -> NoReturn:
    raise InvalidArgumentError(f"{field}: {message}", field=field)


def _kind(value: object) -> str:
    cls = type(value)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def key_path(base: str, key: str) -> str:
    """``base.key``, or ``base['key']`` when the key is not an identifier."""
    return f"{base}.{key}" if key.isidentifier() else f"{base}[{key!r}]"


# --------------------------------------------------------------------------- scalars


def string(value: object, field: str) -> str:
    """``value`` if it is a str that encodes to UTF-8 (no lone surrogate)."""
    if not isinstance(value, str):
        _bad(field, f"expected str, got {_kind(value)}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            _bad(field, f"not valid Unicode: lone surrogate {value[exc.start]!r} at index {exc.start}")
    return value


def _optional_string(value: object, field: str) -> None:
    if value is not None:
        string(value, field)


def _flag(value: object, field: str, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        _bad(field, f"expected {'True, False or None' if optional else 'True or False'}, got {_kind(value)}")


def model_name(value: object) -> None:
    """``model``: a non-empty str."""
    if not string(value, "model"):
        _bad("model", "is required (a non-empty str)")


def timeout(value: object) -> None:
    """``timeout``: seconds (int or float, finite, not negative), or None for the client's default."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _bad("timeout", f"expected seconds (int or float) or None, got {_kind(value)}")
    if not math.isfinite(value) or value < 0:
        _bad("timeout", f"expected a finite number of seconds >= 0, got {_short.repr(value)}")


def token_ids(value: object, field: str) -> bytes:
    """Ids as packed little-endian uint32, checked by packing them (one C pass, no Python loop).

    ``True``/``False`` items pass as 1/0: telling them apart would cost a Python
    pass over every id, and the sidecar refuses ids that do not decode to the text.
    """
    if isinstance(value, (*_NOT_A_LIST, Mapping, AbstractSet)) \
            or not (isinstance(value, Sequence) or hasattr(value, "__array__")):
        _bad(field, f"expected a list of token ids (ints in [0, 2**32)), got {_kind(value)}")
    try:
        return le_bytes(array("I", value))  # type: ignore[call-overload]
    except (OverflowError, TypeError, ValueError):
        pass
    assert isinstance(value, Iterable)
    for i, item in enumerate(value):  # the error path only: find the id to name
        if isinstance(item, float) or not hasattr(item, "__index__") or not 0 <= item.__index__() < _MAX_ID:
            _bad(f"{field}[{i}]", f"expected a token id (an int in [0, 2**32)), got {_short.repr(item)}")
    _bad(field, "expected a list of token ids (ints in [0, 2**32))")


# --------------------------------------------------------------------------- JSON values


def json_value(value: object, field: str, depth: int = 1) -> None:
    """``value`` is JSON that ``json.dumps`` writes faithfully and the sidecar reads back.

    ``depth`` is the value's depth in the document the sidecar parses (1 = top level).
    """
    _json(value, field, depth, set())


def _json(value: object, field: str, depth: int, open_: set[int]) -> None:
    if value is None or isinstance(value, (bool, float)):
        return
    if isinstance(value, int):
        if value.bit_length() > _MAX_JSON_INT_BITS:
            _bad(field, f"int of {value.bit_length()} bits is too large to write as JSON")
        return
    if isinstance(value, str):
        string(value, field)
        return
    if not isinstance(value, (dict, list, tuple)):
        _bad(field, f"{_kind(value)} is not JSON (expected dict, list, str, int, float, bool or None)")
    if depth > MAX_JSON_DEPTH:
        _bad(field, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    if id(value) in open_:
        _bad(field, "contains itself (a circular reference)")
    open_.add(id(value))
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                _bad(field, f"key {_short.repr(key)} is not a str")
            string(key, field)
            _json(item, key_path(field, key), depth + 1, open_)
    else:
        for j, item in enumerate(value):
            _json(item, f"{field}[{j}]", depth + 1, open_)
    open_.discard(id(value))


def _json_members(value: Mapping[Any, Any], field: str) -> None:
    """A mapping sent as one JSON object: str keys, JSON values at depth 2."""
    _str_keys(value, field)
    for key, item in value.items():
        json_value(item, key_path(field, key), 2)


def _str_keys(value: Mapping[Any, Any], field: str) -> None:
    for key in value:
        if not isinstance(key, str):
            _bad(field, f"key {_short.repr(key)} is not a str")
        string(key, field)


def _list(value: object, field: str, what: str) -> Sequence[Any]:
    if isinstance(value, _NOT_A_LIST) or not isinstance(value, Sequence):
        _bad(field, f"expected a list of {what}, got {_kind(value)}")
    return value


# --------------------------------------------------------------------------- chat


def _content(value: object, role: str, field: str) -> None:
    if value is None:
        if role != "assistant":
            _bad(field, f"is required for role {_short.repr(role)} (a str or a list of text parts); "
                        "only an assistant message may go without")
        return
    if isinstance(value, str):
        string(value, field)
        return
    if isinstance(value, _NOT_A_LIST) or not isinstance(value, Sequence):
        _bad(field, f"expected a str, a list of text parts or None, got {_kind(value)}")
    for j, part in enumerate(value):
        where = f"{field}[{j}]"
        if not isinstance(part, Mapping):
            _bad(where, f"expected {{'type': 'text', 'text': str}}, got {_kind(part)}")
        _str_keys(part, where)
        kind = part.get("type")
        if kind != "text":
            _bad(f"{where}.type", f"unsupported content part type {_short.repr(kind)} (only 'text')")
        if "text" not in part:
            _bad(f"{where}.text", "is required")
        string(part["text"], f"{where}.text")


def _tool_call(call: object, field: str) -> None:
    if not isinstance(call, Mapping):
        _bad(field, f"expected a mapping with a 'function', got {_kind(call)}")
    _str_keys(call, field)
    _optional_string(call.get("id"), f"{field}.id")
    _optional_string(call.get("type"), f"{field}.type")
    where = f"{field}.function"
    fn = call.get("function")
    if fn is None:
        _bad(where, "is required (a mapping with 'name' and 'arguments')")
    if not isinstance(fn, Mapping):
        _bad(where, f"expected a mapping with 'name' and 'arguments', got {_kind(fn)}")
    _str_keys(fn, where)
    if "name" not in fn:
        _bad(f"{where}.name", "is required")
    string(fn["name"], f"{where}.name")
    args = fn.get("arguments")
    if args is None:
        _bad(f"{where}.arguments", "is required (a JSON str, or a mapping)")
    if isinstance(args, str):
        string(args, f"{where}.arguments")
    elif isinstance(args, Mapping):
        _json_members(args, f"{where}.arguments")
    else:
        _bad(f"{where}.arguments", f"expected a JSON str or a mapping, got {_kind(args)}")


def _message(m: object, field: str) -> None:
    if not isinstance(m, Mapping):
        _bad(field, f"expected a mapping (a message), got {_kind(m)}")
    _str_keys(m, field)
    if "role" not in m:
        _bad(f"{field}.role", "is required")
    role = string(m["role"], f"{field}.role")
    if not role:
        _bad(f"{field}.role", "must not be empty")
    _content(m.get("content"), role, f"{field}.content")
    for key in ("name", "tool_call_id", "reasoning_content"):
        _optional_string(m.get(key), f"{field}.{key}")
    calls = m.get("tool_calls")
    if calls is not None:
        for j, call in enumerate(_list(calls, f"{field}.tool_calls", "tool calls")):
            _tool_call(call, f"{field}.tool_calls[{j}]")
    for key, value in m.items():
        if key not in TYPED_MESSAGE_KEYS:
            json_value(value, key_path(field, key), 2)


def _chat_options(*, tools: object, add_generation_prompt: object, continue_final_message: object,
                  chat_template_kwargs: object) -> None:
    if tools is not None:
        for i, tool in enumerate(_list(tools, "tools", "tool schemas (dicts)")):
            if not isinstance(tool, dict):
                _bad(f"tools[{i}]", f"expected a JSON object (dict), got {_kind(tool)}")
            json_value(tool, f"tools[{i}]", 2)
    _flag(add_generation_prompt, "add_generation_prompt")
    _flag(continue_final_message, "continue_final_message")
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, Mapping):
            _bad("chat_template_kwargs", f"expected a mapping of template variables, got "
                                         f"{_kind(chat_template_kwargs)}")
        _json_members(chat_template_kwargs, "chat_template_kwargs")


def chat(messages: object, *, tools: object, add_generation_prompt: object, continue_final_message: object,
         chat_template_kwargs: object) -> None:
    """The chat arguments of ``render`` and ``tokenize``."""
    seq = _list(messages, "messages", "message mappings")
    if not seq:
        _bad("messages", "must not be empty")
    for i, m in enumerate(seq):
        _message(m, f"messages[{i}]")
    _chat_options(tools=tools, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)


def tokenize(model: object, *, text: object, messages: object, tools: object, add_generation_prompt: object,
             continue_final_message: object, chat_template_kwargs: object, add_special_tokens: object,
             cache_salt: object, mode: object, return_prompt_text: object, text_unicode: bool = True) -> None:
    """Every argument of ``tokenize`` but ``timeout``. The chat options are checked with
    text input too: they are not sent then, but a malformed one is still a mistake.

    ``text_unicode=False`` skips looking for lone surrogates in ``text`` (only its type
    is checked): for the in-process path, which encodes the text anyway and reports one
    the same way — encoding a long prompt twice costs ~0.6 µs per KB.
    """
    model_name(model)
    if text is None and messages is None:
        _bad("text", "give text or messages")
    if text is not None and messages is not None:
        _bad("messages", "give text or messages, not both")
    if text is not None:
        if text_unicode:
            string(text, "text")
        elif not isinstance(text, str):
            _bad("text", f"expected str, got {_kind(text)}")
    else:
        seq = _list(messages, "messages", "message mappings")
        if not seq:
            _bad("messages", "must not be empty")
        for i, m in enumerate(seq):
            _message(m, f"messages[{i}]")
    _chat_options(tools=tools, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)
    _flag(add_special_tokens, "add_special_tokens", optional=True)
    _optional_string(cache_salt, "cache_salt")
    if mode is not None and not (isinstance(mode, str) and mode in MODES):
        _bad("mode", f"expected 'kv-stable', 'exact' or None, got {_short.repr(mode)}")
    _flag(return_prompt_text, "return_prompt_text")


# --------------------------------------------------------------------------- records


def record(model: object, *, prompt_text: object, prompt_token_ids: object, output_text: object,
           output_token_ids: object, finish_reason: object, stop_reason: object, cache_salt: object,
           prompt_add_special_tokens: object, where: str = "") -> tuple[bytes, bytes]:
    """Every argument of ``record_output`` but ``timeout``; returns the two id lists packed.

    ``where`` prefixes the fields of a ``record_outputs`` item (``"records[3]."``).
    """
    model_name(model)
    string(prompt_text, f"{where}prompt_text")
    prompt_ids = token_ids(prompt_token_ids, f"{where}prompt_token_ids")
    string(output_text, f"{where}output_text")
    output_ids = token_ids(output_token_ids, f"{where}output_token_ids")
    record_options(finish_reason=finish_reason, stop_reason=stop_reason, cache_salt=cache_salt,
                   prompt_add_special_tokens=prompt_add_special_tokens, where=where)
    return prompt_ids, output_ids


def record_here(model: object, *, prompt_text: object, prompt_token_ids: object, output_text: object,
                output_token_ids: object, finish_reason: object, stop_reason: object, cache_salt: object,
                prompt_add_special_tokens: object, where: str = "") -> list[int]:
    """:func:`record` for a record stored in this process: the same checks, but the prompt's
    text and ids are only checked for their kinds here (the recorder compares them with what
    was served, and names ``prompt_text`` / ``prompt_token_ids`` when they are bad). Returns
    the output ids as a list of ints."""
    model_name(model)
    if not isinstance(prompt_text, str):
        _bad(f"{where}prompt_text", f"expected a str, got {_kind(prompt_text)}")
    if isinstance(prompt_token_ids, (*_NOT_A_LIST, Mapping, AbstractSet)) or not (
            isinstance(prompt_token_ids, Sequence) or hasattr(prompt_token_ids, "__array__")):
        _bad(f"{where}prompt_token_ids",
             f"expected a list of token ids (ints in [0, 2**32)), got {_kind(prompt_token_ids)}")
    string(output_text, f"{where}output_text")
    packed = token_ids(output_token_ids, f"{where}output_token_ids")
    record_options(finish_reason=finish_reason, stop_reason=stop_reason, cache_salt=cache_salt,
                   prompt_add_special_tokens=prompt_add_special_tokens, where=where)
    return array("I", packed).tolist()


def record_prompt(prompt_text: object, prompt_token_ids: object, where: str = "") -> None:
    """The prompt's text and ids checked in full, as :func:`record` checks them (a C pass over
    the ids): what :func:`record_here` leaves to the recorder."""
    string(prompt_text, f"{where}prompt_text")
    token_ids(prompt_token_ids, f"{where}prompt_token_ids")


def record_options(*, finish_reason: object, stop_reason: object, cache_salt: object,
                   prompt_add_special_tokens: object, where: str = "") -> None:
    """The options of a record (see :func:`record`)."""
    _optional_string(finish_reason, f"{where}finish_reason")
    field = f"{where}stop_reason"
    if isinstance(stop_reason, bool) or not (stop_reason is None or isinstance(stop_reason, (Integral, str))):
        _bad(field, f"expected a stop token id (int), a stop string or None, got {_kind(stop_reason)}")
    if isinstance(stop_reason, Integral) and not 0 <= int(stop_reason) < _MAX_ID:
        _bad(field, f"token id {_short.repr(stop_reason)} is not in [0, 2**32)")
    if isinstance(stop_reason, str):
        string(stop_reason, field)
    _optional_string(cache_salt, f"{where}cache_salt")
    _flag(prompt_add_special_tokens, f"{where}prompt_add_special_tokens")


def records(value: object) -> Iterable[Any]:
    """``record_outputs``' ``records``: an iterable (list, generator…) of mappings, in order."""
    if isinstance(value, (*_NOT_A_LIST, Mapping, AbstractSet)) or not isinstance(value, Iterable):
        _bad("records", f"expected an iterable of record mappings, got {_kind(value)}")
    return value


def record_item(item: object, field: str) -> dict[str, Any]:
    """One ``record_outputs`` item (``field`` is its path, ``records[3]``): a mapping of
    record_output keyword arguments, the four without defaults required. Returns them,
    defaults filled; their values are checked by :func:`record`."""
    if not isinstance(item, Mapping):
        _bad(field, f"expected a mapping of record_output arguments, got {_kind(item)}")
    _str_keys(item, field)
    for key in item:
        if key not in RECORD_FIELDS:
            _bad(key_path(field, key), f"is not a record field (expected one of {', '.join(RECORD_FIELDS)})")
    for key in RECORD_FIELDS[:4]:
        if key not in item:
            _bad(f"{field}.{key}", "is required")
    return {**_RECORD_DEFAULTS, **item}
