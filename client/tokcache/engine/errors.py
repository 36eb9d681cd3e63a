"""Errors raised by the tokenization engine.

The hierarchy, and the gRPC status each maps to in the service layer::

    EngineError(Exception)
    ├── InvalidRequest(EngineError)        INVALID_ARGUMENT   "field: message"
    │   └── TemplateError(InvalidRequest)  INVALID_ARGUMENT   "messages: <template's text>"
    ├── RequestTooLarge(EngineError)       RESOURCE_EXHAUSTED "field: message (limit N)"
    └── UnknownModel(EngineError)          NOT_FOUND          "unknown model 'name'"

Every error names what was wrong so that the status message alone tells a
client which part of its request to fix. Foreign errors (jinja2, tokenizers)
are translated where they are caught and re-raised ``from`` the original.
"""

from __future__ import annotations

__all__ = [
    "EngineError",
    "InvalidRequest",
    "RequestTooLarge",
    "TemplateError",
    "UnknownModel",
]


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequest(EngineError):
    """The request is malformed; ``field`` is the dotted/indexed path of the bad part.

    ``str(err)`` is ``"field: message"``, the text the service puts in the
    INVALID_ARGUMENT status.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class TemplateError(InvalidRequest):
    """The chat template refused the conversation (``raise_exception``) or failed on it.

    ``message`` is the template's own text (or jinja's error), unchanged, so
    that it reads the same as transformers' ``jinja2.TemplateError``.
    """

    def __init__(self, message: str, field: str = "messages") -> None:
        super().__init__(field, message)


class RequestTooLarge(EngineError):
    """A part of the request exceeds a configured limit (maps to RESOURCE_EXHAUSTED)."""

    def __init__(self, field: str, limit: int, message: str | None = None) -> None:
        self.field = field
        self.limit = limit
        self.message = message if message is not None else f"exceeds the limit of {limit}"
        super().__init__(field, limit, self.message)

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class UnknownModel(EngineError):
    """The request names a model this sidecar does not serve (maps to NOT_FOUND)."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model

    def __str__(self) -> str:
        return f"unknown model {self.model!r}"
