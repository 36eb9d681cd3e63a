"""Chat rendering, byte-identical to transformers' ``apply_chat_template(tokenize=False)``.

The sidecar renders chat requests itself (``tokenize(messages=...)``), and the
cache promise only holds if the text it tokenizes is exactly the text vLLM's
own renderer would produce. vLLM renders with transformers, so this module is
a transcription of transformers 5.x (``utils/chat_template_utils.py`` and
``PreTrainedTokenizerBase.apply_chat_template``) without depending on it:

* the jinja environment — ``ImmutableSandboxedEnvironment(trim_blocks=True,
  lstrip_blocks=True)`` with ``loopcontrols``, the ``{% generation %}`` tag,
  the non-HTML-escaping ``tojson``, ``raise_exception``, ``strftime_now`` and
  the hardened ``dict``/``namespace`` globals;
* the context — the tokenizer's named special tokens, then the caller's
  ``chat_template_kwargs`` on top, ``messages``, ``tools``, ``documents``,
  ``add_generation_prompt``;
* the input clean-up — ``None``-valued message keys dropped, everything
  rebuilt from plain JSON types, ``reasoning_content``/``thinking`` aliased;
* ``continue_final_message`` — the tag-and-cut trick and its checks;
* template selection — ``chat_template.jinja`` and ``additional_chat_templates/``
  over ``tokenizer_config.json``, named templates with ``default``/``tool_use``.

Known gaps (both outside what a tokenizer directory can tell us): special
tokens that a specific transformers tokenizer *class* defaults in code when
the config omits them (e.g. ``Qwen2Tokenizer``'s ``<|endoftext|>``) are not
known here, and numpy scalars in inputs are not unwrapped (inputs arrive as
JSON, so they cannot occur).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokcache.engine.errors import InvalidRequest, TemplateError

__all__ = [
    "CHAT_TEMPLATE_DIR",
    "CHAT_TEMPLATE_FILE",
    "SPECIAL_TOKEN_ATTRIBUTES",
    "ChatRenderer",
    "TemplateContext",
]

CHAT_TEMPLATE_FILE: Final = "chat_template.jinja"
CHAT_TEMPLATE_DIR: Final = "additional_chat_templates"
TOKENIZER_CONFIG_FILE: Final = "tokenizer_config.json"
TOKENIZER_FILE: Final = "tokenizer.json"
SPECIAL_TOKENS_MAP_FILE: Final = "special_tokens_map.json"

#: ``PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES``: the named special tokens
#: every tokenizer exposes to chat templates (when set).
SPECIAL_TOKEN_ATTRIBUTES: Final = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# transformers appends this to the final message, renders, and cuts the output
# at it; the trailing space lets it tell "template kept spacing" from "trimmed".
_CONTINUE_TAG: Final = "CONTINUE_FINAL_MESSAGE_TAG "

# Names a message's reasoning travels under; the first is what templates read.
_REASONING_FIELDS: Final = ("reasoning_content", "thinking", "reasoning")

# chat_template_kwargs are splatted into apply_chat_template(**kwargs) upstream,
# so these names bind to its parameters (or collide with the render call)
# instead of reaching the template. We refuse them rather than guess.
# `documents` is the exception: it binds to the documents parameter, and we
# pass it on the same way.
_RESERVED_TEMPLATE_KWARGS: Final = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


# --------------------------------------------------------------------------- context


def _token_content(value: Any) -> str | None:
    """A special token as configured: a string, or an AddedToken dict's ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@dataclass(frozen=True)
class TemplateContext:
    """The variables transformers adds to every chat template render.

    That is the tokenizer's ``special_tokens_map``: the named special tokens
    (``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``,
    ``cls_token``, ``mask_token``) that are set, plus model-specific ones
    (custom ``*_token`` keys of the config, an ``extra_special_tokens`` dict).
    Values are the tokens' text. Request ``chat_template_kwargs`` override these.

    Immutable and hashable; build it with :meth:`from_config` or :meth:`from_dir`.
    """

    special_tokens: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        names = [name for name, _ in self.special_tokens]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate special token names in {names}")
        for name, content in self.special_tokens:
            if not isinstance(name, str) or not isinstance(content, str):
                raise TypeError(f"special token {name!r} must map a str to a str")

    def as_kwargs(self) -> dict[str, str]:
        """A fresh dict of template variables (name → token text)."""
        return dict(self.special_tokens)

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        special_tokens_map: Mapping[str, Any] | None = None,
        default_pad_token: str | None = None,
    ) -> TemplateContext:
        """Resolve the special tokens the way ``from_pretrained`` does.

        ``config`` is tokenizer_config.json; ``special_tokens_map`` the legacy
        special_tokens_map.json (consulted, as upstream, only when the config has
        no ``added_tokens_decoder``); ``default_pad_token`` the pad token of
        tokenizer.json's ``padding`` section (used only if the config has no
        ``pad_token`` key at all). Values that are neither strings nor dicts with
        a string ``content`` are ignored (transformers refuses to load those).
        """
        init = dict(config)
        # v5 renamed additional_special_tokens; a dict under either name holds
        # model-specific named tokens (e.g. {"image_token": "<image>"}).
        if "additional_special_tokens" in init and not init.get("extra_special_tokens"):
            init["extra_special_tokens"] = init.pop("additional_special_tokens")
        explicit: dict[str, Any] = {
            key: init.pop(key)
            for key in list(init)
            if key not in SPECIAL_TOKEN_ATTRIBUTES
            and key.endswith("_token")
            and isinstance(init[key], str)
        }
        extra = init.get("extra_special_tokens")
        if isinstance(extra, Mapping):
            explicit.update(init.pop("extra_special_tokens"))
        if special_tokens_map is not None and "added_tokens_decoder" not in init:
            for key, value in special_tokens_map.items():
                init[key] = value
            extra = init.get("extra_special_tokens")
            if isinstance(extra, Mapping):
                explicit.update(init.pop("extra_special_tokens"))
        if "pad_token" not in init and default_pad_token is not None:
            init["pad_token"] = default_pad_token

        tokens: dict[str, str] = {}
        for key in SPECIAL_TOKEN_ATTRIBUTES:
            content = _token_content(init.get(key))
            if content is not None:
                tokens[key] = content
        # Custom *_token keys left in the config (AddedToken dicts were skipped
        # above, as upstream does before converting them) are picked up by the
        # tokenizer's __init__; the explicit ones win on a clash.
        auto = {
            key: content
            for key, value in init.items()
            if key not in SPECIAL_TOKEN_ATTRIBUTES
            and key.endswith("_token")
            and isinstance(value, (str, Mapping))
            and (content := _token_content(value)) is not None
        }
        for key, value in {**auto, **explicit}.items():
            content = _token_content(value)
            if content is not None:
                tokens[key] = content
        return cls(tuple(tokens.items()))

    @classmethod
    def from_dir(cls, path: Path) -> TemplateContext:
        """:meth:`from_config` on the files of a tokenizer directory.

        Raises OSError / ValueError if a present file cannot be read or parsed.
        """
        config = _read_json(path / TOKENIZER_CONFIG_FILE) or {}
        special_map = _read_json(path / SPECIAL_TOKENS_MAP_FILE)
        default_pad: str | None = None
        if "pad_token" not in config and "pad_token" not in (special_map or {}):
            # The tokenizers backend falls back to tokenizer.json's padding for a
            # pad token; that file is large, so read it only when it can matter.
            tokenizer_json = _read_json(path / TOKENIZER_FILE) or {}
            padding = tokenizer_json.get("padding")
            if isinstance(padding, Mapping) and isinstance(padding.get("pad_token"), str):
                default_pad = padding["pad_token"]
        return cls.from_config(
            config, special_tokens_map=special_map, default_pad_token=default_pad
        )


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


# --------------------------------------------------------------------------- jinja


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``AssistantTracker``: ``{% generation %}…{% endgeneration %}``.

    Upstream it records where assistant text lands, but only inside
    ``activate_tracker`` (``return_assistant_tokens_mask``); otherwise it just
    renders its body. We never track, so the extension is stateless and safe
    to share between threads.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation_support")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(
        self, context: jinja2.nodes.EvalContext, caller: jinja2.runtime.Macro
    ) -> str:
        rendered: str = caller()
        return rendered


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class _Lookup(str):
    """An error message that also remembers the failed lookup: ``obj[name]`` / ``obj.name``.

    It is the message itself (``exc.args[0]``), so the error reads exactly as
    upstream's; :meth:`ChatRenderer.render` uses the lookup to name the input
    field the template wanted (``messages[0].content``).
    """

    obj: Any
    name: Any

    def __new__(cls, text: str, obj: Any, name: Any) -> _Lookup:
        self = super().__new__(cls, text)
        self.obj, self.name = obj, name
        return self


# Named `Undefined` as upstream's class: the name shows in template errors
# ("unsupported operand type(s) for +: 'NoneType' and 'Undefined'"), which must
# read as transformers' do.
class Undefined(jinja2.Undefined):
    """jinja's default Undefined whose error message remembers where the lookup failed."""

    __slots__ = ()

    @property
    def _undefined_message(self) -> str:
        return _Lookup(super()._undefined_message, self._undefined_obj, self._undefined_name)


def _json_default(value: Any) -> Any:
    # json's own TypeError, word for word; for an undefined value it remembers the lookup.
    message = f"Object of type {type(value).__name__} is not JSON serializable"
    if isinstance(value, jinja2.Undefined):
        message = _Lookup(message, value._undefined_obj, value._undefined_name)
    raise TypeError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes <, >, &, ' — templates expect raw JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
        default=_json_default,
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates without the class itself (no attribute/type escapes)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` that refuses underscore-prefixed attributes (sandbox hardening)."""

    # Same self-less signature as jinja's Namespace, so `namespace(self=...)` works.
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: B902
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    # Namespace.__getattribute__ serves only stored attributes, so this is
    # always reached through the class, never through an instance.
    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )


def _new_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        undefined=Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


# --------------------------------------------------------------------------- inputs


def _plain(value: Any) -> Any:
    """transformers' ``_plain_template_data``: rebuild a value from plain JSON types.

    Templates are untrusted code; the sandbox cannot know which methods of a
    rich object are dangerous, so the template only ever sees str/int/float/
    bool/None, dicts, lists and tuples, and ``"<TypeName>"`` for anything else.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _join_text_parts(parts: Sequence[Any], field: str) -> str:
    """vLLM's "string" content format: text parts joined with newlines."""
    texts: list[str] = []
    for j, part in enumerate(parts):
        where = f"{field}[{j}]"
        if not isinstance(part, Mapping):
            raise InvalidRequest(where, "must be an object with 'type' and 'text'")
        kind = part.get("type")
        if kind != "text":
            raise InvalidRequest(
                f"{where}.type",
                f"unsupported content part type {kind!r}; only 'text' parts can be rendered",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{where}.text", "must be a string")
        texts.append(text)
    return "\n".join(texts)


def _normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate and convert messages into what transformers hands the template.

    Per message, in upstream's order: keys whose value is ``None`` are dropped
    (OpenAI-style ``content=None`` / ``tool_calls=None``), list content is
    joined (ours, before upstream sees it), the whole message is rebuilt from
    plain types, and reasoning fields are aliased. Key order is preserved,
    since a template may iterate a message's items.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequest("messages", "must be a list of messages")
    if not messages:
        raise InvalidRequest("messages", "must not be empty")
    chat: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequest(where, "must be an object")
        if "role" not in message:
            raise InvalidRequest(f"{where}.role", "is required")
        if not isinstance(message["role"], str):
            raise InvalidRequest(f"{where}.role", "must be a string")
        kept: dict[Any, Any] = {}
        for key, value in message.items():
            if value is None:
                continue
            if key == "content":
                if isinstance(value, (list, tuple)):
                    value = _join_text_parts(value, f"{where}.content")
                elif not isinstance(value, str):
                    raise InvalidRequest(
                        f"{where}.content", "must be a string, null or a list of text parts"
                    )
            kept[key] = value
        chat.append(_alias_reasoning(_plain(kept)))
    return chat


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    # Upstream fills `reasoning_content` from older names, and `thinking` for
    # gpt-oss templates; `thinking` goes first unless the message had it.
    reasoning = next(
        (message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None
    )
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _normalise_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[Any] | None:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise InvalidRequest("tools", "must be a list of tool schemas")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InvalidRequest(f"tools[{i}]", "must be a JSON schema object")
    return [_plain(tool) for tool in tools]


def _normalise_documents(documents: Any) -> list[Any] | None:
    field = "chat_template_kwargs.documents"
    if documents is None:
        return None
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
        raise InvalidRequest(field, "must be a list of objects")
    for i, document in enumerate(documents):
        if not isinstance(document, Mapping):
            raise InvalidRequest(f"{field}[{i}]", "must be an object")
    plain: list[Any] = _plain(list(documents))
    return plain


# --------------------------------------------------------------------------- renderer


class ChatRenderer:
    """Renders chat requests with one model's chat template(s).

    Templates are compiled once, at construction; afterwards the renderer is
    immutable, so :meth:`render` may be called from any number of threads.
    """

    def __init__(
        self, templates: Mapping[str, str], context: TemplateContext | None = None
    ) -> None:
        """``templates`` maps names to jinja sources; a single template is ``{"default": src}``.

        A template that does not compile is kept as its error and reported by
        every :meth:`render` that selects it (upstream also fails only on use).
        Raises ValueError if ``templates`` is empty.
        """
        if not templates:
            raise ValueError("a ChatRenderer needs at least one template")
        self.context = context if context is not None else TemplateContext()
        self.templates: Mapping[str, str] = MappingProxyType(dict(templates))
        env = _new_environment()
        self._compiled: dict[str, jinja2.Template | jinja2.TemplateSyntaxError] = {}
        for name, source in self.templates.items():
            try:
                self._compiled[name] = env.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                self._compiled[name] = exc

    @classmethod
    def from_dir(cls, path: Path) -> ChatRenderer | None:
        """Load the chat template(s) and special tokens of a tokenizer directory.

        As transformers' ``from_pretrained``: ``chat_template.jinja`` (the
        ``default``) and ``additional_chat_templates/*.jinja`` (named by file)
        replace tokenizer_config.json's ``chat_template`` entirely when any
        exists; the config value is a string or a list of ``{"name",
        "template"}``. :meth:`render` picks ``tool_use`` when tools are given
        and it exists, else ``default``. Special tokens come from
        :meth:`TemplateContext.from_dir`.

        Returns None when the directory has no template. Raises OSError /
        ValueError when a present file cannot be read or parsed.
        """
        path = Path(path)
        templates: dict[str, str] = {}
        default_file = path / CHAT_TEMPLATE_FILE
        if default_file.is_file():
            templates["default"] = default_file.read_text(encoding="utf-8")
        extra_dir = path / CHAT_TEMPLATE_DIR
        if extra_dir.is_dir():
            for file in sorted(extra_dir.glob("*.jinja")):
                templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
        config = _read_json(path / TOKENIZER_CONFIG_FILE) or {}
        if not templates:
            configured = config.get("chat_template")
            if isinstance(configured, str):
                templates["default"] = configured
            elif isinstance(configured, (list, tuple)):
                for entry in configured:
                    if not isinstance(entry, Mapping) or not isinstance(entry.get("template"), str):
                        raise ValueError(f"{path}: malformed chat_template entry {entry!r}")
                    templates[str(entry["name"])] = entry["template"]
        if not templates:
            return None
        return cls(templates, TemplateContext.from_dir(path))

    def template_for(self, *, tools: bool) -> str:
        """The name of the template a request uses (``tools``: were tools given?).

        Raises InvalidRequest when the model has several templates and none fits.
        """
        if tools and "tool_use" in self._compiled:
            return "tool_use"
        if "default" in self._compiled:
            return "default"
        raise InvalidRequest(
            "chat_template",
            "this model has several chat templates and none named 'default' "
            f"(available: {sorted(self._compiled)})",
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text, == transformers' ``tokenizer.apply_chat_template(messages,
        tools=..., add_generation_prompt=..., continue_final_message=..., tokenize=False,
        **chat_template_kwargs)``, byte for byte.

        Messages must be a non-empty sequence of mappings, each with a string
        ``role``; ``content`` is a string, None, or a list of ``{"type": "text",
        "text": ...}`` parts, which are joined with ``"\\n"`` first (what vLLM does
        for templates of "string" content format). Keys with None values are
        dropped; everything else (``name``, ``tool_calls`` with string or mapping
        ``arguments``, ``tool_call_id``, ``reasoning_content``…) passes through.
        ``chat_template_kwargs`` become template variables, overriding special
        tokens; a ``documents`` key is passed as transformers' ``documents``.

        Raises InvalidRequest naming the bad field (``messages[3].role``,
        ``messages[2].content[1].type``, ``chat_template_kwargs.tokenize``…) and
        for option conflicts transformers refuses (``continue_final_message``
        with ``add_generation_prompt``, a final message without content or whose
        content the template drops); TemplateError carrying the template's
        ``raise_exception`` text or the jinja error when the template fails —
        field ``messages``, or the input the template looked up in vain
        (``messages[0].content`` for a null content, ``messages[1].tool_calls[0]
        .function.arguments``) — with field ``chat_template`` if it does not compile.
        Thread-safe; inputs are never modified.
        """
        kwargs = self._template_kwargs(chat_template_kwargs)
        documents = _normalise_documents(kwargs.pop("documents", None))
        tool_schemas = _normalise_tools(tools)
        name = self.template_for(tools=tools is not None)
        compiled = self._compiled[name]
        if isinstance(compiled, jinja2.TemplateSyntaxError):
            raise TemplateError(
                f"chat template {name!r} does not compile: {compiled}", field="chat_template"
            ) from compiled
        chat = _normalise_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message",
                "is not compatible with add_generation_prompt: use continue_final_message to "
                "continue the final message, add_generation_prompt to start a new assistant one",
            )

        final_text: str | None = None
        if continue_final_message:
            final_text = chat[-1].get("content")
            if final_text is None:
                raise InvalidRequest(
                    f"messages[{len(chat) - 1}].content",
                    "continue_final_message is set but the final message has no content",
                )
            if "content" not in self.templates[name]:
                raise InvalidRequest(
                    "continue_final_message",
                    "the chat template does not read message content, so it cannot be continued",
                )
            # _plain made a fresh copy: this never touches the caller's message.
            chat[-1]["content"] = final_text + _CONTINUE_TAG

        context = _plain({**self.context.as_kwargs(), **kwargs})
        try:
            rendered = compiled.render(
                messages=chat,
                tools=tool_schemas,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as exc:
            # raise_exception's text, or jinja's (undefined, sandbox…) verbatim.
            field = _lookup_field(exc, chat, tool_schemas, documents, context, kwargs)
            raise TemplateError(str(exc.message or exc), field) from exc
        except Exception as exc:
            # TypeError from `none + 'x'` and the like: the template failed on this input.
            field = _lookup_field(exc, chat, tool_schemas, documents, context, kwargs)
            raise TemplateError(f"{type(exc).__name__}: {exc}", field) from exc

        if final_text is not None:
            rendered = _cut_at_continue_tag(rendered, final_text, len(chat) - 1)
        return rendered

    def _template_kwargs(self, chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        if chat_template_kwargs is None:
            return {}
        if not isinstance(chat_template_kwargs, Mapping):
            raise InvalidRequest("chat_template_kwargs", "must be an object")
        kwargs: dict[str, Any] = {}
        for key, value in chat_template_kwargs.items():
            if not isinstance(key, str):
                raise InvalidRequest("chat_template_kwargs", f"key {key!r} is not a string")
            if key in _RESERVED_TEMPLATE_KWARGS:
                raise InvalidRequest(
                    f"chat_template_kwargs.{key}",
                    "is a rendering option, not a template variable; pass it as one",
                )
            kwargs[key] = value
        return kwargs


def _step(path: str, key: Any) -> str:
    if isinstance(key, str):
        return f"{path}.{key}" if key.isidentifier() else f"{path}[{key!r}]"
    return f"{path}[{key!r}]"


def _lookup_field(
    exc: BaseException,
    chat: list[dict[str, Any]],
    tools: list[Any] | None,
    documents: list[Any] | None,
    context: dict[str, Any],
    kwargs: Mapping[str, Any],
) -> str:
    """The input field a failed render looked up, as the caller names it, else ``messages``.

    A template that reads ``message.content`` where the message has none (a null
    content is dropped first, as upstream does) fails with "'dict object' has no
    attribute 'content'", naming no message. The error's :class:`_Lookup` holds
    the dict; it is found by identity among the render's inputs (fresh copies
    made by ``_plain``, so no two paths share a container) and the path returned:
    ``messages[3].content``, ``messages[1].tool_calls[0].function.arguments``.
    """
    lookup = exc.args[0] if exc.args else None
    if not isinstance(lookup, _Lookup) or not isinstance(lookup.obj, (dict, list)):
        return "messages"
    roots: list[tuple[str, Any]] = [("messages", chat), ("tools", tools)]
    roots += [(_step("chat_template_kwargs", key), context.get(key)) for key in kwargs if key != "documents"]
    roots.append(("chat_template_kwargs.documents", documents))
    while roots:
        path, value = roots.pop()
        if value is lookup.obj:
            return _step(path, lookup.name)
        if isinstance(value, dict):
            roots += [(_step(path, key), item) for key, item in value.items()]
        elif isinstance(value, (list, tuple)):
            roots += [(f"{path}[{j}]", item) for j, item in enumerate(value)]
    return "messages"


def _cut_at_continue_tag(rendered: str, final_text: str, index: int) -> str:
    """Upstream's continue_final_message post-processing: cut the output at the tag."""
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise InvalidRequest(
            f"messages[{index}].content",
            "continue_final_message is set but the final message does not appear in the "
            "rendered chat; the chat template deletes parts of it",
        )
    tag_at = rendered.rindex(tag)
    if rendered[tag_at : tag_at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        # The template kept the message's spacing: the text before the tag is exact.
        return rendered[:tag_at]
    # The template trimmed the trailing space of the tag, and maybe the
    # message's own trailing whitespace with it: strip, as upstream does.
    return rendered[:tag_at].rstrip()
