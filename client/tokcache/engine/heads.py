"""Heads: the caller's list for a conversation's next turn, copied before that turn comes.

A client hands its caller a new ``list[int]`` per request (the caller owns it), and
copying a 57 KB conversation's 15k ids into one is ~65 µs of a ~350 µs read when the
process's caches are cold — the biggest single part of the request path left in Python.
But the next turn's ids start with this turn's, up to this turn's last stable cut: a
text that extends it keeps those ids (the cut is a safe boundary). So after the reply
(on the write-behind, while the model generates), the client copies them into a list of
their own — the *head* — and the next turn takes it, appends what it encoded, and hands
it over: the request path copies only the new ids.

Only canonical ids make a head, and only canonical ids take one: a head is built from,
and used by, requests that no recorded output can apply to (exact mode, or a segment that
never held an AR record: ``CacheView.holds_ar`` never turns false again). Their ids
are the text's plain encoding, so this turn's head is the next turn's prefix, value for
value; a head whose cut or length differs from what the taker expects is not used.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic

from tokcache.engine.boundaries import Scan
from tokcache.engine.ids import IdFormat, Ids, Out

__all__ = ["HEAD_IDS", "Heads", "Ready"]

# Ids all heads of a process hold at most (8 bytes of list each: 32 MiB); the oldest go first.
HEAD_IDS = 1 << 22


@dataclass(frozen=True)
class Ready(Generic[Ids]):
    """A head to build after the reply: ``full[:tokens]`` are the canonical ids of
    ``scan``'s text before byte ``cut``, its last stable cut."""

    scan: Scan
    cut: int
    full: Ids
    tokens: int


class Heads(Generic[Ids, Out]):
    """Built heads by the scan they continue, oldest dropped past ``budget`` ids. Thread-safe:
    :meth:`build` runs on the write-behind, :meth:`take` on requests."""

    def __init__(self, fmt: IdFormat[Ids, Out], budget: int = HEAD_IDS) -> None:
        self._fmt: IdFormat[Ids, Out] = fmt
        self._budget = budget
        self._heads: OrderedDict[Scan, tuple[int, int, Out]] = OrderedDict()  # scan -> (cut, tokens, head)
        self._ids = 0  # ids held in all
        self._lock = threading.Lock()
        self.built = 0  # heads built, and taken and used by a request (stats)
        self.used = 0

    def build(self, ready: Ready[Ids]) -> None:
        """Copy ``ready``'s ids into a head of their own (off the request path)."""
        if ready.tokens > self._budget:
            return
        head = self._fmt.result(ready.full, ready.tokens)
        with self._lock:
            old = self._heads.pop(ready.scan, None)
            if old is not None:
                self._ids -= old[1]
            self._heads[ready.scan] = (ready.cut, ready.tokens, head)
            self._ids += ready.tokens
            self.built += 1
            while self._ids > self._budget:
                self._ids -= self._heads.popitem(last=False)[1][1]

    def take(self, scan: Scan, cut: int, tokens: int) -> Out | None:
        """The head of ``scan``'s text up to byte ``cut`` holding ``tokens`` ids, now the
        caller's (no one else gets it), or None."""
        with self._lock:
            got = self._heads.pop(scan, None)
            if got is None:
                return None
            self._ids -= got[1]
            if got[0] != cut or got[1] != tokens:
                return None
            self.used += 1
        return got[2]

    def __len__(self) -> int:
        return len(self._heads)
