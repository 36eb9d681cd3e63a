"""The manifest region of the header page: opaque bytes the segment's owner publishes.

A reader that maps the segment needs facts the sidecar established about the tokenizer
(which encoder proved exact, which added tokens are safe boundaries, ...) before it can
decide lookups itself. The store does not interpret them: it keeps one checked blob per
segment, written under the writer lock, read lock-free with a sequence lock (the
sequence word is odd while a write is in progress; a reader that sees it change, or a
check that fails, gets None and may retry).
"""

from __future__ import annotations

import mmap

from ._layout import MANIFEST_HEAD, MANIFEST_MAX, MANIFEST_OFF, check_of

__all__ = ["MANIFEST_MAX", "read_manifest", "write_manifest"]

_BODY_OFF = MANIFEST_OFF + MANIFEST_HEAD.size


def write_manifest(mm: mmap.mmap, body: bytes) -> None:
    """Publish ``body`` (writer lock held). ValueError when it exceeds MANIFEST_MAX bytes."""
    if len(body) > MANIFEST_MAX:
        raise ValueError(f"manifest is {len(body)} bytes, the segment holds at most {MANIFEST_MAX}")
    seq = MANIFEST_HEAD.unpack_from(mm, MANIFEST_OFF)[0]
    seq = (seq | 1) + 2 if seq & 1 else seq + 1  # odd: being written
    mm[MANIFEST_OFF : MANIFEST_OFF + 8] = seq.to_bytes(8, "little")
    mm[_BODY_OFF : _BODY_OFF + len(body)] = body
    check = check_of(body)
    MANIFEST_HEAD.pack_into(mm, MANIFEST_OFF, seq, len(body), 0, check)
    mm[MANIFEST_OFF : MANIFEST_OFF + 8] = (seq + 1).to_bytes(8, "little")  # even: complete


def read_manifest(mm: mmap.mmap) -> bytes | None:
    """The published bytes, or None (never published, being rewritten, or corrupt)."""
    seq, length, _pad, check = MANIFEST_HEAD.unpack_from(mm, MANIFEST_OFF)
    if seq == 0 or seq & 1 or length > MANIFEST_MAX:
        return None
    body = mm[_BODY_OFF : _BODY_OFF + length]
    if check_of(body) != check:
        return None
    if MANIFEST_HEAD.unpack_from(mm, MANIFEST_OFF)[0] != seq:
        return None
    return bytes(body)
