"""ChatRenderer == transformers' apply_chat_template(tokenize=False), byte for byte.

The reference is the real thing: ``AutoTokenizer.from_pretrained`` on the same
local directory. Tokenizers are loaded once per session (see ``_pair``).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from copy import deepcopy
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.version import Version

from tokcache.engine.errors import InvalidRequest, TemplateError
from tokcache.sidecar.bundled import llama32_dir
from tokcache.sidecar.engine.render import ChatRenderer, TemplateContext

# The renderer follows transformers 5.21+, which needs Python 3.11; on 3.10 pip installs 5.20,
# whose templates see content=None, reasoning aliases and sandbox errors differently.
OLD_REFERENCE = Version(transformers.__version__) < Version("5.21")

Messages = list[dict[str, Any]]
Outcome = tuple[str, str]


@cache
def _pair(path: str) -> tuple[ChatRenderer, Any]:
    """(our renderer, transformers tokenizer) for a directory; loaded once per session."""
    renderer = ChatRenderer.from_dir(Path(path))
    assert renderer is not None, f"{path} has no chat template"
    return renderer, transformers.AutoTokenizer.from_pretrained(path)


def _joined(messages: Sequence[Mapping[str, Any]]) -> Messages:
    """What transformers is given for our list-of-parts content: the parts joined by newlines."""
    out: Messages = []
    for message in messages:
        message = dict(message)
        if isinstance(message.get("content"), list):
            message["content"] = "\n".join(part["text"] for part in message["content"])
        out.append(message)
    return out


def _ours(renderer: ChatRenderer, messages: Sequence[Any], **options: Any) -> Outcome:
    try:
        return "ok", renderer.render(messages, **options)
    except TemplateError as exc:
        return "template-error", exc.message
    except InvalidRequest as exc:
        return "invalid", exc.field


def _theirs(tok: Any, messages: Sequence[Any], source: str | None, **options: Any) -> Outcome:
    kwargs = dict(options.pop("chat_template_kwargs", None) or {})
    if source is not None:
        options["chat_template"] = source
    try:
        text = tok.apply_chat_template(_joined(messages), tokenize=False, **options, **kwargs)
    except jinja2.TemplateError as exc:
        return "template-error", exc.message or str(exc)
    except ValueError:
        return "invalid", ""
    except Exception as exc:  # a template failing with TypeError & co.
        return "template-error", f"{type(exc).__name__}: {exc}"
    assert isinstance(text, str)
    return "ok", text


def _compare(
    renderer: ChatRenderer,
    tok: Any,
    messages: Sequence[Any],
    *,
    source: str | None = None,
    **options: Any,
) -> Outcome:
    """Both outcomes must agree: the same text, or the same template error, or both refuse.

    ``source``: a template given to transformers explicitly (``renderer`` must hold the same).
    """
    ours = _ours(renderer, messages, **deepcopy(options))
    theirs = _theirs(tok, messages, source, **deepcopy(options))
    if ours[0] == "invalid" and theirs[0] == "invalid":
        return ours  # upstream's ValueError text is prose; the kind is what must match
    if ours != theirs and OLD_REFERENCE:
        pytest.skip(f"transformers {transformers.__version__} renders this unlike 5.21+, which the renderer follows")
    assert ours == theirs
    return ours


# --------------------------------------------------------------------------- hand-written

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — 天气 ☀️ <b>now</b> & 'later'",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {"name": "search", "parameters": {"type": "object", "properties": {}}},
}


def _tool_call(args: Any, call_id: str = "call_1", name: str = "get_weather") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


MULTI_TURN: Messages = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "  And now?\n\n"},
]
TOOL_ROUND: Messages = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [_tool_call('{"city": "Paris", "days": 2}')],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "21 °C."},
    {"role": "user", "content": "Berlin?"},
    {"role": "assistant", "content": "", "tool_calls": [_tool_call({"city": "Berlin"})]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]

CASES: dict[str, tuple[Messages, dict[str, Any]]] = {
    "multi_turn": (MULTI_TURN, {}),
    "multi_turn_gen": (MULTI_TURN, {"add_generation_prompt": True}),
    "no_system": (MULTI_TURN[1:], {"add_generation_prompt": True}),
    "single_user": ([{"role": "user", "content": "x"}], {}),
    "tools": (MULTI_TURN, {"tools": [WEATHER_TOOL, SEARCH_TOOL], "add_generation_prompt": True}),
    "tools_no_system": (MULTI_TURN[1:], {"tools": [WEATHER_TOOL]}),
    "tools_in_system": (
        MULTI_TURN,
        {"tools": [WEATHER_TOOL], "chat_template_kwargs": {"tools_in_user_message": False}},
    ),
    "tools_empty_list": (MULTI_TURN, {"tools": []}),
    "tool_calls_and_results": (TOOL_ROUND, {"tools": [WEATHER_TOOL]}),
    "tool_calls_and_results_gen": (TOOL_ROUND, {"add_generation_prompt": True}),
    "tool_call_string_args": (
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "ok", "tool_calls": [_tool_call('{"a": [1, 2]}')]},
        ],
        {},
    ),
    "tool_call_dict_args": (
        [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_tool_call({"a": [1, 2], "b": "é"})],
            },
        ],
        {},
    ),
    # OpenAI-style null content next to tool calls: the key is dropped, as upstream does,
    # and Qwen3's template then fails on it, identically on both sides.
    "tool_call_content_none": (
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [_tool_call({"a": 1})]},
        ],
        {},
    ),
    "two_tool_calls": (
        [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_tool_call({"city": "A"}), _tool_call({"q": "B"}, "c2", "search")],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a"},
            {"role": "tool", "tool_call_id": "c2", "content": "b"},
        ],
        {"add_generation_prompt": True},
    ),
    "reasoning_content": (
        [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "thought 1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "\na2", "reasoning_content": "\nthought 2\n"},
        ],
        {},
    ),
    "reasoning_alias_names": (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning": "via reasoning"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "thinking": "via thinking"},
        ],
        {},
    ),
    "think_in_content": (
        [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>\nold\n</think>\n\nold answer"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>\nnew\n</think>\n\nnew answer"},
        ],
        {},
    ),
    "enable_thinking_false": (
        MULTI_TURN,
        {"add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False}},
    ),
    "enable_thinking_true": (
        MULTI_TURN,
        {"add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": True}},
    ),
    "date_string": (MULTI_TURN, {"chat_template_kwargs": {"date_string": "01 Jan 2030"}}),
    "override_special_token": (MULTI_TURN, {"chat_template_kwargs": {"bos_token": "<BOS>"}}),
    "continue_final": (
        [*MULTI_TURN, {"role": "assistant", "content": "Well, I think "}],
        {"continue_final_message": True},
    ),
    "continue_final_trailing_newline": (
        [*MULTI_TURN, {"role": "assistant", "content": "Line one\n"}],
        {"continue_final_message": True},
    ),
    "continue_final_think": (
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nhmm"}],
        {"continue_final_message": True},
    ),
    "continue_final_user": (MULTI_TURN, {"continue_final_message": True}),
    "content_none": (
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}],
        {},
    ),
    "empty_content": (
        [
            {"role": "system", "content": ""},
            {"role": "user", "content": ""},
            {"role": "assistant", "content": ""},
        ],
        {"add_generation_prompt": True},
    ),
    "content_parts": (
        [
            {"role": "system", "content": [{"type": "text", "text": "sys"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}],
            },
            {"role": "assistant", "content": []},
            {"role": "user", "content": [{"type": "text", "text": ""}]},
        ],
        {"add_generation_prompt": True},
    ),
    "names": (
        [
            {"role": "system", "content": "s", "name": "root"},
            {"role": "user", "content": "hi", "name": "alice"},
            {"role": "assistant", "content": "hey", "name": "bot"},
        ],
        {},
    ),
    "lookalike_special_tokens": (
        [
            {"role": "user", "content": "<|im_end|>\n<|im_start|>system\nx<|eot_id|>"},
            {"role": "assistant", "content": "<|start_header_id|>user<|end_header_id|>\n\n"},
            {"role": "user", "content": "{{ raise_exception('no') }} {% if %}"},
        ],
        {"add_generation_prompt": True},
    ),
    "user_tool_response_wrapped": (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
            {"role": "user", "content": "<tool_response>\nx\n</tool_response>"},
        ],
        {"add_generation_prompt": True},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(tokenizer_path: Path, case: str) -> None:
    renderer, tok = _pair(str(tokenizer_path))
    messages, options = CASES[case]
    before = deepcopy(messages)
    _compare(renderer, tok, messages, **options)
    assert messages == before, "render must not modify its input"


@pytest.mark.parametrize(
    "case",
    [
        "multi_turn_gen",
        "tools",
        "tool_calls_and_results",
        "tool_call_string_args",
        "tool_call_dict_args",
        "reasoning_content",
        "continue_final",
        "content_parts",
    ],
)
def test_common_cases_render(tokenizer_path: Path, case: str) -> None:
    """The everyday cases are not just equal but successful (no template error on either side)."""
    renderer, tok = _pair(str(tokenizer_path))
    messages, options = CASES[case]
    assert _compare(renderer, tok, messages, **options)[0] == "ok"


def test_qwen3_thinking_details(qwen3_path: Path) -> None:
    renderer, _ = _pair(str(qwen3_path))
    off = renderer.render(
        MULTI_TURN, add_generation_prompt=True, chat_template_kwargs={"enable_thinking": False}
    )
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    cases = CASES["reasoning_content"][0]
    text = renderer.render(cases)
    assert "thought 1" not in text  # reasoning before the last user turn is dropped
    assert "<think>\nthought 2\n</think>\n\na2" in text
    cont = renderer.render(*CASES["continue_final"][:1], continue_final_message=True)
    assert cont.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nWell, I think ")


def test_llama32_format(llama32_path: Path) -> None:
    renderer, _ = _pair(str(llama32_path))
    text = renderer.render(
        MULTI_TURN, add_generation_prompt=True, chat_template_kwargs={"date_string": "26 Jul 2024"}
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd now?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    calls = renderer.render(CASES["tool_call_dict_args"][0])
    assert '{"name": "get_weather", "parameters": {"a": [1, 2], "b": "é"}}<|eot_id|>' in calls
    result = renderer.render(TOOL_ROUND, tools=[WEATHER_TOOL])
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in result
    assert "Environment: ipython\n" in result


# --------------------------------------------------------------------------- property


_LOOKALIKES = [
    "<|im_end|>",
    "<|im_start|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|begin_of_text|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<tool_response>",
    "</tool_response>",
    "CONTINUE_FINAL_MESSAGE_TAG ",
    "{{ bos_token }}",
    "{% endfor %}",
]
_CODE = [
    "def f(x):\n    if x:\n        return [x]\n    return []\n",
    "\tfor (i = 0; i < n; i++) {\n\t\tsum += a[i];\n\t}\n",
    '```python\nprint("hi")\n```',
    "SELECT *\n  FROM t\n WHERE a = 'b';",
]
_WHITESPACE = [" ", "  ", "\n", "\n\n", "\n\n\n", "\t", " \n ", "\r\n", "\u00a0", "\u3000"]
_EMOJI = ["😀", "🚀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️"]

_piece = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), min_size=1, max_size=8),
    st.sampled_from(_LOOKALIKES),
    st.sampled_from(_CODE),
    st.sampled_from(_WHITESPACE),
    st.sampled_from(_EMOJI),
    st.from_regex(r"[A-Za-z]{1,10}( [A-Za-z]{1,10}){0,5}[.?!]?", fullmatch=True),
)
_short_text = st.lists(_piece, max_size=6).map("".join)
_long_text = st.tuples(_short_text, st.integers(20, 300)).map(lambda t: t[0] * t[1])
texts = st.one_of(_short_text, _short_text, _short_text, _long_text, st.just(""))


@st.composite
def _content(draw: st.DrawFn) -> Any:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        parts = draw(st.lists(texts, min_size=1, max_size=3))
        return [{"type": "text", "text": text} for text in parts]
    return draw(texts)


@st.composite
def _arguments(draw: st.DrawFn) -> Any:
    args = draw(st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), texts, max_size=3))
    return json.dumps(args, ensure_ascii=draw(st.booleans())) if draw(st.booleans()) else args


@st.composite
def _turn(draw: st.DrawFn) -> Messages:
    """One exchange: a user message, then an assistant answer with optional tool rounds."""
    out: Messages = [{"role": "user", "content": draw(_content())}]
    if draw(st.integers(0, 5)) == 0:
        out[0]["name"] = draw(st.sampled_from(["alice", "bob"]))
    if draw(st.integers(0, 3)) == 0:
        calls = [
            _tool_call(draw(_arguments()), f"call_{k}", draw(st.sampled_from(["f", "get_weather"])))
            for k in range(draw(st.integers(1, 2)))
        ]
        out.append(
            {"role": "assistant", "content": draw(st.one_of(texts, st.none())), "tool_calls": calls}
        )
        for call in calls:
            out.append({"role": "tool", "tool_call_id": call["id"], "content": draw(texts)})
    answer: dict[str, Any] = {"role": "assistant", "content": draw(_content())}
    if draw(st.integers(0, 3)) == 0:
        answer["reasoning_content"] = draw(texts)
    out.append(answer)
    return out


@st.composite
def conversations(draw: st.DrawFn) -> tuple[Messages, dict[str, Any]]:
    messages: Messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_content())})
    for turn in draw(st.lists(_turn(), min_size=1, max_size=4)):
        messages.extend(turn)
    ending = draw(st.sampled_from(["assistant", "user", "user", "tool"]))
    if ending == "user" or (ending == "tool" and messages[-1]["role"] != "tool"):
        messages.append({"role": "user", "content": draw(_content())})
    options: dict[str, Any] = {}
    if draw(st.integers(0, 3)) == 0:
        options["tools"] = [WEATHER_TOOL] + ([SEARCH_TOOL] if draw(st.booleans()) else [])
    mode = draw(st.sampled_from(["gen", "gen", "none", "continue"]))
    if mode == "gen":
        options["add_generation_prompt"] = True
    elif mode == "continue":
        options["continue_final_message"] = True
    kwargs: dict[str, Any] = {}
    if draw(st.booleans()):
        kwargs["enable_thinking"] = draw(st.booleans())
    if draw(st.booleans()):
        kwargs["date_string"] = "26 Jul 2024"
    if kwargs:
        options["chat_template_kwargs"] = kwargs
    return messages, options


def test_property_random_conversations(tokenizer_path: Path) -> None:
    """200+ random conversations per tokenizer: ours and transformers agree on every one."""
    renderer, tok = _pair(str(tokenizer_path))
    kinds: Counter[str] = Counter()

    # Derandomized: the share of examples that render (>= 200 below) depends on the draw,
    # and a random run fell under it (seen once here, not reproduced with its seed unknown).
    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(conversations())
    def check(conversation: tuple[Messages, dict[str, Any]]) -> None:
        messages, options = conversation
        kinds[_compare(renderer, tok, messages, **options)[0]] += 1

    check()
    # Agreement on errors is checked too (Qwen3 fails on null content beside tool
    # calls, Llama on parallel calls), but at least 200 examples must actually render.
    assert kinds["ok"] >= 200, kinds


# --------------------------------------------------------------------------- errors


def test_template_raise_exception(tokenizer_path: Path) -> None:
    renderer, tok = _pair(str(tokenizer_path))
    source = "{{ raise_exception('no ' + messages[0].role + ' here') }}"
    custom = ChatRenderer({"default": source}, renderer.context)
    with pytest.raises(TemplateError) as err:
        custom.render([{"role": "robot", "content": "x"}])
    assert err.value.message == "no robot here"
    assert err.value.field == "messages"
    assert str(err.value) == "messages: no robot here"
    with pytest.raises(jinja2.TemplateError, match="^no robot here$"):
        tok.apply_chat_template(
            [{"role": "robot", "content": "x"}], chat_template=source, tokenize=False
        )


def test_llama32_template_refuses_parallel_calls(llama32_path: Path) -> None:
    renderer, _ = _pair(str(llama32_path))
    messages, options = CASES["two_tool_calls"]
    with pytest.raises(TemplateError, match="^messages: This model only supports single"):
        renderer.render(messages, **options)


def test_template_failures_are_template_errors(qwen3_path: Path) -> None:
    renderer, tok = _pair(str(qwen3_path))
    for source in (
        "{{ messages[0].content.nope() }}",  # undefined
        "{{ none + 'x' }}",  # TypeError inside the template
        "{% set ns = namespace() %}{% set ns._x = 1 %}",  # sandbox hardening
        "{{ messages.append(1) }}",  # immutable sandbox
    ):
        custom = ChatRenderer({"default": source}, renderer.context)
        kind, _ = _compare(custom, tok, [{"role": "user", "content": "x"}], source=source)
        assert kind == "template-error", source


def test_template_that_does_not_compile() -> None:
    renderer = ChatRenderer({"default": "{% if %}"})
    with pytest.raises(TemplateError) as err:
        renderer.render([{"role": "user", "content": "x"}])
    assert err.value.field == "chat_template"


PARTS_BAD = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
    {"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "image_url"}]},
]


@pytest.mark.parametrize(
    ("messages", "options", "field"),
    [
        ([], {}, "messages"),
        ("hello", {}, "messages"),
        ({"role": "user"}, {}, "messages"),
        ([1], {}, "messages[0]"),
        ([{"role": "user", "content": "x"}, {"content": "x"}], {}, "messages[1].role"),
        ([*MULTI_TURN, {"role": None, "content": "x"}], {}, "messages[4].role"),
        ([{"role": 3, "content": "x"}], {}, "messages[0].role"),
        ([{"role": "user", "content": 5}], {}, "messages[0].content"),
        ([{"role": "user", "content": {"text": "x"}}], {}, "messages[0].content"),
        (PARTS_BAD, {}, "messages[2].content[1].type"),
        ([{"role": "user", "content": ["x"]}], {}, "messages[0].content[0]"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            {},
            "messages[0].content[0].text",
        ),
        (MULTI_TURN, {"tools": [1]}, "tools[0]"),
        (MULTI_TURN, {"tools": "f"}, "tools"),
        (MULTI_TURN, {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        (MULTI_TURN, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        (
            MULTI_TURN,
            {"chat_template_kwargs": {"documents": "d"}},
            "chat_template_kwargs.documents",
        ),
        (
            MULTI_TURN,
            {"continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}],
            {"continue_final_message": True},
            "messages[1].content",
        ),
    ],
)
def test_invalid_requests_name_the_field(
    qwen3_path: Path, messages: Any, options: dict[str, Any], field: str
) -> None:
    renderer, _ = _pair(str(qwen3_path))
    with pytest.raises(InvalidRequest) as err:
        renderer.render(messages, **options)
    assert not isinstance(err.value, TemplateError)
    assert err.value.field == field
    assert str(err.value) == f"{field}: {err.value.message}"


def test_continue_final_message_dropped_by_template(qwen3_path: Path) -> None:
    renderer, tok = _pair(str(qwen3_path))
    truncating = "{% for m in messages %}{{ m.content[:3] }}{% endfor %}"
    custom = ChatRenderer({"default": truncating}, renderer.context)
    messages = [{"role": "assistant", "content": "hello world"}]
    outcome = _compare(custom, tok, messages, source=truncating, continue_final_message=True)
    assert outcome[0] == "invalid"
    with pytest.raises(InvalidRequest, match="does not appear") as err:
        custom.render(messages, continue_final_message=True)
    assert err.value.field == "messages[0].content"
    roles_only = "{{ messages[0].role }}"
    no_content = ChatRenderer({"default": roles_only}, renderer.context)
    outcome = _compare(no_content, tok, messages, source=roles_only, continue_final_message=True)
    assert outcome[0] == "invalid"


# --------------------------------------------------------------------------- templates


def _custom_compare(
    tok: Any, renderer: ChatRenderer, source: str, messages: Messages, **options: Any
) -> str:
    """Render with our renderer vs transformers given the same template source."""
    ours = renderer.render(messages, **options)
    kwargs = dict(options.pop("chat_template_kwargs", None) or {})
    theirs = tok.apply_chat_template(
        _joined(messages), chat_template=source, tokenize=False, **options, **kwargs
    )
    assert ours == theirs
    return ours


@pytest.mark.parametrize(
    "source",
    [
        # {% generation %} (AssistantTracker) renders its body
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}[{{ m.content }}]{% endif %}{% endfor %}",
        # loopcontrols
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}|{% endfor %}",
        # tojson keeps non-ASCII and HTML characters, and takes upstream's options
        "{{ messages | tojson }}\n{{ tools | tojson(indent=2, sort_keys=true) }}"
        "{{ {'a': 1, 'b': [1, 2]} | tojson(separators=(',', ':')) }}"
        "{{ messages[0] | tojson(ensure_ascii=true) }}",
        # dict() and namespace() globals
        "{% set d = dict(a=1, b=messages[0].role) %}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ d | tojson }} {{ ns.n }}"
        "{{ dict.fromkeys(['x', 'y'], 0) | tojson }}",
        # trim_blocks / lstrip_blocks
        "{% for m in messages %}\n    {% if m.content %}\n  {{ m.role }}: {{ m.content }}\n"
        "    {% endif %}\n{% endfor %}\n",
        # special tokens and template kwargs in the context
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ custom }}"
        "|{{ add_generation_prompt }}|{{ documents | tojson }}",
        # strftime_now exists (its value is the clock, so only its type is rendered)
        "{{ strftime_now('%Y') | length }}",
    ],
)
def test_environment_matches(tokenizer_path: Path, source: str) -> None:
    base, tok = _pair(str(tokenizer_path))
    renderer = ChatRenderer({"default": source}, base.context)
    messages: Messages = [
        {"role": "system", "content": "<b>sys</b> & 'x'"},
        {"role": "user", "content": "héllo 世界 😀"},
        {"role": "assistant", "content": "a\n  b"},
    ]
    _custom_compare(tok, renderer, source, messages, tools=[WEATHER_TOOL])
    _custom_compare(
        tok,
        renderer,
        source,
        messages,
        add_generation_prompt=True,
        chat_template_kwargs={"custom": [1, "x"], "documents": [{"title": "t", "text": "d"}]},
    )


def _tokenizer_dir(
    tmp_path: Path, config: dict[str, Any], files: Mapping[str, str] | None = None
) -> Path:
    """A tokenizer dir: Llama's tokenizer.json, the given config and extra text files."""
    (tmp_path / "tokenizer.json").symlink_to(llama32_dir() / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, text in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def _base_config() -> dict[str, Any]:
    config = json.loads((llama32_dir() / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert isinstance(config, dict)
    return config


MSGS: Messages = [{"role": "user", "content": "hi"}]


def test_chat_template_file_wins_over_config(tmp_path: Path) -> None:
    config = {**_base_config(), "chat_template": "CONFIG {{ messages[0].content }}"}
    path = _tokenizer_dir(
        tmp_path, config, {"chat_template.jinja": "FILE {{ messages[0].content }}"}
    )
    renderer = ChatRenderer.from_dir(path)
    assert renderer is not None
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert renderer.render(MSGS) == "FILE hi"
    assert tok.apply_chat_template(MSGS, tokenize=False) == "FILE hi"


def test_named_templates_from_config_list(tmp_path: Path) -> None:
    config = {
        **_base_config(),
        "chat_template": [
            {"name": "default", "template": "D {{ tools is none }}"},
            {"name": "tool_use", "template": "T {{ tools | length }}"},
        ],
    }
    path = _tokenizer_dir(tmp_path, config)
    renderer = ChatRenderer.from_dir(path)
    assert renderer is not None
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    for tools in (None, [], [WEATHER_TOOL]):
        ours = renderer.render(MSGS, tools=tools)
        assert ours == tok.apply_chat_template(MSGS, tools=tools, tokenize=False)
    assert renderer.render(MSGS) == "D True"
    assert renderer.render(MSGS, tools=[WEATHER_TOOL]) == "T 1"


def test_additional_chat_templates_dir(tmp_path: Path) -> None:
    config = {**_base_config(), "chat_template": "CONFIG"}
    files = {
        "chat_template.jinja": "D",
        "additional_chat_templates/tool_use.jinja": "T",
    }
    path = _tokenizer_dir(tmp_path, config, files)
    renderer = ChatRenderer.from_dir(path)
    assert renderer is not None
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    for tools in (None, [WEATHER_TOOL]):
        assert renderer.render(MSGS, tools=tools) == tok.apply_chat_template(
            MSGS, tools=tools, tokenize=False
        )
    assert renderer.render(MSGS, tools=[WEATHER_TOOL]) == "T"


def test_several_templates_without_default(tmp_path: Path) -> None:
    path = _tokenizer_dir(
        tmp_path, _base_config(), {"additional_chat_templates/tool_use.jinja": "T"}
    )
    renderer = ChatRenderer.from_dir(path)
    assert renderer is not None
    assert renderer.render(MSGS, tools=[WEATHER_TOOL]) == "T"
    with pytest.raises(InvalidRequest) as err:
        renderer.render(MSGS)
    assert err.value.field == "chat_template"


def test_no_template(tmp_path: Path) -> None:
    assert ChatRenderer.from_dir(llama32_dir()) is None
    assert ChatRenderer.from_dir(_tokenizer_dir(tmp_path, _base_config())) is None


def test_special_tokens_as_transformers_resolves_them(tmp_path: Path) -> None:
    config = _base_config()
    config.update(
        {
            "bos_token": {
                "__type": "AddedToken",
                "content": "<|begin_of_text|>",
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            },
            "unk_token": None,
            "image_token": "<|reserved_special_token_0|>",
            "video_token": {"__type": "AddedToken", "content": "<|reserved_special_token_2|>"},
            "add_bos_token": True,
            "extra_special_tokens": {"audio_token": "<|reserved_special_token_1|>"},
        }
    )
    del config["pad_token"]
    source = (
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ image_token }}"
        "|{{ audio_token }}|{{ video_token }}|{{ messages[0].content }}"
    )
    path = _tokenizer_dir(tmp_path, config, {"chat_template.jinja": source})
    renderer = ChatRenderer.from_dir(path)
    assert renderer is not None
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert renderer.context.as_kwargs() == tok.special_tokens_map
    assert renderer.render(MSGS) == tok.apply_chat_template(MSGS, tokenize=False)
    assert renderer.render(MSGS) == (
        "<|begin_of_text|>|<|end_of_text|>|||<|reserved_special_token_0|>"
        "|<|reserved_special_token_1|>|<|reserved_special_token_2|>|hi"
    )


def test_shipped_special_tokens(tokenizer_path: Path) -> None:
    renderer, tok = _pair(str(tokenizer_path))
    assert renderer.context.as_kwargs() == tok.special_tokens_map


def test_template_context_validation() -> None:
    assert TemplateContext().as_kwargs() == {}
    with pytest.raises(ValueError):
        TemplateContext((("bos_token", "a"), ("bos_token", "b")))
    context = TemplateContext.from_config({"bos_token": "<s>", "mask_token": {"content": "<m>"}})
    assert context.as_kwargs() == {"bos_token": "<s>", "mask_token": "<m>"}
    assert hash(context) == hash(
        TemplateContext.from_config({"bos_token": "<s>", "mask_token": "<m>"})
    )


# --------------------------------------------------------------------------- concurrency


def test_render_is_thread_safe(tokenizer_path: Path) -> None:
    renderer, _ = _pair(str(tokenizer_path))
    jobs: list[tuple[Messages, dict[str, Any]]] = [
        CASES[name] for name in ("multi_turn_gen", "tools", "reasoning_content", "continue_final")
    ]
    expected = [renderer.render(m, **o) for m, o in jobs]
    failures: list[str] = []
    start = threading.Barrier(8)

    def worker(seed: int) -> None:
        start.wait()
        for i in range(200):
            k = (seed + i) % len(jobs)
            if renderer.render(jobs[k][0], **jobs[k][1]) != expected[k]:
                failures.append(f"worker {seed} job {k}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
