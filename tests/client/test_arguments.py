"""The client's argument checking: a malformed argument is an InvalidArgumentError naming it.

Properties, for ``tokenize``, ``render``, ``record_output`` and ``record_outputs``,
on the request builders alone (many examples) and on the sync and the async
client against a real sidecar:

* **one defect** injected into well-formed arguments — a wrong type, a lone
  surrogate at a random index, a missing key, a non-str key, nested garbage, a
  cycle, an id out of range — is refused before anything is sent (``.code`` is
  None) with ``.field`` exactly the path of the defect in the caller's own
  arguments (``messages[1].tool_calls[0].function.arguments.k``);
* **garbage** anywhere gives only InvalidArgumentError, whose field resolves
  into the caller's arguments, or — when the garbage happens to be well-formed —
  a normal result (or a refusal by the sidecar, naming a field the same way).

Then named examples of each kind of malformed argument, and what the sidecar
answers a raw gRPC client that sends the same shapes.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import inspect
import math
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import sidecar_client
from sidecar_client import (
    AsyncSidecarClient,
    InvalidArgumentError,
    RecordResult,
    RecordSummary,
    SidecarClient,
    TokenizeResult,
    UnknownModelError,
    _core,
)
from sidecar_client._validate import MAX_JSON_DEPTH, MODES, RECORD_FIELDS
from sidecar_client.errors import DeadlineExceeded, from_status
from tests.integration.sidecar_proc import SidecarProcess
from tokcache.v1 import tokenizer_pb2 as pb
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc

MODEL = "qwen3"
METHODS = ("tokenize", "render", "record_output", "record_outputs")
TOOL = {"type": "function", "function": {"name": "ls", "description": "list files",
                                         "parameters": {"type": "object", "properties": {}}}}
HOOK = ("needs _sync.py/_async.py to call the _core hook (not this change's files): "
        "_core.check_timeout / build_render / build_records")


# --------------------------------------------------------------------------- field paths

_NAME = re.compile(r"[A-Za-z_]\w*")
# ``.name`` for a key that is an identifier (str.isidentifier: ``A·`` is one, though ``\w``
# stops at its middle dot), else ``['key']``.
_STEP = re.compile(r"""\.([^.\[\]]+)|\[(\d+)\]|\[('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\]""")


def resolves(field: str | None, args: Mapping[str, Any]) -> bool:
    """``field`` is a path into the caller's arguments: every step exists but the last,
    which may be missing (``messages[0].role`` of a message without one)."""
    if field is None or (root := _NAME.match(field)) is None or root.group() not in args:
        return False
    value: Any = args[root.group()]
    pos = root.end()
    while pos < len(field):
        step = _STEP.match(field, pos)
        if step is None or (step.group(1) is not None and not step.group(1).isidentifier()):
            return False
        pos = step.end()
        last = pos == len(field)
        if step.group(2) is not None:
            index = int(step.group(2))
            if not isinstance(value, (list, tuple)) or index >= len(value):
                return last and isinstance(value, (list, tuple))
            value = value[index]
        else:
            key = step.group(1) if step.group(1) is not None else ast.literal_eval(step.group(3))
            if not isinstance(value, Mapping) or key not in value:
                return last and isinstance(value, Mapping)
            value = value[key]
    return True


def test_resolves() -> None:
    args = {"messages": [{"role": "user", "tool_calls": [{"function": {"a b": 1}}]}], "text": None}
    assert resolves("messages", args) and resolves("text", args) and resolves("messages[0].content", args)
    assert resolves("messages[0].tool_calls[0].function['a b']", args)
    assert not resolves("chat.messages[0]", args) and not resolves("messages[1].role", args)
    assert not resolves("messages[0].nope.role", args) and not resolves("stop_string", args)
    assert resolves("messages[0].A·", {"messages": [{"A·": 1}]}) and not resolves("messages[0].a b", args)


def _params(method: str) -> dict[str, Any]:
    """The method's parameters with their defaults (what the caller passed, unpassed ones too)."""
    sig = inspect.signature(getattr(SidecarClient, method))
    return {name: p.default for name, p in sig.parameters.items()
            if name != "self" and p.default is not inspect.Parameter.empty}


def _all_args(method: str, args: Mapping[str, Any]) -> dict[str, Any]:
    return {**_params(method), **args}


# --------------------------------------------------------------------------- well-formed arguments

words = st.text(max_size=12)
names = st.text(st.characters(codec="ascii", categories=["L"]), min_size=1, max_size=8)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                                st.dictionaries(st.text(max_size=6), kids, max_size=3)),
                           max_leaves=6)


@st.composite
def with_surrogate(draw: st.DrawFn) -> str:
    """A str with one lone surrogate at a random index."""
    s = draw(st.text(max_size=12))
    i = draw(st.integers(0, len(s)))
    return s[:i] + chr(draw(st.integers(0xD800, 0xDFFF))) + s[i:]


@st.composite
def messages(draw: st.DrawFn) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 4))):
        role = draw(st.sampled_from(["system", "user", "user", "assistant", "tool"]))
        m: dict[str, Any] = {"role": role}
        if draw(st.integers(0, 3)) == 0:
            m["content"] = [{"type": "text", "text": draw(words)} for _ in range(draw(st.integers(0, 2)))]
        else:
            m["content"] = draw(words)
        if role == "assistant" and draw(st.integers(0, 2)) == 0:
            args = draw(st.one_of(st.just("{}"), st.dictionaries(names, json_values, max_size=2)))
            m["tool_calls"] = [{"id": "c1", "type": "function", "function": {"name": draw(names), "arguments": args}}]
            if draw(st.booleans()):
                m["content"] = None
        if draw(st.integers(0, 5)) == 0:
            m["name"] = draw(names)
        if draw(st.integers(0, 5)) == 0:
            m["x_extra"] = draw(json_values)
        out.append(m)
    return out


@st.composite
def _chat_options(draw: st.DrawFn, args: dict[str, Any]) -> None:
    if draw(st.integers(0, 3)) == 0:
        args["tools"] = [copy.deepcopy(TOOL)]
    if draw(st.booleans()):
        args["add_generation_prompt"] = True
    if draw(st.integers(0, 3)) == 0:
        args["chat_template_kwargs"] = {"enable_thinking": draw(st.booleans()), "x": draw(json_values)}


@st.composite
def good_args(draw: st.DrawFn, method: str) -> dict[str, Any]:
    """Well-formed arguments of ``method`` (the sidecar may still refuse them: a template
    may reject a conversation, a record may not verify)."""
    args: dict[str, Any] = {"model": MODEL}
    if method == "tokenize":
        if draw(st.booleans()):
            args["text"] = draw(words)
        else:
            args["messages"] = draw(messages())
            draw(_chat_options(args))
        for key, strategy in (("add_special_tokens", st.sampled_from([None, True, False])),
                              ("cache_salt", st.one_of(st.none(), words)), ("mode", st.sampled_from([None, *MODES])),
                              ("return_prompt_text", st.booleans())):
            if draw(st.booleans()):
                args[key] = draw(strategy)
    elif method == "render":
        args["messages"] = draw(messages())
        draw(_chat_options(args))
    else:
        records = [draw(_record()) for _ in range(draw(st.integers(1, 3)))]
        if method == "record_output":
            args.update(records[0])
        else:
            args["records"] = records
    return args


@st.composite
def _record(draw: st.DrawFn) -> dict[str, Any]:
    ids = st.lists(st.integers(0, 150_000), max_size=4)
    r: dict[str, Any] = {"prompt_text": draw(words), "prompt_token_ids": draw(ids), "output_text": draw(words),
                         "output_token_ids": draw(ids)}
    for key, strategy in (("finish_reason", st.sampled_from([None, "stop", "length"])),
                          ("stop_reason", st.one_of(st.none(), st.integers(0, 2**32 - 1), words)),
                          ("cache_salt", st.one_of(st.none(), words)), ("prompt_add_special_tokens", st.booleans())):
        if draw(st.booleans()):
            r[key] = draw(strategy)
    return r


# --------------------------------------------------------------------------- slots and defects


@dataclass
class Slot:
    """A place in the arguments: ``parent[key]``, named ``path``; ``kind`` says what is wrong there."""

    path: str
    parent: Any
    key: Any
    kind: str
    role: str | None = None


def _key_path(base: str, key: str) -> str:
    return f"{base}.{key}" if key.isidentifier() else f"{base}[{key!r}]"


def _json_slots(value: Any, path: str, parent: Any, key: Any, out: list[Slot]) -> None:
    out.append(Slot(path, parent, key, "json"))
    if isinstance(value, dict):
        out.append(Slot(path, value, None, "newkey"))
        for k, v in value.items():
            _json_slots(v, _key_path(path, k), value, k, out)
    elif isinstance(value, list):
        for j, v in enumerate(value):
            _json_slots(v, f"{path}[{j}]", value, j, out)


def _message_slots(m: dict[str, Any], path: str, out: list[Slot]) -> None:
    role = m["role"]
    out += [Slot(f"{path}.role", m, "role", "role"), Slot(path, m, None, "newkey"),
            Slot(f"{path}.content", m, "content", "content", role)]
    content = m.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            where = f"{path}.content[{j}]"
            out += [Slot(where, content, j, "part"), Slot(f"{where}.type", part, "type", "part_type"),
                    Slot(f"{where}.text", part, "text", "required_str"), Slot(where, part, None, "newkey")]
    for key in ("name", "tool_call_id", "reasoning_content"):
        out.append(Slot(f"{path}.{key}", m, key, "opt_str"))
    out.append(Slot(f"{path}.tool_calls", m, "tool_calls", "tool_calls"))
    for j, call in enumerate(m.get("tool_calls") or ()):
        where = f"{path}.tool_calls[{j}]"
        fn = call["function"]
        out += [Slot(where, m["tool_calls"], j, "mapping"), Slot(where, call, None, "newkey"),
                Slot(f"{where}.id", call, "id", "opt_str"), Slot(f"{where}.type", call, "type", "opt_str"),
                Slot(f"{where}.function", call, "function", "function"),
                Slot(f"{where}.function", fn, None, "newkey"),
                Slot(f"{where}.function.name", fn, "name", "required_str"),
                Slot(f"{where}.function.arguments", fn, "arguments", "arguments")]
        if isinstance(fn["arguments"], dict):
            out.append(Slot(f"{where}.function.arguments", fn["arguments"], None, "newkey"))
            for k, v in fn["arguments"].items():
                _json_slots(v, _key_path(f"{where}.function.arguments", k), fn["arguments"], k, out)
    for key, value in m.items():
        if key not in ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"):
            _json_slots(value, _key_path(path, key), m, key, out)


def _record_slots(r: dict[str, Any], prefix: str, out: list[Slot]) -> None:
    out += [Slot(f"{prefix}prompt_text", r, "prompt_text", "required_str"),
            Slot(f"{prefix}output_text", r, "output_text", "required_str"),
            Slot(f"{prefix}prompt_token_ids", r, "prompt_token_ids", "ids"),
            Slot(f"{prefix}output_token_ids", r, "output_token_ids", "ids"),
            Slot(f"{prefix}finish_reason", r, "finish_reason", "opt_str"),
            Slot(f"{prefix}stop_reason", r, "stop_reason", "stop_reason"),
            Slot(f"{prefix}cache_salt", r, "cache_salt", "opt_str"),
            Slot(f"{prefix}prompt_add_special_tokens", r, "prompt_add_special_tokens", "flag")]


def slots(method: str, args: dict[str, Any], *, client_hooks: bool = True) -> list[Slot]:
    """Every place of ``args`` a defect can go, with the field it must then be named by.

    ``client_hooks=False`` leaves out what the clients cannot check yet (:data:`HOOK`).
    """
    out: list[Slot] = []
    if "text" in args:
        out.append(Slot("text", args, "text", "required_str"))
    if "messages" in args:
        out.append(Slot("messages", args, "messages", "messages"))
        for i, m in enumerate(args["messages"]):
            out.append(Slot(f"messages[{i}]", args["messages"], i, "mapping"))
            _message_slots(m, f"messages[{i}]", out)
    if method in ("tokenize", "render"):
        out += [Slot("tools", args, "tools", "tools"),
                Slot("chat_template_kwargs", args, "chat_template_kwargs", "kwargs"),
                Slot("add_generation_prompt", args, "add_generation_prompt", "flag"),
                Slot("continue_final_message", args, "continue_final_message", "flag")]
        for i, tool in enumerate(args.get("tools") or ()):
            out.append(Slot(f"tools[{i}]", args["tools"], i, "tool"))
            for k, v in tool.items():
                _json_slots(v, _key_path(f"tools[{i}]", k), tool, k, out)
        if isinstance(args.get("chat_template_kwargs"), dict):
            out.append(Slot("chat_template_kwargs", args["chat_template_kwargs"], None, "newkey"))
            for k, v in args["chat_template_kwargs"].items():
                _json_slots(v, _key_path("chat_template_kwargs", k), args["chat_template_kwargs"], k, out)
    if method == "tokenize":
        out += [Slot("add_special_tokens", args, "add_special_tokens", "opt_flag"),
                Slot("cache_salt", args, "cache_salt", "opt_str"), Slot("mode", args, "mode", "mode"),
                Slot("return_prompt_text", args, "return_prompt_text", "flag")]
    if method == "record_output":
        _record_slots(args, "", out)
    if method == "record_outputs":
        if client_hooks:
            out.append(Slot("records", args, "records", "records"))
        for i, r in enumerate(args["records"]):
            where = f"records[{i}]"
            out += [Slot(where, args["records"], i, "mapping"), Slot(where, r, None, "newkey"),
                    Slot(where, r, None, "record_key")]
            _record_slots(r, f"{where}.", out)
    # Last: hypothesis draws the first entries of a list more often.
    if method != "render" or client_hooks:
        out.append(Slot("model", args, "model", "model"))
    if client_hooks:
        out.append(Slot("timeout", args, "timeout", "timeout"))
    return out


_DELETE = object()
_NOT_STR = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.binary(max_size=4),
                     st.lists(st.text(max_size=2), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(),
                                                                                max_size=1),
                     st.builds(object), st.frozensets(st.integers(), max_size=2))
_NOT_LIST = st.one_of(st.text(max_size=3), st.binary(max_size=3), st.integers(), st.dictionaries(
    st.text(max_size=2), st.integers(), max_size=2), st.frozensets(st.integers(), max_size=2), st.builds(object))
_NOT_MAPPING = st.one_of(st.none(), st.text(max_size=3), st.integers(), st.lists(st.integers(), max_size=2),
                         st.binary(max_size=2))
_BAD_KEYS = st.one_of(st.integers(), st.none(), st.booleans(), st.tuples(st.integers()), st.binary(max_size=2),
                      with_surrogate())


def _deep(n: int) -> Any:
    value: Any = 0
    for _ in range(n):
        value = [value]
    return value


def _cycle() -> Any:
    loop: list[Any] = []
    loop.append(loop)
    return loop


_BAD_JSON = st.one_of(st.builds(object), st.binary(max_size=3), st.frozensets(st.integers(), max_size=2),
                      st.sets(st.integers(), max_size=2), st.complex_numbers(), with_surrogate(),
                      st.dictionaries(_BAD_KEYS, json_values, min_size=1, max_size=2),
                      st.just("<deep>"), st.just("<cycle>"), st.integers(2**10_001, 2**10_002))


@st.composite
def inject(draw: st.DrawFn, method: str, *, client_hooks: bool = True) -> tuple[dict[str, Any], str, bool]:
    """Well-formed arguments with one defect: (args, the field that must be named, exactly?)."""
    args = draw(good_args(method))
    slot = draw(st.sampled_from(slots(method, args, client_hooks=client_hooks)))
    field, exact = slot.path, True
    kind = slot.kind
    value: Any
    if kind == "newkey":
        slot.parent[draw(_BAD_KEYS)] = "x"
        return args, field, exact
    if kind == "record_key":
        if draw(st.booleans()):
            key = draw(st.sampled_from(RECORD_FIELDS[:4]))
            del slot.parent[key]
        else:
            key = draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in RECORD_FIELDS))
            slot.parent[key] = 1
        return args, _key_path(field, key), exact
    if kind == "model":
        value = draw(st.one_of(_NOT_STR, with_surrogate(), st.just("")))
    elif kind == "timeout":
        value = draw(st.sampled_from([math.nan, math.inf, -math.inf, -1, -0.5, True, "1", b"1", [1]]))
    elif kind == "required_str":
        value = draw(st.one_of(_NOT_STR, with_surrogate(), st.just(_DELETE)))
        if value is _DELETE and slot.key in ("text", *RECORD_FIELDS):  # a parameter, not a key: always "passed"
            value = None
    elif kind == "role":
        value = draw(st.one_of(_NOT_STR, with_surrogate(), st.just(""), st.just(_DELETE)))
    elif kind == "opt_str":
        value = draw(st.one_of(_NOT_STR.filter(lambda v: v is not None), with_surrogate()))
    elif kind == "flag":
        value = draw(st.one_of(st.none(), st.integers(), st.text(max_size=3), st.floats(), st.lists(st.booleans(),
                                                                                                   max_size=1)))
    elif kind == "opt_flag":
        value = draw(st.one_of(st.integers(), st.text(max_size=3), st.floats(), st.lists(st.booleans(), max_size=1)))
    elif kind == "mode":
        value = draw(st.one_of(st.text(max_size=8).filter(lambda s: s not in MODES), st.integers(), with_surrogate(),
                               st.lists(st.text(max_size=2), max_size=1), st.binary(max_size=3)))
    elif kind == "messages":
        value = draw(st.one_of(_NOT_LIST, st.just([])))
    elif kind in ("mapping", "part"):
        value = draw(_NOT_MAPPING)
    elif kind == "content":
        bad = [st.integers(), st.floats(), st.binary(max_size=2), st.dictionaries(st.text(max_size=2), words,
                                                                                  max_size=1), with_surrogate()]
        if slot.role != "assistant":
            bad += [st.none(), st.just(_DELETE)]
        value = draw(st.one_of(bad))
    elif kind == "part_type":
        value = draw(st.one_of(st.sampled_from(["image_url", "", "Text", None, _DELETE]), st.integers()))
    elif kind == "tool_calls":
        value = draw(_NOT_LIST)
    elif kind == "function":
        value = draw(st.one_of(st.just(_DELETE), st.none(), _NOT_LIST.filter(lambda v: not isinstance(v, dict))))
    elif kind == "arguments":
        value = draw(st.one_of(st.just(_DELETE), st.none(), st.integers(), st.lists(st.integers(), max_size=2),
                               st.binary(max_size=2), with_surrogate()))
    elif kind == "tools":
        value = draw(_NOT_LIST)
    elif kind == "tool":
        value = draw(st.one_of(_NOT_MAPPING, st.lists(json_values, max_size=2)))
    elif kind == "kwargs":
        value = draw(st.one_of(st.text(max_size=3), st.lists(st.integers(), max_size=2), st.integers(),
                               st.binary(max_size=2)))
    elif kind == "json":
        value = draw(_BAD_JSON)
        if value == "<deep>":
            value, exact = _deep(MAX_JSON_DEPTH + 1), False
        elif value == "<cycle>":
            value, field = _cycle(), f"{field}[0]"
    elif kind == "ids":
        if draw(st.booleans()):
            value = draw(st.one_of(st.text(max_size=3), st.binary(max_size=8), st.integers(), st.none(),
                                   st.dictionaries(st.integers(0, 5), st.integers(0, 5), max_size=2),
                                   st.frozensets(st.integers(0, 5), max_size=2)))
        else:
            value = list(slot.parent[slot.key]) + [1]
            i = draw(st.integers(0, len(value) - 1))
            value[i] = draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32), st.floats(),
                                      st.text(max_size=2), st.none(), st.lists(st.integers(0, 3), max_size=1)))
            field = f"{field}[{i}]"
    elif kind == "stop_reason":
        value = draw(st.one_of(st.booleans(), st.integers(max_value=-1), st.integers(min_value=2**32), st.floats(),
                               st.binary(max_size=2), st.lists(st.integers(0, 3), max_size=2), with_surrogate()))
    elif kind == "records":
        value = draw(st.one_of(st.integers(), st.none(), st.text(max_size=3), st.binary(max_size=2),
                               st.dictionaries(st.sampled_from(RECORD_FIELDS), st.integers(), max_size=2)))
    else:  # pragma: no cover
        raise AssertionError(kind)
    if value is _DELETE:
        slot.parent.pop(slot.key, None)
    else:
        slot.parent[slot.key] = value
    return args, field, exact


def _root(field: str | None) -> str | None:
    match = _NAME.match(field or "")
    return match.group() if match else None


def _check_refusal(exc: InvalidArgumentError, field: str, exact: bool) -> None:
    assert exc.code is None, f"sent before refusing: {exc}"  # raised before anything was sent
    assert exc.field == field if exact else (exc.field or "").startswith(field), (exc.field, field, str(exc))
    assert str(exc).startswith(f"{exc.field}: ")


# --------------------------------------------------------------------------- the builders (no sidecar)


def build(method: str, args: Mapping[str, Any]) -> Any:
    """What the clients do with ``args`` before sending (plus the hooks of :data:`HOOK`)."""
    full = _all_args(method, args)
    _core.check_timeout(full.pop("timeout", None))
    if method == "tokenize":
        return _core.build_tokenize(**full)
    if method == "render":
        return _core.build_render(**full)
    if method == "record_output":
        return _core.build_record(**full)
    return _core.build_records(full["model"], full["records"])


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=400, deadline=None, database=None)
@given(data=st.data())
def test_builders_name_the_one_defect(method: str, data: st.DataObject) -> None:
    args, field, exact = data.draw(inject(method))
    with pytest.raises(InvalidArgumentError) as exc:
        build(method, args)
    _check_refusal(exc.value, field, exact)
    assert resolves(exc.value.field, _all_args(method, args))


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=200, deadline=None, database=None)
@given(data=st.data())
def test_builders_accept_well_formed_arguments(method: str, data: st.DataObject) -> None:
    build(method, data.draw(good_args(method)))


_garbage = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**32), st.integers(max_value=-1),
              st.floats(), st.text(max_size=8), with_surrogate(), st.binary(max_size=6), st.builds(object),
              st.complex_numbers(), st.sampled_from(["user", "assistant", "text", "function", *MODES, MODEL])),
    lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.tuples(kids, kids), st.frozensets(st.integers(), max_size=2),
        st.dictionaries(st.one_of(st.sampled_from(["role", "content", "type", "text", "function", "name",
                                                   "arguments", "tool_calls", *RECORD_FIELDS]),
                                  st.text(max_size=5), st.integers(), with_surrogate()), kids, max_size=4)),
    max_leaves=12)


@st.composite
def garbled(draw: st.DrawFn, method: str, *, client_hooks: bool = True) -> dict[str, Any]:
    """Well-formed arguments with 1–3 places replaced by arbitrary values (maybe well-formed ones)."""
    args = draw(good_args(method))
    places = slots(method, args, client_hooks=client_hooks)  # of the good arguments (garbage has none)
    for _ in range(draw(st.integers(1, 3))):
        slot = draw(st.sampled_from(places))
        if slot.kind in ("newkey", "record_key"):
            slot.parent[draw(st.one_of(_BAD_KEYS, st.text(max_size=4)))] = draw(_garbage)
        else:
            slot.parent[slot.key] = draw(_garbage)
    return args


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data())
def test_builders_raise_nothing_but_invalid_argument(method: str, data: st.DataObject) -> None:
    args = data.draw(garbled(method))
    try:
        build(method, args)
    except InvalidArgumentError as exc:
        assert exc.code is None and resolves(exc.field, _all_args(method, args)), (exc.field, str(exc))


def test_timeouts() -> None:
    for good in (None, 0, 0.0, 1, 0.001, 30.0, 10**9):
        _core.check_timeout(good)
    for bad in (math.nan, math.inf, -math.inf, -1, -1e-9, True, False, "1", b"1", [1], 1j):
        with pytest.raises(InvalidArgumentError) as exc:
            _core.check_timeout(bad)  # type: ignore[arg-type]
        assert exc.value.field == "timeout"


def test_token_ids_name_the_bad_one() -> None:
    assert _core.pack_ids(range(3), "x") == b"\0\0\0\0\1\0\0\0\2\0\0\0"
    for ids, field in (([1, 2, -1], "ids[2]"), ([2**32], "ids[0]"), ([0, 1.0], "ids[1]"), (["1"], "ids[0]"),
                       ("123", "ids"), (b"\1\0\0\0", "ids"), ({1: 2}, "ids"), ({1}, "ids"), (None, "ids"), (7, "ids")):
        with pytest.raises(InvalidArgumentError) as exc:
            _core.pack_ids(ids, "ids")  # type: ignore[arg-type]
        assert exc.value.field == field, ids


def test_record_outputs_items_are_named_by_index() -> None:
    good = {"prompt_text": "p", "prompt_token_ids": [1], "output_text": "o", "output_token_ids": [2]}
    cases = [([good, 5], "records[1]"), ([good, {**good, "stop_reason": True}], "records[1].stop_reason"),
             ([{**good, "prompt_token_ids": [1, -2]}], "records[0].prompt_token_ids[1]"),
             ([{"prompt_text": "p"}], "records[0].prompt_token_ids"), ([{**good, "stop": 1}], "records[0].stop"),
             ([{**good, "x y": 1}], "records[0]['x y']"), (5, "records"), ("abc", "records"), (good, "records")]
    for records, field in cases:
        with pytest.raises(InvalidArgumentError) as exc:
            _core.build_records(MODEL, records)  # type: ignore[arg-type]
        assert exc.value.field == field, (records, str(exc.value))
    assert len(_core.build_records(MODEL, (dict(good) for _ in range(2)))) == 2
    # record_kwargs (the clients' path until they use build_records) names ``records``
    with pytest.raises(InvalidArgumentError) as exc:
        _core.record_kwargs({"prompt_text": "p"})
    assert exc.value.field == "records"


def test_proto_field_names_from_an_older_sidecar_are_renamed() -> None:
    for details, field in (("chat.messages[0].role: is required", "messages[0].role"),
                           ("chat.messages[2].extra_json: repeats typed fields ['role']", "messages[2]"),
                           ("chat.messages[1].tool_calls[0].function.arguments_json: invalid JSON",
                            "messages[1].tool_calls[0].function.arguments"),
                           ("chat.tools_json: invalid JSON", "tools"),
                           ("chat.chat_template_kwargs_json: expected a JSON object", "chat_template_kwargs"),
                           ("chat: the rendered prompt is not valid Unicode", "messages"),
                           ("stop_string: a finish by stop string is not recorded", "stop_reason"),
                           ("messages[0].content: 'dict object' has no attribute 'content'", "messages[0].content")):
        for exc in (InvalidArgumentError(details, grpc.StatusCode.INVALID_ARGUMENT),
                    from_status("INVALID_ARGUMENT", details)):
            assert isinstance(exc, InvalidArgumentError)
            assert exc.field == field and str(exc).startswith(f"{field}: ")
    assert InvalidArgumentError("Deadline passed: try again, later").field is None


# --------------------------------------------------------------------------- a real sidecar


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory, qwen3_path: Path) -> Iterator[SidecarProcess]:
    tmp = tmp_path_factory.mktemp("arguments")
    prefix = f"tkt-args-{uuid.uuid4().hex[:8]}"
    proc = SidecarProcess(tmp, {MODEL: qwen3_path}, prefix).start()
    yield proc
    code = proc.stop()
    for p in Path("/dev/shm").glob(f"*{prefix}*"):
        p.unlink()
    assert code == 0, proc.log()


Call = Callable[..., Any]


def _rpc_only(cls: type) -> dict[str, Any]:
    """Keyword arguments that keep ``cls`` on the RPC path: the in-process text path
    (``zero_rpc``, in progress in _sync.py/_async.py) does not check every argument yet."""
    return {"zero_rpc": False} if "zero_rpc" in inspect.signature(cls).parameters else {}


@pytest.fixture(scope="module", params=["sync", "async"])
def call(request: pytest.FixtureRequest, sidecar: SidecarProcess) -> Iterator[Call]:
    """``call(method, **args)`` on the sync or the async client (RPC path)."""
    if request.param == "sync":
        with SidecarClient(sidecar.address, **_rpc_only(SidecarClient)) as client:
            yield lambda method, **args: getattr(client, method)(**args)
        return
    loop = asyncio.new_event_loop()

    async def make() -> AsyncSidecarClient:
        return AsyncSidecarClient(sidecar.address, **_rpc_only(AsyncSidecarClient))

    aclient = loop.run_until_complete(make())
    yield lambda method, **args: loop.run_until_complete(getattr(aclient, method)(**args))
    loop.run_until_complete(aclient.close())
    loop.close()


RECORD_METHODS = ("record_output", "record_outputs")
# Each record the in-process path refuses runs its verification too: fewer examples than the RPC path's.
_LOCAL_SETTINGS = settings(max_examples=60, deadline=None, database=None,
                           suppress_health_check=[HealthCheck.too_slow])


def _left_to_verification(args: Mapping[str, Any], field: str) -> bool:
    """Whether the defect at ``field`` is in a prompt's contents (an id in prompt_token_ids, a
    prompt_text that is a str), which the in-process path looks at only when verifying."""
    if "prompt_token_ids[" in field:
        return True
    if not field.endswith("prompt_text"):
        return False
    record: Any = args
    if field.startswith("records["):
        records = args.get("records")
        if not isinstance(records, (list, tuple)):
            return False
        record = records[int(field[len("records["):field.index("]")])]
    return isinstance(record, Mapping) and isinstance(record.get("prompt_text"), str)


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


@pytest.fixture(scope="module", params=["sync", "async"])
def local_call(request: pytest.FixtureRequest, sidecar: SidecarProcess) -> Iterator[Call]:
    """``call(method, **args)`` on a default client whose model is open in this process with a
    writable mapping: its records are checked, verified and stored here, never sent."""
    if request.param == "sync":
        with SidecarClient(sidecar.address) as client:
            while client.tokenize(MODEL, text="open the segment").served_by != "local":
                pass
            assert client._local is not None and client._local.writes_directly(MODEL) is not None
            yield lambda method, **args: getattr(client, method)(**args)
        return
    loop = asyncio.new_event_loop()

    async def make() -> AsyncSidecarClient:
        aclient = AsyncSidecarClient(sidecar.address)
        while (await aclient.tokenize(MODEL, text="open the segment")).served_by != "local":
            await asyncio.sleep(0.01)
        return aclient

    aclient = loop.run_until_complete(make())
    assert aclient.local is not None and aclient.local.writes_directly(MODEL) is not None
    yield lambda method, **args: loop.run_until_complete(getattr(aclient, method)(**args))
    loop.run_until_complete(aclient.close())
    loop.close()


_RESULTS = {"tokenize": TokenizeResult, "render": str, "record_output": RecordResult,
            "record_outputs": RecordSummary}
_CLIENT_SETTINGS = settings(max_examples=120, deadline=None, database=None,
                            suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("method", METHODS)
@_CLIENT_SETTINGS
@given(data=st.data())
def test_client_names_the_one_defect(call: Call, method: str, data: st.DataObject) -> None:
    args, field, exact = data.draw(inject(method))
    with pytest.raises(InvalidArgumentError) as exc:
        call(method, **args)
    _check_refusal(exc.value, field, exact)


@pytest.mark.parametrize("method", METHODS)
@_CLIENT_SETTINGS
@given(data=st.data())
def test_client_raises_nothing_but_invalid_argument(call: Call, method: str, data: st.DataObject) -> None:
    args = data.draw(st.one_of(good_args(method), garbled(method)))
    try:
        result = call(method, **args)
    except InvalidArgumentError as exc:
        assert resolves(exc.field, _all_args(method, args)), (exc.field, str(exc))
    except UnknownModelError:
        assert isinstance(args["model"], str) and args["model"] != MODEL
    except DeadlineExceeded:
        # A well-formed timeout this short (garbling drew 0) may pass before any answer.
        t = args.get("timeout")
        assert isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < 1, t
    else:
        assert isinstance(result, _RESULTS[method])



@pytest.mark.parametrize("method", RECORD_METHODS)
@_LOCAL_SETTINGS
@given(data=st.data())
def test_local_records_name_the_one_defect(local_call: Call, method: str, data: st.DataObject) -> None:
    """Records checked in this process (its writer stores them) name the defect as the RPC path
    does. (A bad id in prompt_token_ids or a lone surrogate in prompt_text is left to
    test_local_records_check_the_prompt_first, a model that is not hashable to
    test_local_records_refuse_a_model_that_is_no_str.)"""
    args, field, exact = data.draw(inject(method))
    assume(not _left_to_verification(args, field) and _hashable(args.get("model")))
    with pytest.raises(InvalidArgumentError) as exc:
        local_call(method, **args)
    _check_refusal(exc.value, field, exact)


@pytest.mark.parametrize("method", RECORD_METHODS)
@_LOCAL_SETTINGS
@given(data=st.data())
def test_local_records_raise_nothing_but_invalid_argument(local_call: Call, method: str,
                                                          data: st.DataObject) -> None:
    """(A model that is not hashable is left to test_local_records_refuse_a_model_that_is_no_str.)"""
    args = data.draw(st.one_of(good_args(method), garbled(method)))
    assume(_hashable(args.get("model")))
    try:
        result = local_call(method, **args)
    except InvalidArgumentError as exc:
        assert resolves(exc.field, _all_args(method, args)), (exc.field, str(exc))
    except UnknownModelError:
        assert isinstance(args["model"], str) and args["model"] != MODEL
    else:
        assert isinstance(result, _RESULTS[method])


@pytest.mark.parametrize(("prompt", "field"), [({"prompt_token_ids": [-1]}, "prompt_token_ids[0]"),
                                                ({"prompt_token_ids": [1.5]}, "prompt_token_ids[0]"),
                                                ({"prompt_text": "\ud800"}, "prompt_text")],
                         ids=["negative-id", "float-id", "surrogate"])
def test_local_records_check_the_prompt_first(local_call: Call, prompt: dict[str, Any], field: str) -> None:
    """A bad id in prompt_token_ids or a lone surrogate in prompt_text is an argument error, named
    before the output is verified (here it does not spell its text either) and raised by
    record_outputs, on the RPC path; in this process too."""
    record = {"prompt_text": "p", "prompt_token_ids": [1], "output_text": "", "output_token_ids": [], **prompt}
    e = _refused(local_call, "record_output", model=MODEL, **record)
    assert (e.field, e.code) == (field, None), str(e)
    e = _refused(local_call, "record_outputs", model=MODEL, records=[{**record, "output_text": "hello",
                                                                       "output_token_ids": [14990]}])
    assert (e.field, e.code) == (f"records[0].{field}", None), str(e)


@pytest.mark.parametrize("model", [[], {"name": MODEL}])
def test_local_records_refuse_a_model_that_is_no_str(local_call: Call, model: Any) -> None:
    """A model that is no str is named, as the RPC path names it, not a TypeError from a lookup."""
    record = {"prompt_text": "p", "prompt_token_ids": [1], "output_text": "hello", "output_token_ids": [14990]}
    assert _refused(local_call, "record_output", model=model, **record).field == "model"
    assert _refused(local_call, "record_outputs", model=model, records=[record]).field == "model"


def test_local_and_sidecar_records_name_the_same_field(sidecar: SidecarProcess) -> None:
    """The same bad record, refused by this process's writer (``code`` None: nothing sent) and by
    the sidecar's RecordOutput (from a client that never maps the segment): the same field,
    for the arguments' checks and for verification (the output does not spell its text, an id
    outside the vocabulary, a stop string, prompt ids that are not the served ones)."""
    prompt = "<|im_start|>user\nname the field<|im_end|>\n<|im_start|>assistant\n"
    with SidecarClient(sidecar.address) as local, SidecarClient(sidecar.address, **_rpc_only(SidecarClient)) as rpc:
        while local.tokenize(MODEL, text="open the segment").served_by != "local":
            pass
        ids = {c: c.tokenize(MODEL, text=prompt, add_special_tokens=False).token_ids for c in (local, rpc)}
        cases: list[tuple[dict[str, Any], str]] = [
            ({"output_text": "goodbye"}, "output_token_ids"),
            ({"output_token_ids": [14990, 200_000]}, "output_token_ids"),
            ({"output_token_ids": [-1]}, "output_token_ids[0]"),
            ({"output_token_ids": []}, "output_token_ids"),
            ({"stop_reason": "</s>"}, "stop_reason"),
            ({"prompt_token_ids": [1, -1]}, "prompt_token_ids[1]"),
            ({"prompt_token_ids": "ids"}, "prompt_token_ids"),
            ({"prompt_token_ids": "cut"}, "prompt_token_ids"),
            ({"prompt_text": 5}, "prompt_text"),
            ({"prompt_text": "a\ud800b"}, "prompt_text"),
            ({"output_text": None}, "output_text"),
            ({"finish_reason": 5}, "finish_reason"),
            ({"cache_salt": b"s"}, "cache_salt"),
            ({"prompt_add_special_tokens": "yes"}, "prompt_add_special_tokens"),
        ]
        for change, field in cases:
            for c, sent in ((local, False), (rpc, True)):
                record: dict[str, Any] = {"prompt_text": prompt, "prompt_token_ids": ids[c], "output_text": "hello",
                                          "output_token_ids": [14990], **change}
                if change.get("prompt_token_ids") == "cut":
                    record["prompt_token_ids"] = ids[c][:-1]
                e = _refused(c, "record_output", model=MODEL, **record)
                assert e.field == field, (change, sent, str(e))
                assert e.code is None or (sent and e.code == grpc.StatusCode.INVALID_ARGUMENT), (change, e.code)
        assert local.stats()["records"].get("recorded", 0) == 0 and local.stats()["records"]["refused"] >= 5


# Found by test_client_raises_nothing_but_invalid_argument (garbling drew timeout 0): a zero
# timeout is well-formed and expires, as DeadlineExceeded, on either client, not as a crash.
def test_a_zero_timeout_expires(call: Call) -> None:
    with pytest.raises(DeadlineExceeded):
        call("tokenize", model=MODEL, text="", timeout=0)

HELLO = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(("method", "args", "field"), [
    ("tokenize", {"model": MODEL, "messages": HELLO, "timeout": math.nan}, "timeout"),
    ("tokenize", {"model": MODEL, "messages": HELLO, "timeout": "1"}, "timeout"),
    ("list_models", {"timeout": -1}, "timeout"),
    ("render", {"model": 1, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ("render", {"model": "\ud800", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ("record_outputs", {"model": MODEL, "records": 5}, "records"),
    ("record_outputs", {"model": MODEL, "records": [{"prompt_text": 1, "prompt_token_ids": [], "output_text": "",
                                                     "output_token_ids": []}]}, "records[0].prompt_text"),
])
def test_client_checks_needing_the_hook(call: Call, method: str, args: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as exc:
        call(method, **args)
    assert exc.value.field == field


# Found by test_client_raises_nothing_but_invalid_argument (timeout 7_427_832_909 on 3.12):
# gRPC's deadline of a timeout that long overflowed into the past and every call failed at
# once with DeadlineExceeded. Valid timeouts of any size now answer normally.
@pytest.mark.parametrize("timeout", [_core.MAX_DEADLINE_S, 7_427_832_909, 1e10, 1e300, 2**70])
def test_huge_timeouts_answer(call: Call, timeout: float) -> None:
    hello = call("tokenize", model=MODEL, text="hello", timeout=timeout)
    assert isinstance(hello, TokenizeResult) and hello.token_ids
    assert isinstance(call("tokenize", model=MODEL, messages=HELLO, timeout=timeout), TokenizeResult)
    assert "hello" in call("render", model=MODEL, messages=HELLO, timeout=timeout)
    assert [m.name for m in call("list_models", timeout=timeout)] == [MODEL]
    out = call("tokenize", model=MODEL, text=" there", add_special_tokens=False, timeout=timeout).token_ids
    assert isinstance(call("record_output", model=MODEL, prompt_text="hello", prompt_token_ids=hello.token_ids,
                           output_text=" there", output_token_ids=out, timeout=timeout), RecordResult)


def test_grpc_timeout() -> None:
    assert _core.grpc_timeout(None) is None
    for kept in (0, 0.001, 30.0, _core.MAX_DEADLINE_S):
        assert _core.grpc_timeout(kept) == kept
    for unbounded in (_core.MAX_DEADLINE_S * 1.0001, 7_427_832_909, 1e300, 2**70):
        assert _core.grpc_timeout(unbounded) is None


@pytest.mark.parametrize("args", [{"tools": ""}, {"add_generation_prompt": None}, {"chat_template_kwargs": 1}])
def test_in_process_path_checks_every_argument(sidecar: SidecarProcess, args: dict[str, Any]) -> None:
    with SidecarClient(sidecar.address) as client:
        with pytest.raises(InvalidArgumentError) as exc:
            client.tokenize(**{"model": MODEL, "text": "hello", **args})
    assert exc.value.field == next(iter(args))


def test_default_client_text_arguments(sidecar: SidecarProcess) -> None:
    """The client as constructed by default (in-process text path when it can)."""
    with SidecarClient(sidecar.address) as client:
        assert client.tokenize(MODEL, text="hello").token_ids
        for args in ({"text": "a\ud800b"}, {"return_prompt_text": "no"}, {"cache_salt": 5}, {"mode": ["exact"]},
                     {"add_special_tokens": "no"}, {"text": b"hello"}, {"timeout": math.nan}):
            with pytest.raises(InvalidArgumentError) as exc:
                client.tokenize(**{"model": MODEL, "text": "hello", **args})
            assert exc.value.field == next(iter(args)), args


# --------------------------------------------------------------------------- named examples


def _refused(call: Call | SidecarClient, method: str, **args: Any) -> InvalidArgumentError:
    """The refusal of ``method(**args)`` through ``call`` (or a client's method of that name)."""
    with pytest.raises(InvalidArgumentError) as exc:
        if isinstance(call, SidecarClient):
            getattr(call, method)(**args)
        else:
            call(method, **args)
    return exc.value


def test_named_examples_name_their_field(call: Call) -> None:
    hi = {"role": "user", "content": "hi"}
    e = _refused(call, "tokenize", model=MODEL, messages=[{"role": ["user"], "content": "hi"}])  # was TypeError
    assert e.field == "messages[0].role" and e.code is None
    e = _refused(call, "tokenize", model=MODEL, messages={"role": "user", "content": "hi"})  # was KeyError: 0
    assert e.field == "messages"
    e = _refused(call, "tokenize", model=MODEL, text="a\ud800b")  # was UnicodeEncodeError
    assert e.field == "text" and "index 1" in str(e)
    e = _refused(call, "tokenize", model=MODEL, messages=[hi], chat_template_kwargs="x")  # was chat.tools
    assert e.field == "chat_template_kwargs"
    e = _refused(call, "tokenize", model=MODEL, messages=[{"role": "assistant", "content": "", "tool_calls": "x"}])
    assert e.field == "messages[0].tool_calls" and "list" in str(e)  # was "tool_calls[0]: expected a mapping"
    no_function = [hi, {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function"}]}]
    e = _refused(call, "tokenize", model=MODEL, messages=no_function)  # was messages: ...Undefined...
    assert e.field == "messages[1].tool_calls[0].function" and e.code is None
    e = _refused(call, "render", model=MODEL, messages=[{"role": "user", "content": None}])  # was 'dict object'...
    assert e.field == "messages[0].content" and e.code is None
    e = _refused(call, "tokenize", model=MODEL, messages=[hi, {"role": "user", "content": "x\udfffy"}])
    assert e.field == "messages[1].content" and "index 1" in str(e)
    e = _refused(call, "tokenize", model=MODEL, text="x", cache_salt="s\ud800")
    assert e.field == "cache_salt"
    e = _refused(call, "tokenize", model=MODEL, text=b"bytes")
    assert e.field == "text"
    e = _refused(call, "tokenize", model=MODEL, text="x", add_special_tokens="no")
    assert e.field == "add_special_tokens"
    e = _refused(call, "tokenize", model=MODEL, messages=[{**hi, "meta": {1: "x"}}])
    assert e.field == "messages[0].meta"
    e = _refused(call, "tokenize", model=MODEL, messages=[hi], tools=[{"type": "function", "x": {"a": {2}}}])
    assert e.field == "tools[0].x.a"
    # Well-formed for the client, refused by the Qwen3 template (null content beside tool
    # calls): the sidecar's message names the message and the field.
    call_only = [hi, {"role": "assistant", "content": None,
                      "tool_calls": [{"id": "c1", "function": {"name": "ls", "arguments": {}}}]}]
    e = _refused(call, "tokenize", model=MODEL, messages=call_only)
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and e.field == "messages[1].content", str(e)


def test_refused_stop_string_names_stop_reason(call: Call) -> None:
    r = call("tokenize", model=MODEL, text="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
             add_special_tokens=False, cache_salt=uuid.uuid4().hex)
    record = {"prompt_text": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
              "prompt_token_ids": r.token_ids, "output_text": "hello", "output_token_ids": [14990],
              "stop_reason": "</s>"}
    e = _refused(call, "record_output", model=MODEL, **record)
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and e.field == "stop_reason", str(e)
    summary = call("record_outputs", model=MODEL, records=[record])
    assert summary.refused == 1 and summary.refusals[0][1].startswith("stop_reason: ")


def test_module_functions(sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sidecar_client.ADDRESS_ENV, sidecar.address)
    try:
        assert sidecar_client.tokenize(MODEL, text="hi").token_ids
        for fn, args, field in (
                (sidecar_client.tokenize, {"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
                (sidecar_client.tokenize, {"text": "a\ud800b"}, "text"),
                (sidecar_client.render, {"messages": {"role": "user", "content": "hi"}}, "messages"),
                (sidecar_client.record_output, {"prompt_text": "p", "prompt_token_ids": [1], "output_text": "o",
                                                "output_token_ids": [2], "stop_reason": True}, "stop_reason")):
            with pytest.raises(InvalidArgumentError) as exc:
                fn(MODEL, **args)
            assert exc.value.field == field
    finally:
        client = sidecar_client._clients.pop(sidecar.address, None)
        if client is not None:
            client.close()


def test_sidecar_names_fields_for_raw_grpc_callers(sidecar: SidecarProcess) -> None:
    """Shapes the client refuses, sent raw: the sidecar's message names the message and field."""
    user = pb.ChatMessage(role="user", content="hi")
    no_args = pb.ChatMessage(role="assistant", content="", tool_calls=[
        pb.ToolCall(id="c1", type="function", function=pb.ToolCallFunction(name="ls"))])
    cases = [
        (pb.ChatInput(messages=[pb.ChatMessage(role="user")]), "messages[0].content"),
        (pb.ChatInput(messages=[user, no_args]), "messages[1].tool_calls[0].function.arguments"),
        (pb.ChatInput(), "messages"),
        (pb.ChatInput(messages=[user], tools_json="{"), "tools"),
        (pb.ChatInput(messages=[user], chat_template_kwargs_json="[]"), "chat_template_kwargs"),
        (pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x", extra_json="[1]")]), "messages[0]"),
        (pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x", extra_json='{"role": "x"}')]),
         "messages[0]"),
        (pb.ChatInput(messages=[pb.ChatMessage(content="x")]), "messages[0].role"),
        (pb.ChatInput(messages=[pb.ChatMessage(role="user", content_parts=pb.ContentParts(
            parts=[pb.ContentPart(type="image_url")]))]), "messages[0].content[0].type"),
    ]
    with grpc.insecure_channel(sidecar.address) as ch:
        stub = pb_grpc.TokenizerStub(ch)
        for chat, field in cases:
            for rpc, req in ((stub.Render, pb.RenderRequest(model=MODEL, chat=chat)),
                             (stub.Tokenize, pb.TokenizeRequest(model=MODEL, chat=chat))):
                with pytest.raises(grpc.RpcError) as exc:
                    rpc(req)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (exc.value.details() or "").startswith(f"{field}: "), (field, exc.value.details())
