"""Names of segments: ``/<prefix>-<fingerprint>``."""

from __future__ import annotations

import re
from typing import Final

__all__ = ["segment_name"]

_PREFIX_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_FINGERPRINT_RE: Final = re.compile(r"[0-9a-fA-F]{32}")


def segment_name(prefix: str, fingerprint: str) -> str:
    """The POSIX shm name ``/<prefix>-<fingerprint>`` (fingerprint lower-cased).

    ``prefix``: 1-128 of ``[A-Za-z0-9._-]``, not starting with ``.``, ``_`` or ``-``.
    ``fingerprint``: 32 hex digits. Raises ValueError otherwise.
    """
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"prefix must match {_PREFIX_RE.pattern}, got {prefix!r}")
    if not _FINGERPRINT_RE.fullmatch(fingerprint):
        raise ValueError(f"fingerprint must be 32 hex digits, got {fingerprint!r}")
    return f"/{prefix}-{fingerprint.lower()}"
