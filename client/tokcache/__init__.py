"""tokcache: what the sidecar and its clients share.

- :mod:`tokcache.v1` — the wire format (generated from ``proto/tokcache/v1``).
- :mod:`tokcache.store` — the shared-memory format: keys, segment layout, reader and writer.
- :mod:`tokcache.engine` — the read side: boundary scan, encoders, lookup (one decision-maker,
  run by the sidecar and by clients that read the segment in their own process).
- :mod:`tokcache.sidecar` — the server (installed from the ``sidecar/`` folder).

The public client is :mod:`sidecar_client`.
"""

__version__ = "0.2.0"
