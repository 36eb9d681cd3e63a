from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKENIZE_MODE_UNSPECIFIED: _ClassVar[TokenizeMode]
    TOKENIZE_MODE_KV_STABLE: _ClassVar[TokenizeMode]
    TOKENIZE_MODE_EXACT: _ClassVar[TokenizeMode]

class CacheSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_SOURCE_UNSPECIFIED: _ClassVar[CacheSource]
    CACHE_SOURCE_MISS: _ClassVar[CacheSource]
    CACHE_SOURCE_L0: _ClassVar[CacheSource]
    CACHE_SOURCE_L1: _ClassVar[CacheSource]
    CACHE_SOURCE_AR: _ClassVar[CacheSource]
TOKENIZE_MODE_UNSPECIFIED: TokenizeMode
TOKENIZE_MODE_KV_STABLE: TokenizeMode
TOKENIZE_MODE_EXACT: TokenizeMode
CACHE_SOURCE_UNSPECIFIED: CacheSource
CACHE_SOURCE_MISS: CacheSource
CACHE_SOURCE_L0: CacheSource
CACHE_SOURCE_L1: CacheSource
CACHE_SOURCE_AR: CacheSource

class ContentPart(_message.Message):
    __slots__ = ("type", "text")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    type: str
    text: str
    def __init__(self, type: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ContentParts(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ToolCallFunction(_message.Message):
    __slots__ = ("name", "arguments", "arguments_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: str
    arguments_json: str
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "type", "function")
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    function: ToolCallFunction
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., function: _Optional[_Union[ToolCallFunction, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "content_parts", "name", "tool_calls", "tool_call_id", "reasoning_content", "extra_json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_PARTS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    content_parts: ContentParts
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    reasoning_content: str
    extra_json: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., content_parts: _Optional[_Union[ContentParts, _Mapping]] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., extra_json: _Optional[str] = ...) -> None: ...

class ChatInput(_message.Message):
    __slots__ = ("messages", "tools_json", "add_generation_prompt", "continue_final_message", "chat_template_kwargs_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template_kwargs_json: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "chat", "add_special_tokens", "cache_salt", "mode", "return_prompt_text")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: ChatInput
    add_special_tokens: bool
    cache_salt: str
    mode: TokenizeMode
    return_prompt_text: bool
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., mode: _Optional[_Union[TokenizeMode, str]] = ..., return_prompt_text: _Optional[bool] = ...) -> None: ...

class CacheDecision(_message.Message):
    __slots__ = ("source", "cached_tokens", "cached_chars", "encoded_chars", "ar_spliced_tokens", "boundaries", "l1_disabled_reason")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_CHARS_FIELD_NUMBER: _ClassVar[int]
    ENCODED_CHARS_FIELD_NUMBER: _ClassVar[int]
    AR_SPLICED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    L1_DISABLED_REASON_FIELD_NUMBER: _ClassVar[int]
    source: CacheSource
    cached_tokens: int
    cached_chars: int
    encoded_chars: int
    ar_spliced_tokens: int
    boundaries: int
    l1_disabled_reason: str
    def __init__(self, source: _Optional[_Union[CacheSource, str]] = ..., cached_tokens: _Optional[int] = ..., cached_chars: _Optional[int] = ..., encoded_chars: _Optional[int] = ..., ar_spliced_tokens: _Optional[int] = ..., boundaries: _Optional[int] = ..., l1_disabled_reason: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "num_tokens", "fingerprint", "decision", "prompt_text", "backend")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    num_tokens: int
    fingerprint: str
    decision: CacheDecision
    prompt_text: str
    backend: str
    def __init__(self, token_ids: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., fingerprint: _Optional[str] = ..., decision: _Optional[_Union[CacheDecision, _Mapping]] = ..., prompt_text: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class TokenizeStreamRequest(_message.Message):
    __slots__ = ("request", "traceparent", "tracestate")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    request: TokenizeRequest
    traceparent: str
    tracestate: str
    def __init__(self, request: _Optional[_Union[TokenizeRequest, _Mapping]] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class TokenizeStreamResponse(_message.Message):
    __slots__ = ("response", "error")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    response: TokenizeResponse
    error: StreamError
    def __init__(self, response: _Optional[_Union[TokenizeResponse, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class RenderRequest(_message.Message):
    __slots__ = ("model", "chat")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    model: str
    chat: ChatInput
    def __init__(self, model: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ...) -> None: ...

class RenderResponse(_message.Message):
    __slots__ = ("prompt_text", "fingerprint")
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    prompt_text: str
    fingerprint: str
    def __init__(self, prompt_text: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "fingerprint", "backend", "vocab_size", "boundary_tokens", "l1_disabled_reason", "has_chat_template", "shm_name", "model_dir", "default_mode")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    L1_DISABLED_REASON_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: str
    backend: str
    vocab_size: int
    boundary_tokens: int
    l1_disabled_reason: str
    has_chat_template: bool
    shm_name: str
    model_dir: str
    default_mode: str
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[str] = ..., backend: _Optional[str] = ..., vocab_size: _Optional[int] = ..., boundary_tokens: _Optional[int] = ..., l1_disabled_reason: _Optional[str] = ..., has_chat_template: _Optional[bool] = ..., shm_name: _Optional[str] = ..., model_dir: _Optional[str] = ..., default_mode: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class RecordOutputRequest(_message.Message):
    __slots__ = ("model", "cache_salt", "prompt_text", "prompt_token_ids", "output_text", "output_token_ids", "finish_reason", "stop_token_id", "stop_string", "prompt_add_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    cache_salt: str
    prompt_text: str
    prompt_token_ids: bytes
    output_text: str
    output_token_ids: bytes
    finish_reason: str
    stop_token_id: int
    stop_string: str
    prompt_add_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., cache_salt: _Optional[str] = ..., prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[bytes] = ..., output_text: _Optional[str] = ..., output_token_ids: _Optional[bytes] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., prompt_add_special_tokens: _Optional[bool] = ...) -> None: ...

class RecordOutputResponse(_message.Message):
    __slots__ = ("recorded_tokens", "stop_token_dropped", "entries")
    RECORDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_DROPPED_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    recorded_tokens: int
    stop_token_dropped: bool
    entries: int
    def __init__(self, recorded_tokens: _Optional[int] = ..., stop_token_dropped: _Optional[bool] = ..., entries: _Optional[int] = ...) -> None: ...

class RecordRefusal(_message.Message):
    __slots__ = ("index", "reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    reason: str
    def __init__(self, index: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RecordOutputsResponse(_message.Message):
    __slots__ = ("recorded", "refused", "refusals")
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    recorded: int
    refused: int
    refusals: _containers.RepeatedCompositeFieldContainer[RecordRefusal]
    def __init__(self, recorded: _Optional[int] = ..., refused: _Optional[int] = ..., refusals: _Optional[_Iterable[_Union[RecordRefusal, _Mapping]]] = ...) -> None: ...
