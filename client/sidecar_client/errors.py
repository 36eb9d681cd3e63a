"""Errors raised by the client. ``grpc.RpcError`` never escapes; it is translated here.

::

    TokcacheError(Exception)                 .code (grpc.StatusCode or None), .details
    ├── SidecarUnavailable                   UNAVAILABLE, connection refused, sidecar loading
    ├── DeadlineExceeded                     DEADLINE_EXCEEDED
    ├── UnknownModelError                    NOT_FOUND
    ├── InvalidArgumentError                 INVALID_ARGUMENT (also raised before sending, .field set)
    ├── ResourceExhaustedError               RESOURCE_EXHAUSTED (request over a size limit)
    ├── UnknownResultError                   FAILED_PRECONDITION (a text_base the sidecar no longer
    │                                        holds; the clients resend the whole text themselves)
    └── SidecarInternalError                 INTERNAL and anything else
"""

from __future__ import annotations

import grpc

__all__ = [
    "DeadlineExceeded",
    "InvalidArgumentError",
    "ResourceExhaustedError",
    "SidecarInternalError",
    "SidecarUnavailable",
    "TokcacheError",
    "UnknownModelError",
    "UnknownResultError",
    "from_status",
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


class InvalidArgumentError(TokcacheError):
    """The request is malformed; ``field`` names the part when known."""

    def __init__(self, details: str, code: grpc.StatusCode | None = None, field: str | None = None) -> None:
        super().__init__(details, code)
        if field is None and ": " in details:
            field = details.split(": ", 1)[0]
        self.field = field


class ResourceExhaustedError(TokcacheError):
    """The request exceeds a size limit of the sidecar."""


class UnknownResultError(TokcacheError):
    """A request delta (``text_base``) named a result the sidecar process does not hold."""


class SidecarInternalError(TokcacheError):
    """The sidecar failed unexpectedly (a bug; it keeps serving)."""


_BY_CODE: dict[grpc.StatusCode, type[TokcacheError]] = {
    grpc.StatusCode.UNAVAILABLE: SidecarUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.NOT_FOUND: UnknownModelError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: UnknownResultError,
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
