"""Errors raised by the client. ``grpc.RpcError`` never escapes; it is translated here.

::

    TokcacheError(Exception)                 .code (grpc.StatusCode or None), .details
    ├── SidecarUnavailable                   UNAVAILABLE, connection refused, sidecar loading
    ├── DeadlineExceeded                     DEADLINE_EXCEEDED
    ├── UnknownModelError                    NOT_FOUND
    ├── InvalidArgumentError                 INVALID_ARGUMENT (also raised before sending, .field set)
    ├── ResourceExhaustedError               RESOURCE_EXHAUSTED (request over a size limit)
    └── SidecarInternalError                 INTERNAL and anything else

``InvalidArgumentError.field`` is the path of the caller's own argument
(``messages[2].tool_calls[0].function``, ``records[1].stop_reason``), whether the
client refused the argument before sending or the sidecar refused it: the
sidecar's message starts with that path, and the proto names an older sidecar
uses (``chat.messages[0].role``, ``chat.tools_json``, ``stop_string``) are
renamed to the parameters they stand for.
"""

from __future__ import annotations

import re

import grpc

__all__ = [
    "DeadlineExceeded",
    "InvalidArgumentError",
    "ResourceExhaustedError",
    "SidecarInternalError",
    "SidecarUnavailable",
    "TokcacheError",
    "UnknownModelError",
    "from_status",
    "parameter_path",
    "translate",
]


class TokcacheError(Exception):
    """Base of all client errors."""

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        self.code = code


class SidecarUnavailable(TokcacheError):
    """The sidecar cannot be reached or is not ready; retrying later may work."""


class DeadlineExceeded(TokcacheError):
    """The call's deadline passed."""


class UnknownModelError(TokcacheError):
    """The sidecar does not serve the requested model."""


# A field path leading a sidecar message: name, then .name, [index] or ['key'] steps.
_FIELD_PATH = re.compile(r"""[A-Za-z_]\w*(?:\.\w+|\[(?:\d+|'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\])*""")
# Proto field paths and the parameter each stands for (longest first).
_PROTO_PREFIXES = (("chat.chat_template_kwargs_json", "chat_template_kwargs"), ("chat.tools_json", "tools"),
                   ("chat.messages", "messages"), ("chat", "messages"), ("stop_string", "stop_reason"),
                   ("stop_token_id", "stop_reason"))


def parameter_path(field: str) -> str:
    """A field as the caller named it: proto paths (``chat.messages[0].extra_json``) renamed."""
    for proto, param in _PROTO_PREFIXES:
        if field == proto or field.startswith((proto + ".", proto + "[")):
            field = param + field[len(proto):]
            break
    if field.startswith("messages["):
        if field.endswith(".extra_json"):  # the message's extra keys: the message itself
            field = field[: -len(".extra_json")]
        elif field.endswith(".function.arguments_json"):
            field = field[: -len("_json")]
    return field


class InvalidArgumentError(TokcacheError):
    """The request is malformed; ``field`` names the caller's argument (a path) when known.

    Without ``field``, the details of a sidecar status give it: ``"messages[0].role: is
    required"``; a proto path there is renamed (:func:`parameter_path`), in ``details`` too.
    """

    def __init__(self, details: str, code: grpc.StatusCode | None = None, field: str | None = None) -> None:
        if field is None:
            head, sep, rest = details.partition(": ")
            if sep and _FIELD_PATH.fullmatch(head):
                field = parameter_path(head)
                details = f"{field}: {rest}"
        super().__init__(details, code)
        self.field = field


class ResourceExhaustedError(TokcacheError):
    """The request exceeds a size limit of the sidecar."""


class SidecarInternalError(TokcacheError):
    """The sidecar failed unexpectedly (a bug; it keeps serving)."""


_BY_CODE: dict[grpc.StatusCode, type[TokcacheError]] = {
    grpc.StatusCode.UNAVAILABLE: SidecarUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.NOT_FOUND: UnknownModelError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
}


def translate(exc: grpc.RpcError) -> TokcacheError:
    """The client error for a failed call (raise it ``from exc``)."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    cls = _BY_CODE.get(code, SidecarInternalError) if code is not None else SidecarInternalError
    return cls(details, code)


def from_status(code_name: str, details: str) -> TokcacheError:
    """The client error for a status carried in a reply (a stream's error reply)."""
    code = getattr(grpc.StatusCode, code_name, None)
    cls = _BY_CODE.get(code, SidecarInternalError) if isinstance(code, grpc.StatusCode) else SidecarInternalError
    return cls(details, code if isinstance(code, grpc.StatusCode) else None)
