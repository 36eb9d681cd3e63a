"""tokcache sidecar: a per-node tokenization server with a shared-memory token cache.

The server side. Clients use :mod:`sidecar_client`; the API is
``proto/tokcache/v1``. Run it with ``tokcache-sidecar serve``.
"""

from __future__ import annotations

from tokcache.sidecar.config import Config, ConfigError, ModelSpec, load_config

__all__ = ["Config", "ConfigError", "ModelSpec", "load_config"]
from tokcache import __version__ as __version__
