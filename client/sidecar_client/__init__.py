"""Client for the tokcache sidecar.

    from sidecar_client import SidecarClient
    with SidecarClient("unix:///run/tokcache/tokcache.sock") as c:
        r = c.tokenize(model="qwen3", messages=[{"role": "user", "content": "hi"}],
                       add_generation_prompt=True)
        r.token_ids, r.decision.source

    import sidecar_client
    sidecar_client.tokenize(model="qwen3", text="hello")   # address from $TOKCACHE_ADDRESS
"""

from __future__ import annotations

import threading
from typing import Any

from sidecar_client._async import AsyncSidecarClient
from sidecar_client._core import ADDRESS_ENV
from sidecar_client._models import CacheDecision, ModelInfo, RecordResult, RecordSummary, TokenizeResult
from sidecar_client._stream import OutputAssembler
from sidecar_client._sync import SidecarClient
from sidecar_client.errors import (
    DeadlineExceeded,
    InvalidArgumentError,
    ResourceExhaustedError,
    SidecarInternalError,
    SidecarUnavailable,
    TokcacheError,
    UnknownModelError,
)

__all__ = [
    "ADDRESS_ENV",
    "AsyncSidecarClient",
    "CacheDecision",
    "DeadlineExceeded",
    "InvalidArgumentError",
    "ModelInfo",
    "OutputAssembler",
    "RecordResult",
    "RecordSummary",
    "ResourceExhaustedError",
    "SidecarClient",
    "SidecarInternalError",
    "SidecarUnavailable",
    "TokcacheError",
    "TokenizeResult",
    "UnknownModelError",
    "record_output",
    "render",
    "tokenize",
]

# The module-level functions share one client per address ($TOKCACHE_ADDRESS
# read at call time), created lazily; the lock guards the dict.
_clients: dict[str, SidecarClient] = {}
_clients_lock = threading.Lock()


def _default_client() -> SidecarClient:
    from sidecar_client._core import default_address

    address = default_address()
    with _clients_lock:
        client = _clients.get(address)
        if client is None:
            client = _clients[address] = SidecarClient(address)
        return client


def tokenize(model: str, **kwargs: Any) -> TokenizeResult:
    """:meth:`SidecarClient.tokenize` on a shared client for ``$TOKCACHE_ADDRESS``."""
    return _default_client().tokenize(model, **kwargs)


def render(model: str, messages: Any, **kwargs: Any) -> str:
    """:meth:`SidecarClient.render` on a shared client for ``$TOKCACHE_ADDRESS``."""
    return _default_client().render(model, messages, **kwargs)


def record_output(model: str, **kwargs: Any) -> RecordResult:
    """:meth:`SidecarClient.record_output` on a shared client for ``$TOKCACHE_ADDRESS``."""
    return _default_client().record_output(model, **kwargs)
