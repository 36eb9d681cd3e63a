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

When a recorded output applies, the next turn's prefix is that record's chain (the prompt's
ids, then the generated ones): once the record is stored, the process that recorded it offers
a head under the record's AR key (:meth:`Heads.offer_key`: how to read the chain), the
write-behind reads the chain (into the reader's memo) and copies it between requests, and the
turn whose prefix AR hit is that key takes it (:meth:`Heads.take_key`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic

from tokcache.engine.boundaries import Scan
from tokcache.engine.ids import IdFormat, Ids, Out

__all__ = ["HEAD_IDS", "Heads", "Ready"]

# Ids all heads of a process hold at most (8 bytes of list each: 32 MiB); the oldest go first.
HEAD_IDS = 1 << 22
# Heads offered and not built yet, at most (the oldest are forgotten).
PENDING = 256
# Built heads at most (one per conversation in flight; each keeps its scan, the text, alive).
MAX_HEADS = 64
# After a turn found its head offered but not built (the process is busy: its write-behind
# does not get to run between a conversation's turns), this many offers are declined: a
# saturated process copies each turn's ids once, in the request, not also in the background.
BACKOFF = 64


@dataclass(slots=True)
class Ready(Generic[Ids]):
    """A head to build after the reply: ``full[:tokens]`` are the canonical ids of
    ``scan``'s text before byte ``cut``, its last stable cut."""

    scan: Scan
    cut: int
    full: Ids
    tokens: int


class Heads(Generic[Ids, Out]):
    """Heads by the scan they continue: offered (a request's :class:`Ready`, nothing copied),
    built (:meth:`build_pending`, after the reply), taken (the next turn). Built heads past
    ``budget`` ids or MAX_HEADS heads are dropped oldest first, and a head whose text was
    superseded without taking it (its next turn went another way) when the next one is
    built: a head keeps its scan (the text) alive. Thread-safe."""

    def __init__(self, fmt: IdFormat[Ids, Out], budget: int = HEAD_IDS) -> None:
        self._fmt: IdFormat[Ids, Out] = fmt
        self._budget = budget
        self._heads: OrderedDict[Scan, tuple[int, int, Out]] = OrderedDict()  # scan -> (cut, tokens, head)
        self._ids = 0  # ids held in all
        self._pending: dict[Scan, Ready[Ids]] = {}
        # AR key -> (0, tokens, head): heads of recorded outputs' chains (see build_key), newest
        # last; and the ones offered, not built yet: AR key -> how to read its chain.
        self._keyed: OrderedDict[bytes, tuple[int, int, Out]] = OrderedDict()
        self._pending_keys: dict[bytes, Callable[[], tuple[Ids, int] | None]] = {}
        self._building = 0  # build_pending calls under way (what they took is not built yet)
        self._declining = 0  # offers left to decline (see BACKOFF)
        self._offered_at = 0.0  # time.monotonic() of the last offer
        self.enabled = True  # False: every offer is declined (a benchmark's on/off switch)
        self._lock = threading.Lock()
        self.built = 0  # heads built, and taken and used by a request (stats)
        self.used = 0

    @property
    def pending(self) -> bool:
        """Whether heads were offered and not built yet (taken by a build still under way
        counts: its chain reads are not done)."""
        return self.offered or self._building > 0

    @property
    def offered(self) -> bool:
        """Whether offers wait for a build to take them (what the write-behind acts on; a
        build under way in another thread is not work for it: see :attr:`pending`)."""
        return bool(self._pending) or bool(self._pending_keys)

    def offer(self, ready: Ready[Ids]) -> bool:
        """Note a head to build after the reply (the request path: no copy here); False when
        declined (see BACKOFF)."""
        return self._note(self._pending, ready.scan, ready)

    def _note(self, pending: dict[Any, Any], k: object, v: object) -> bool:
        """An offer into ``pending`` (oldest forgotten past PENDING); False when declined."""
        if not self.enabled:
            return False
        if self._declining:
            self._declining -= 1  # unlocked: a lost decrement declines one offer more
            return False
        with self._lock:
            self._offered_at = time.monotonic()
            pending[k] = v
            if len(pending) > PENDING:
                del pending[next(iter(pending))]
        return True

    def quiet_in(self, quiet_s: float) -> float:
        """Seconds until no head was offered for ``quiet_s`` (<= 0: now): the write-behind
        builds heads once requests pause (between a conversation's turns), not while they
        keep coming (a busy process would only trade its GIL back and forth for them)."""
        return self._offered_at + quiet_s - time.monotonic()

    def offer_key(self, key: bytes, load: Callable[[], tuple[Ids, int] | None]) -> bool:
        """Note a head to build under AR key ``key`` after its record was stored: ``load()``
        reads the chain, (container, tokens) or None (no copy here); False when declined."""
        return self._note(self._pending_keys, key, load)

    def build_pending(self) -> None:
        """Build the heads offered so far (the write-behind, between requests). A chain that
        cannot be read (evicted meanwhile) makes no head; ``load`` may raise (a store
        error): that head is not built, the others are."""
        with self._lock:
            todo, self._pending = self._pending, {}
            keys, self._pending_keys = self._pending_keys, {}
            self._building += 1
        try:
            for ready in todo.values():
                self.build(ready)
            for key, load in keys.items():
                try:
                    got = load()
                except Exception:  # noqa: BLE001 - a head is an optimisation: the request reads the chain itself
                    got = None
                if got is not None:
                    self.build_key(key, got[0], got[1])
        finally:
            with self._lock:
                self._building -= 1

    def build(self, ready: Ready[Ids]) -> None:
        """Copy ``ready``'s ids into a head of their own (off the request path), unless a
        text extending ``ready.scan`` came first: that turn is served, and no other will
        take this head (copying it would be wasted work, which is all a busy process does)."""
        if ready.tokens > self._budget or ready.scan.superseded:
            return
        head = self._fmt.head(ready.full, ready.tokens)
        with self._lock:
            if ready.scan.superseded:
                return
            heads = self._heads
            for gone in [s for s in heads if s.superseded or s is ready.scan]:
                self._ids -= heads.pop(gone)[1]
            heads[ready.scan] = (ready.cut, ready.tokens, head)
            self._ids += ready.tokens
            self.built += 1
            while heads and (self._ids > self._budget or len(heads) > MAX_HEADS):
                self._ids -= heads.popitem(last=False)[1][1]

    def take(self, scan: Scan, cut: int, tokens: int) -> Out | None:
        """The head of ``scan``'s text up to byte ``cut`` holding ``tokens`` ids, now the
        caller's (no one else gets it), or None."""
        return self._take(self._heads, self._pending, scan, cut, tokens)

    def _take(self, heads: OrderedDict[Any, tuple[int, int, Out]], pending: dict[Any, Any], k: object, cut: int,
              tokens: int) -> Out | None:
        """Pop ``k``'s head from ``heads`` (its offer from ``pending``: not built in time, the
        process is busy, so offers are declined for a while); return it if its cut and length match, else None."""
        with self._lock:
            if pending.pop(k, None) is not None:
                self._declining = BACKOFF
            got = heads.pop(k, None)
            if got is None:
                return None
            self._ids -= got[1]
            if got[0] != cut or got[1] != tokens:
                return None
            self.used += 1
        return got[2]

    def build_key(self, key: bytes, full: Ids, tokens: int) -> None:
        """Copy ``full[:tokens]`` (the chain of the AR record ``key``) into a head for the turn
        whose prefix AR hit is ``key`` (off the request path: after the record was stored)."""
        if not self.enabled or tokens > self._budget:
            return
        head = self._fmt.head(full, tokens)
        with self._lock:
            keyed = self._keyed
            old = keyed.pop(key, None)
            if old is not None:
                self._ids -= old[1]
            keyed[key] = (0, tokens, head)
            self._ids += tokens
            self.built += 1
            while keyed and (self._ids > self._budget or len(keyed) > MAX_HEADS):
                self._ids -= keyed.popitem(last=False)[1][1]

    def take_key(self, key: bytes, tokens: int) -> Out | None:
        """The head built for AR key ``key`` holding ``tokens`` ids, now the caller's, or None."""
        if not self._keyed and not self._pending_keys:
            return None
        return self._take(self._keyed, self._pending_keys, key, 0, tokens)

    def __len__(self) -> int:
        return len(self._heads) + len(self._keyed)
