"""Recent Tokenize results a client keeps, so requests and replies can be deltas.

The next turn of a conversation extends the text of the turn before and
shares almost all its ids. The client names results it holds for the same
conversation: a text it extends (``text_base``, the request then carries only
the new text) and candidates for the reply (``known_results``, the sidecar
then sends only the ids past the longest shared prefix, and the client builds
the ``list[int]`` from int objects it already has). Each saves ~60 KB on the
socket and the work of packing and unpacking it.

Results are kept as tuples, never as the lists handed to callers: a caller
may mutate its list, which must not change what a later delta is built on.
Grouping is a guess at "same conversation" (model, salt, mode, special tokens
and the first 256 characters of the prompt or first message); a wrong guess
costs nothing but the delta.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ResultCache", "group_of"]

MAX_RESULTS = 32
MAX_IDS = 1 << 20  # ids held in all (~8 MB of references on 64-bit)
OFFER = 4  # handles offered per request, newest first
MIN_TEXT_BASE = 1024  # characters: below this a request delta saves less than a retry risks
_HEAD = 256


def _message_head(m: object) -> tuple[str | None, str] | None:
    if not isinstance(m, dict):
        return None
    role, content = dict.get(m, "role"), dict.get(m, "content")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        content = dict.get(content[0], "text")
    return (role if isinstance(role, str) else None,
            content[:_HEAD] if isinstance(content, str) else type(content).__name__)


def group_of(model: str, text: str | None, messages: Sequence[Mapping[str, Any]] | None, salt: str | None,
             mode: str | None, add_special_tokens: bool | None) -> int | None:
    """The conversation a request probably belongs to, or None to skip deltas.

    Total: it runs before the arguments are validated, so it reads only values of
    the builtin types it expects and gives None for anything else (validation then
    says what is wrong); it never raises.
    """
    if not isinstance(model, str) or not (salt is None or isinstance(salt, str)) \
            or not (mode is None or isinstance(mode, str)) \
            or not (add_special_tokens is None or isinstance(add_special_tokens, bool)):
        return None
    if isinstance(text, str):
        head: Any = text[:_HEAD]
    elif text is not None:
        return None
    elif isinstance(messages, (list, tuple)) and messages:
        first = _message_head(messages[0])
        if first is None:
            return None
        head = (first, len(messages) > 1 and _message_head(messages[1]))
    else:
        return None
    return hash((model, salt or "", mode, add_special_tokens, head))


class ResultCache:
    """Handle -> ids tuple, newest last, grouped; thread-safe."""

    def __init__(self, max_results: int = MAX_RESULTS, max_ids: int = MAX_IDS, *, reply_deltas: bool = True,
                 request_deltas: bool = True) -> None:
        # Each delta can be switched off (the benchmark measures them on and off).
        self.reply_deltas = reply_deltas
        self.request_deltas = request_deltas
        self._max_results = max_results
        self._max_ids = max_ids
        self._ids = 0
        # handle -> (group, ids, the request's text or None)
        self._entries: OrderedDict[bytes, tuple[int | None, tuple[int, ...], str | None]] = OrderedDict()
        self._lock = threading.Lock()

    def offer(self, group: int | None) -> dict[bytes, tuple[int, ...]]:
        """Up to OFFER results of ``group``, newest first: send their handles, keep the
        mapping to rebuild a delta reply (it stays valid whatever is evicted meanwhile)."""
        if group is None or not self.reply_deltas:
            return {}
        out: dict[bytes, tuple[int, ...]] = {}
        with self._lock:
            for handle in reversed(self._entries):
                g, ids, _ = self._entries[handle]
                if g == group:
                    out[handle] = ids
                    if len(out) == OFFER:
                        break
        return out

    def text_base(self, group: int | None, text: str) -> tuple[bytes, int]:
        """(handle, length) of the longest kept text of ``group`` that ``text`` extends
        (at least MIN_TEXT_BASE characters), or (b"", 0)."""
        if group is None or not self.request_deltas:
            return b"", 0
        with self._lock:
            candidates = [(len(t), h, t) for h, (g, _, t) in self._entries.items()
                          if g == group and t is not None and MIN_TEXT_BASE <= len(t) < len(text)]
        # Longest first: the first that is a prefix wins, usually after one compare.
        for n, handle, kept in sorted(candidates, key=lambda c: c[0], reverse=True):
            if text.startswith(kept):
                return handle, n
        return b"", 0

    def add(self, group: int | None, handle: bytes, ids: Sequence[int], text: str | None = None) -> None:
        """Keep ``ids`` (copied to a tuple) and the request's ``text`` under the server's ``handle``."""
        if group is None or not handle or len(ids) > self._max_ids:
            return
        kept = tuple(ids)
        with self._lock:
            self._entries[handle] = (group, kept, text)
            self._ids += len(kept)
            while len(self._entries) > self._max_results or self._ids > self._max_ids:
                _, (_, dropped, _) = self._entries.popitem(last=False)
                self._ids -= len(dropped)

    def forget(self, handle: bytes) -> None:
        """Drop a result the sidecar no longer holds."""
        with self._lock:
            entry = self._entries.pop(handle, None)
            if entry is not None:
                self._ids -= len(entry[1])

    def __len__(self) -> int:
        return len(self._entries)
