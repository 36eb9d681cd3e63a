"""Tokenize in the caller's process: the sidecar's segment mapped read-only, the shared lookup.

The sidecar owns a POSIX shared-memory segment per tokenizer and publishes in it what a
reader needs (the encoder backend it proved exact, the safe boundary tokens, the
affixes: the *manifest*). A process on the same node maps that segment read-only, builds
the same :class:`~tokcache.engine.lookup.ReadModel` from its own copy of
``tokenizer.json`` (checked against the segment's fingerprint) and runs the same
:class:`~tokcache.engine.lookup.Lookup` the sidecar runs for ``Tokenize``: a hit costs
hashing, a few index probes, the chain records this process does not already hold, and
encoding the new tail — no RPC, no sidecar CPU, no deadline to miss.

What a read learned (the new prompt's entries) is stored after the reply by a background
writer (:class:`WriteBehind`): directly under the segment's writer lock when this process
may write the segment (a process that can map it writable could write anything into it
anyway, so this adds no trust), else by asking the sidecar to tokenize the text itself
(a ``Tokenize`` RPC whose reply nobody waits for). Recorded outputs (AR) are only ever
written by the sidecar, after it verified them.

Anything that makes the segment unusable here — another IPC namespace, no shared
``/dev/shm``, permissions, another layout or tokenizer, a manifest that cannot be used,
no local ``tokenizer.json`` — raises :class:`LocalUnavailable` with a reason label;
the client logs it once and uses the RPC path. A segment replaced under its name (a
sidecar restarted with another size) is noticed within ``recheck_s`` and re-attached.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from sidecar_client._fingerprint import find_tokenizer_json
from sidecar_client._models import TokenizeResult, local_result
from sidecar_client._telemetry import trace_local
from sidecar_client.errors import InvalidArgumentError, ResourceExhaustedError
from tokcache.engine.boundaries import Scan, extended
from tokcache.engine.errors import InvalidRequest, RequestTooLarge
from tokcache.engine.heads import Heads, Ready
from tokcache.engine.ids import LISTS, Chunks
from tokcache.engine.lookup import Later, Limits, Lookup, PendingWrite, ReadModel, Result, TierNeeded, commit
from tokcache.engine.memo import ChainMemo
from tokcache.engine.tokenizer import Manifest, ManifestMismatch, from_manifest
from tokcache.store import Kind, LockTimeout, SegmentError, SegmentMismatch, Store, StoreError, StoreReader
from tokcache.store._layout import RETIRED_MARK, W_RETIRED
from tokcache.store.keys import output_key, pending_key

__all__ = ["HOLD_MAX_BYTES", "HOLD_S", "MIN_WRITE_BYTES", "LocalModel", "LocalPaths", "LocalStats",
           "LocalUnavailable", "OpenJob", "RecordPending", "WriteBehind"]

log = logging.getLogger("sidecar_client.local")

RECHECK_S = 1.0  # how often a mapping is checked against the name (replaced?) and the manifest
WRITE_QUEUE = 256  # pending writes a process holds at most; more are dropped (counted)
# Past this many queued writes a request that stores its previous turn's also stores the
# oldest queued one. A process under sustained load never pauses, and its background thread
# then stores next to nothing: it gets the GIL mostly while a request is storing a write (the
# writer lock and fallocate release it), finds that store in progress, and waits a tick. So
# the writes no later request of the process extends (a conversation's latest turn, whose next
# turn comes once the model answered, maybe to another process) piled up to WRITE_QUEUE and
# were dropped past it, and every request compared its text with each of them (512
# conversations replayed back to back by one process: 78 µs of a 240 µs request). Stored here,
# they cost what the thread's store would, without its GIL hand-offs.
QUEUE_SOFT = 8
WAIT_RELATED_S = 0.05  # how long a request waits for its conversation's pending write
INLINE_LOCK_S = 0.01  # how long a request storing its previous turn's write waits for the writer lock
# The background writer looks for writes every tick while offers come (a process storing
# its own previous turn inline leaves it nothing to do), and parks after this many empty
# ticks: an idle process's write lands within a tick, a busy one's offers wake nothing.
# Every look costs the process more than its few µs of work: the thread needs the GIL, so
# the request thread hands it over and, on a busy node, waits for a core to give it back
# cold. bench/concurrency.py-style replay, 16 processes on 2 cores, client CPU per request
# (three runs each): tick 20 ms 263/259/264 µs, 100 ms 245/241/230, 1 s 241/229/228, no
# thread at all 226/233/223. A conversation's next turn stores its previous write itself
# (settle_related), so the tick only bounds how late another process sees it: well under a
# turn (a model's answer and the agent's tool call take longer). (A process busy with back to
# back requests looks less often: BUSY_LOOK_S.)
WRITER_TICK_S = 0.1
WRITER_PARK_TICKS = 10
# A read whose uncached tail is shorter than this many UTF-8 bytes stores nothing. This
# process re-encodes none of it (its next turn starts from its own previous encoding, see
# Lookup._canonical_tail); another process that gets the conversation's next turn encodes at
# most this much more (~6 µs per KB with fastokens). A write costs ~100-150 µs of this
# process's CPU and a writer-lock round, whoever stores it. bench/concurrency.py, 16 client
# processes x 57 KB chats on 2 cores, CPU per request: 4096 -> 382-498 µs, 8192 -> 291-333,
# 16384 -> 298, 32768 -> 297 (one process: 220-274, 182-230, 198, 188). See the README.
MIN_WRITE_BYTES = 16384
# The same for a read that found nothing cached (capped by min_write_bytes): a conversation's
# first entries are stored sooner, so its next turns hit them through the native fast path
# (Lookup._extend) instead of missing through the Python one (57 KB chats, turns 2-10: 509 µs
# p50 at 16384 for every read, 408 with 4096).
MIN_FIRST_WRITE_BYTES = 4096
# A kv-stable write skipped for its size is kept (the last this many, per model) until its
# text's output is recorded: a RecordOutput chains the output's record to its prompt's, so the
# prompt is stored then anyway — by this process (LocalModel.store_for_record), whose memo then
# holds the chain its next turn's native lookup needs, rather than by the sidecar, which would
# tokenize the prompt again to store it. (57 KB chats with every output recorded: the native
# path served 113 of 320 reads when the sidecar stored the prompts, as its records' chains were
# not this process's.) Only once this process stored a prompt for its record: a process whose
# outputs are never recorded (a client that only tokenizes) keeps none, as each kept write, let
# go 64 requests later, cost its request ~14 µs of its 25 µs hand-off (bench/concurrency.py's
# replay, one process); the first record of a process finds none and its prompt is stored by
# the sidecar, as before.
KEPT_FOR_RECORD = 64
# The background thread builds heads (tokcache.engine.heads), and settles reads' bookkeeping
# (Settler), once no request offered one for this long. While requests keep coming (a look
# finds the last one younger than that), it looks twice as late each time, up to BUSY_LOOK_S:
# back to back, the requests settle their own bookkeeping, and a look every HEADS_QUIET_S
# would cost the GIL hand-off above ~500 times a second.
HEADS_QUIET_S = 0.002
# The longest such wait: while requests keep coming, the thread looks once a second (not once a
# tick), as a conversation's next turn stores its predecessor's write itself (settle_related),
# more than QUEUE_SOFT queued writes are stored by requests, and a pause is found at most this
# late (then the waits start over at HEADS_QUIET_S: paced requests are settled in each pause).
# bench/concurrency.py-style replay, 16 processes x 512 57 KB chats on 2 cores, client CPU per
# request, five interleaved pairs: looks capped at the tick (0.1 s) 310 / 239 / 284 / 259 / 265 µs,
# at 1 s 292 / 233 / 255 / 243 / 298 (medians 265 / 255; voluntary context switches a request
# 0.16-0.19 -> 0.12-0.15). The same wait in C without the GIL (looks every 2-32 ms, the GIL
# once a second) measured no better, and was not kept.
BUSY_LOOK_S = 1.0
# A write that continues a conversation (something of its text was cached) is held this long
# before it is queued, and dropped if a later turn of the conversation read in this process
# writes first: that write covers its entries (its text extends this one's, and what this
# one would have stored is not in the segment, so the later read's uncached tail holds it).
# Only this process needs nothing stored to serve the conversation's next turn (its memo
# holds the scan and the encoding), so a write is for another process (or a restart) that
# gets a later turn. That turn comes after the model answered (prefill, decode, the agent's
# tool call): a conversation whose turns this process serves faster than HOLD_S is stored
# once it pauses. bench/concurrency.py replays each conversation's turns back to back (no
# model in the loop): 16 processes on 2 cores, client CPU per request against fastokens+seg's
# (three rounds each), every write stored 1.74x, none but first writes 1.49x, held 1.50x (a
# conversation's first and last write stored). A turn that comes in another process within
# HOLD_S encodes what the held write would have stored (at most HOLD_MAX_BYTES), with the same
# ids. A write whose conversation's first entries are not stored yet (nothing cached) is never
# held: its next turns' native lookup needs a stored hit (Lookup._extend).
HOLD_S = 0.25
# A write with this many uncached bytes or more is queued at once: the stored hit stays
# within the native lookup's window of keyed cuts (TAIL_PROBES x KEY_GRID = 128 KiB), and a
# turn taken over by another process encodes at most this much more.
HOLD_MAX_BYTES = 65536
# Held writes a process keeps at most (one per conversation it serves); the oldest is queued
# past it. A held write's ids are its conversation's latest encoding, which the memo keeps too.
HOLD_MAX_WRITES = 1024
# Kept writes are filed under their text's length and last this many characters (and the
# salt), the text compared when taken: a key with the whole text hashed all of it, once per
# request (a fresh str), ~20 us for a 57 KB prompt: 9.7% of a back-to-back replay's samples.
KEPT_KEY_CHARS = 256


class RecordPending(Exception):  # a signal to the client, not an error
    """The read's text continues a recorded output that is on its way (see tokcache.engine.lookup.PENDING_WAIT_S):
    ask again shortly, with ``may_wait`` False once done waiting."""


class LocalUnavailable(Exception):
    """The in-process path cannot be used for a model; ``reason`` is a short label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class LocalStats:
    """What the in-process path did, since the client was made (label values as keys).

    - ``tokenize``: requests answered in-process, by decision source (miss, l0, l1, ar)
    - ``fallbacks``: requests sent over RPC instead, by reason (no_segment, ..., tier: the
      sidecar has a cluster tier and no recorded output applied here)
    - ``pending``: reads that waited for a recorded output marked as on its way (``waited``:
      served with it, ``gave_up``: served without it after PENDING_WAIT_S), and marks put
      (``marked``, ``withdrawn``) or not (``mark_failed``: a read-only mapping, a busy lock)
    - ``writes``: write-behind outcomes: stored, refused (parent gone, full), learned
      (sent to the sidecar to store), dropped (queue full), failed (store or RPC error),
      skipped (the uncached tail was under ``min_write_bytes``, or MIN_FIRST_WRITE_BYTES when
      nothing was cached: another process's next turn encodes it again, this one's does not)
      and for_record (one of those stored after all, when an output was recorded for its text),
      superseded (a held write dropped, see HOLD_S: a later turn of its conversation wrote first,
      and that write holds its entries)
      and records_held (not a write: an output the sidecar recorded whose chain this process then
      offered to read and copy between turns, for the turn that continues it)
    - ``paths``: requests answered in-process by the path that served them: ``native`` (the
      fast path: the text extends one this process read lately, see
      ``tokcache.engine.lookup.Lookup._extend``) or ``python`` (every other one; the same ids,
      more CPU)
    - ``declines``: the ``python`` ones by why the fast path left them to it
      (``tokcache.engine.lookup._DECLINED``: ``no_base`` for a first turn or a conversation
      another process served last, ``l0`` for a text cached whole, ...)
    """

    tokenize: Counter[str] = field(default_factory=Counter)
    fallbacks: Counter[str] = field(default_factory=Counter)
    writes: Counter[str] = field(default_factory=Counter)
    pending: Counter[str] = field(default_factory=Counter)
    paths: Counter[str] = field(default_factory=Counter)
    declines: Counter[str] = field(default_factory=Counter)

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"tokenize": dict(self.tokenize), "fallbacks": dict(self.fallbacks), "writes": dict(self.writes),
                "pending": dict(self.pending), "paths": dict(self.paths), "declines": dict(self.declines)}


Learn = Callable[[str, str, str, str], None]
"""learn(model, text, salt, mode): ask the sidecar to tokenize (and so store) ``text``; must not block long."""


@dataclass(slots=True, eq=False)  # identity: the queue removes *this* write (list.remove compared fields)
class _Pending:
    """One offered write; ``state``: 0 queued, 1 being written, 2 done."""

    write: PendingWrite[Chunks]
    text: str
    salt: str
    mode: str
    state: int = 0
    due: float = 0.0  # a held write: when it is queued (time.monotonic(); see HOLD_S)


HandOff = Callable[["PendingWrite[Chunks] | None", "Ready[Chunks] | None", str, str, str, Scan, "Scan | None"],
                   None]
"""hand_off(write, ready, text, salt, mode, line, base_line): queue what a settled read made
(LocalModel._hand_off); ``line``: its text's line of extensions (``Scan.line_root``), ``base_line``:
that of the text it extends (None: none)."""


class Settler:
    """Reads' bookkeeping (``Result.later``: see ``Lookup.settle``), after their reply.

    A read returns its ids first; filing its scan for the next turn, remembering its
    encoding and making its write and head wait here (~40 µs warm, ~100 µs when the caller's
    caches are cold, measured on 57 KB chats). They are settled in the order queued, each
    once, by whoever comes first: the write-behind's thread once requests pause (between a
    conversation's turns), else the next request before its lookup (which extends what they
    file), else :meth:`WriteBehind.flush`. Thread-safe.
    """

    def __init__(self, settle: Callable[[Later[Chunks]], tuple[PendingWrite[Chunks] | None, Ready[Chunks] | None]],
                 hand_off: HandOff) -> None:
        self._settle = settle
        self._hand_off = hand_off
        self._items: deque[tuple[Later[Chunks], str, str, str]] = deque()
        self._lock = threading.Lock()  # held while settling: one at a time, in order

    @property
    def pending(self) -> bool:
        """True while a read's bookkeeping waits (or is being settled)."""
        return bool(self._items)

    def add(self, later: Later[Chunks], text: str, salt: str, mode: str) -> None:
        """Queue a read's bookkeeping (its request noted itself: WriteBehind.note_request)."""
        self._items.append((later, text, salt, mode))

    def run(self) -> None:
        """Settle everything queued, in order. Never raises."""
        with self._lock:
            while self._items:
                later, text, salt, mode = self._items[0]
                try:
                    scan = later.scan
                    base = scan.base  # (settling lets it go)
                    write, ready = self._settle(later)
                    self._hand_off(write, ready, text, salt, mode, scan.line_root,
                                   base.line_root if base is not None else None)
                except Exception:  # never let bookkeeping end a thread or fail a request
                    log.exception("tokcache: settling a read failed")
                finally:
                    self._items.popleft()


def _kept_key(text: str, salt: str) -> tuple[int, str, str]:
    """The key a kept write of ``text`` is filed under (see KEPT_KEY_CHARS). Texts that share
    it replace each other: the one replaced is stored by the sidecar when recorded, as before."""
    return len(text), text[-KEPT_KEY_CHARS:], salt


class WriteBehind:
    """Stores what reads learned, after their reply; bounded; never raises.

    A write that continues a conversation is held first (:meth:`hold`, see HOLD_S): queued
    once due, unless the conversation's next read in this process writes first and
    :meth:`supersede` drops it. Who stores a queued write (``direct``: into the segment under
    its writer lock; else ``learn`` sends the text to the sidecar):

    - the next request of this process whose text extends it, right before its own lookup
      (:meth:`settle_related`: read your writes). Back to back, a conversation's turn then
      costs its read and the previous turn's write in one thread: no thread switch, no
      wait for a thread that needs the GIL the caller holds;
    - a request that finds a held write due (:meth:`release_due`), before its lookup;
    - else the background thread, which gets the GIL when the process is idle (while requests
      come, it leaves due held writes to them for BUSY_LOOK_S);
    - else :meth:`flush` / :meth:`close`.

    Writes of one conversation land in the order offered (a turn's record chains to the
    previous turn's), whoever stores them. Writes are made by settling reads (the attached
    :class:`Settler`): the background thread and :meth:`flush` settle what is queued there
    before storing, so a flush returns only once every read before it is stored (or was
    too short to store). Between writes, the background thread (and :meth:`flush`) builds
    the heads requests offered (``heads``: see :mod:`tokcache.engine.heads`); a request
    never does, nor waits for one.
    """

    def __init__(self, model: str, store: Store | None, memo: ChainMemo[Chunks], learn: Learn | None,
                 stats: LocalStats, bound: int = WRITE_QUEUE,
                 heads: Heads[Chunks, list[int]] | None = None) -> None:
        self._model = model
        self._store = store
        self._memo = memo
        self._learn = learn
        self._stats = stats
        self._bound = bound
        self.heads: Heads[Chunks, list[int]] = heads if heads is not None else Heads(LISTS)
        # Reads' bookkeeping, settled before the writes it makes (see attach).
        self.settler = Settler(lambda later: (None, None), lambda *args: None)
        # Held writes (see HOLD_S), by (line, salt, mode), oldest first (their due times ascend).
        self._held: OrderedDict[tuple[Scan, str, str], _Pending] = OrderedDict()
        # Guards _items (offered and not yet done, in offer order; their states), _held, _busy,
        # _thread, _parked and _closed. _done is notified when a store ends (waiters for a
        # write); _work wakes the background thread, only when it is parked.
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._work = threading.Condition(self._lock)
        self._items: list[_Pending] = []
        self._busy = False  # a write is being stored (by any thread): one at a time
        self._thread: threading.Thread | None = None
        self._parked = False  # the thread waits for an offer (else it looks every WRITER_TICK_S)
        self._closed = False
        self._stopped: list[Callable[[], None]] = []  # run once the background thread has ended
        self._request_at = 0.0  # time.monotonic() of the last request begun (see note_request)
        self._request_end = 0.0  # and of the last one ended (note_done)
        # The thread settled the last read's bookkeeping in a pause (no request did it inline):
        # requests come paced, and each one's read gets a look of its own (see settle_soon).
        self._paced = False

    def attach(self, settler: Settler) -> None:
        """Have the background thread and :meth:`flush` settle ``settler``'s reads too (before
        their writes, which settling makes)."""
        self.settler = settler

    @property
    def direct(self) -> bool:
        """True when writes go straight into the segment (else through the sidecar)."""
        return self._store is not None

    @property
    def idle(self) -> bool:
        """True when no write (nor read bookkeeping) is held, queued or in progress."""
        return not self._items and not self._held and not self.settler.pending

    def offer(self, write: PendingWrite[Chunks], text: str, salt: str, mode: str) -> bool:
        """Queue a write; False (counted as dropped) when the queue is full or closed."""
        with self._lock:
            if self._closed or (self._store is None and self._learn is None):
                self._stats.writes["dropped"] += 1
                return False
            if not self._queue(_Pending(write, text, salt, mode)):
                return False
            self._wake()
        return True

    def hold(self, write: PendingWrite[Chunks], text: str, salt: str, mode: str, line: Scan) -> bool:
        """Hold a write for HOLD_S, then queue it, unless a later turn of its conversation
        supersedes it first (:meth:`supersede`). ``line``: its text's line of extensions
        (``Scan.line_root``: a conversation, until a turn rewrites its history). False
        (counted as dropped) when closed or nothing can store it."""
        with self._lock:
            if self._closed or (self._store is None and self._learn is None):
                self._stats.writes["dropped"] += 1
                return False
            held = self._held
            key = (line, salt, mode)
            if held.pop(key, None) is not None:  # an earlier text of the line, read again after
                self._stats.writes["superseded"] += 1
            held[key] = _Pending(write, text, salt, mode, due=time.monotonic() + HOLD_S)
            if len(held) > HOLD_MAX_WRITES:
                self._queue(held.popitem(last=False)[1])
            self._wake()
        return True

    def supersede(self, line: Scan, salt: str, mode: str) -> None:
        """A read of a text extending one of ``line`` (the text it extends, or the line's root:
        a turn that rewrote the conversation's history) made a write: drop the line's held
        write. The new write holds its entries up to where the texts part; past there they
        are a history no later turn sends again."""
        if not self._held:
            return
        with self._lock:
            if self._held.pop((line, salt, mode), None) is not None:
                self._stats.writes["superseded"] += 1

    def take_held(self, text: str, salt: str) -> PendingWrite[Chunks] | None:
        """Remove and return the held write of ``text`` (None: none): an output is recorded for it."""
        if not self._held:
            return None
        with self._lock:
            for key, item in self._held.items():
                if item.salt == salt and len(item.text) == len(text) and item.text == text:
                    del self._held[key]
                    return item.write
        return None

    def release_due(self) -> None:
        """A request begins: queue the held writes that are due (see HOLD_S), and store the
        oldest queued write in this thread, as :meth:`settle_related` does past QUEUE_SOFT
        (while requests come, the background thread leaves due writes to them: see _loop)."""
        if not self._held:
            return
        now = time.monotonic()
        with self._lock:
            if next(iter(self._held.values())).due > now:
                return
            self._release(now)
        self._store_next(None, None, wait=False, lock_deadline=time.monotonic() + INLINE_LOCK_S)

    def _release(self, now: float) -> float:
        """Lock held: queue the held writes due by ``now`` (all of them: ``now`` inf), oldest
        first. Seconds until the next one is due (inf: none held)."""
        held = self._held
        while held:
            item = next(iter(held.values()))
            if item.due > now:
                return item.due - now
            held.popitem(last=False)
            self._queue(item)
        return math.inf

    def _queue(self, item: _Pending) -> bool:
        """Lock held: append a write to the queue; False (dropped, counted) when it is full."""
        if len(self._items) >= self._bound:
            self._stats.writes["dropped"] += 1
            return False
        self._items.append(item)
        return True

    def note_request(self) -> None:
        """Note that a request begins: bookkeeping and heads wait until it ended (note_done)
        and none began for HEADS_QUIET_S. (A single float store, no lock: the background thread
        only compares it.)"""
        self._request_at = time.monotonic()

    def note_done(self) -> None:
        """Note that the request begun last (note_request) ended, whatever its outcome."""
        self._request_end = time.monotonic()

    def _quiet_in(self, offered_left: float = 0.0) -> float:
        """Seconds until a pause (<= 0: now): no request begun for HEADS_QUIET_S and, for heads,
        none offered (``offered_left``: Heads.quiet_in; heads are also offered outside requests,
        by records and the background settling). Reads' bookkeeping is only queued by requests,
        so the request time is its own. Heads are not offered by every request: judged by offers
        alone, a "pause" came whenever a few requests offered none, and each cost a look and a
        GIL hand-off while requests kept coming (CI: 43 looks in a 1 s burst).

        A request still being served is no pause however long ago it began: with more busy
        processes than cores a process waits for a core for tens of ms in the middle of its
        requests, and judged by the start alone the thread took every such wait for a pause,
        woke, took the GIL from the request, and looked again every HEADS_QUIET_S after (the
        backoff starts over at a pause). bench/concurrency.py at P = 16 did not move
        measurably with it (client CPU per request 568 / 547 against 580 / 555 µs, 0.33-0.35
        voluntary context switches per request against 0.30-0.31): most of those are the
        thread's ticks (WRITER_TICK_S), ~0.24 per request at P = 16, where a process serves
        ~180 requests a second."""
        begun, ended = self._request_at, self._request_end
        if begun > ended:
            return max(offered_left, HEADS_QUIET_S)
        return max(offered_left, ended + HEADS_QUIET_S - time.monotonic())

    def poke(self) -> None:
        """Have the background thread build the heads offered (see :meth:`_wake`)."""
        with self._lock:
            if not self._closed:
                self._wake()

    def settle_soon(self) -> None:
        """A request queued its read's bookkeeping (Settler.add): have the background thread
        settle it in the pause after the request, when requests come paced, else as
        :meth:`poke`. Without it a thread not parked looks only at its tick (WRITER_TICK_S),
        and requests a few tens of ms apart mostly found the previous read unsettled and
        settled it inline first: 57 KB chats replayed by one process with ~30 ms of other work
        between turns and no flush, 64% of reads did, ~175 µs each with the caches the other
        work left cold (p50 658 µs; 462 µs with the wake). Paced means that the thread settled
        the last read (in a pause); under back-to-back load the next request settles it first
        (see :meth:`missed_pause`), and the wake, which would only take the GIL from a request
        and find no pause, is left out: at most one per pause the thread's own looks find. A
        caller that flushes between requests settles them itself (:meth:`flush` clears it):
        bench/multiturn_latency.py does, and with a wake after each call, woken into its flush
        and the calls after, its tokcache p50 was 1.25-1.37x fastokens+segment cache's
        against 1.04-1.07x without (two A/B pairs)."""
        with self._lock:
            if self._closed:
                return
            if self._paced and self._thread is not None and not self._parked:
                self._work.notify()
            else:
                self._wake()

    def missed_pause(self) -> None:
        """Note that a request settles a read before its own: requests come back to back, so
        settle_soon wakes the thread no more (until its own looks find a pause)."""
        self._paced = False

    def _wake(self) -> None:
        """Lock held: start the background thread, or wake it from a park. Woken only from a
        park: while requests keep coming it looks on its own every WRITER_TICK_S, and a
        request costs no wake-up (a futex call and a GIL hand-off inside the caller's request)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokcache-write-behind", daemon=True)
            self._thread.start()
        elif self._parked:
            self._work.notify()

    def skip(self) -> None:
        """Count a write not offered (its tail was short: see LocalModel._hand_off)."""
        self._stats.writes["skipped"] += 1

    def store_now(self, write: PendingWrite[Chunks], text: str, salt: str, mode: str) -> None:
        """Store a write that was skipped for its size, now, in this thread, because an output
        is recorded for its text (counted ``for_record``): only into the segment directly (a
        process that cannot write it leaves the prompt to the sidecar's RecordOutput, which
        stores it anyway); a writer lock busy past INLINE_LOCK_S queues it for the
        background thread instead. Its parent is stored (its read hit it), so it needs no
        queued write before it. Never raises."""
        if self._store is None:
            return
        try:
            done = self._write(write, text, salt, mode, INLINE_LOCK_S)
        except Exception:  # never let a write fail the caller
            log.exception("tokcache: storing a prompt for its record failed")
            self._stats.writes["failed"] += 1
            return
        if done:
            self._stats.writes["for_record"] += 1
        else:
            self.offer(write, text, salt, mode)

    def flush(self, timeout: float | None = None) -> bool:
        """Store every write offered so far (in this thread, where the background thread
        has not taken them); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._paced = False  # the caller settles between its requests (see settle_soon)
        self.settler.run()
        if self._held:
            with self._lock:
                self._release(math.inf)
        # The writer lock is waited for as long as the flush may take (no timeout: however
        # long it stays busy; a dead holder's is recovered, see tokcache.store._lock).
        lock_deadline = math.inf if deadline is None else deadline
        while (got := self._store_next(None, deadline, lock_deadline=lock_deadline)) is True:
            pass
        if got is False:
            return False
        self.heads.build_pending()
        with self._lock:
            return self._done.wait_for(lambda: not self._items, _left(deadline))

    def settle_related(self, text: str, timeout: float) -> bool:
        """Read your writes: store now, in this thread, the pending writes whose text is a
        prefix of ``text`` — the previous turns of this conversation, whose entries the
        lookup is about to search for — waiting (at most ``timeout``) for one being stored.
        Unrelated requests do nothing, unless more than QUEUE_SOFT writes are queued: then
        the oldest one is stored too, if no other thread is storing one. False on timeout."""
        if not self._items:
            return True
        deadline = time.monotonic() + timeout
        while True:  # each inline store waits INLINE_LOCK_S for the writer lock at most
            got = self._store_next(text, deadline, lock_deadline=min(deadline, time.monotonic() + INLINE_LOCK_S))
            if got is not True:
                break
        if len(self._items) > QUEUE_SOFT:
            self._store_next(None, None, wait=False, lock_deadline=time.monotonic() + INLINE_LOCK_S)
        return got is None

    def _store_next(self, text: str | None, deadline: float | None, *, wait: bool = True,
                    lock_deadline: float | None) -> bool | None:
        """Store the oldest queued write (whose text is a prefix of ``text``, if given) in
        this thread: True when one was stored, None when there is none (and, with ``text``,
        none related is being stored; without ``wait``: none can be taken now), False on timeout
        (``deadline`` passed waiting for one, or the writer lock not had by ``lock_deadline``:
        the write goes back to the queue, for the background thread).

        One write is stored at a time, oldest first: a conversation's writes land in the
        order offered, whoever stores them (each chains to the one before)."""
        with self._lock:
            while True:
                items = self._items
                related = items if text is None else [items[k] for k in extended(text, items, "text")]
                item = next((i for i in related if i.state == 0), None)
                if item is not None and not self._busy:
                    break
                if not related or not wait:
                    return None
                if not self._done.wait(_left(deadline)):
                    return False
            item.state = 1
            self._busy = True
        # Not stored when the writer lock stays busy (another process holds it, maybe waiting
        # for a core): the caller stops there. Counted as stored, a request retried the same
        # write every INLINE_LOCK_S past its own timeout, for as long as the lock stayed busy
        # (16 processes on 2 cores: requests of 170 ms and more where WAIT_RELATED_S is 50).
        return self._store_one(item, lock_timeout=_left(lock_deadline))

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._lock:
                self._thread = None
                stopped, self._stopped = self._stopped, []
            for fn in stopped:
                try:
                    fn()
                except Exception:  # never raise out of the thread
                    log.exception("tokcache: releasing the segment after the write-behind thread failed")

    def _loop(self) -> None:
        idle = 0
        backoff = HEADS_QUIET_S  # the shortest wait for a pause (see HEADS_QUIET_S)
        while True:
            settle = False
            item = None
            with self._lock:
                while True:
                    settler = self.settler
                    wait_s = WRITER_TICK_S
                    pause_in = math.inf  # a wait for a pause that has not come (see BUSY_LOOK_S)
                    if settler.pending:  # settled once requests pause, before writes (it makes them)
                        left = self._quiet_in()
                        if left <= 0:
                            settle = True
                            break
                        pause_in = max(left, backoff)
                    due_in = math.inf
                    if self._held:  # (see HOLD_S) while requests come, they store due writes (release_due)
                        busy = BUSY_LOOK_S if self._quiet_in() > 0 else 0.0
                        due_in = self._release(time.monotonic() - busy)
                    item = None if self._busy else next((i for i in self._items if i.state == 0), None)
                    if item is not None:
                        break
                    if self.heads.offered:  # built once requests pause (see Heads.quiet_in)
                        left = self._quiet_in(self.heads.quiet_in(HEADS_QUIET_S))
                        if left <= 0:
                            break
                        pause_in = min(pause_in, max(left, backoff))
                    if pause_in < math.inf:  # later next time
                        wait_s = pause_in
                        backoff = min(2 * backoff, BUSY_LOOK_S)
                    wait_s = min(wait_s, due_in)
                    if self._closed:
                        return
                    if (idle >= WRITER_PARK_TICKS and not self.heads.offered and not settler.pending
                            and not self._held):  # park
                        self._parked = True
                        self._work.wait()
                        self._parked = False
                        idle = 0
                    else:
                        self._work.wait(wait_s)
                        idle += 1
                if item is not None:
                    item.state = 1
                    self._busy = True
            idle = 0
            if item is None:  # a pause came: the next one is looked for soon again
                backoff = HEADS_QUIET_S
            if settle:
                self._paced = True
                self.settler.run()
            elif item is not None:
                self._store_one(item)
            else:
                self.heads.build_pending()

    def _store_one(self, item: _Pending, lock_timeout: float | None = None) -> bool:
        """Store one taken item (state 1), then mark it done (or queued again when the
        writer lock was not had within ``lock_timeout``: False). Never raises."""
        done = True
        try:
            done = self._write(item.write, item.text, item.salt, item.mode, lock_timeout)
        except Exception:  # never let one write end a thread or fail a request
            log.exception("tokcache: write-behind failed")
            self._stats.writes["failed"] += 1
        finally:
            with self._lock:
                self._busy = False
                if done:
                    item.state = 2
                    self._items.remove(item)
                else:
                    item.state = 0
                self._done.notify_all()
        return done

    def _write(self, write: PendingWrite[Chunks], text: str, salt: str, mode: str,
               lock_timeout: float | None) -> bool:
        """Store or learn one write; False when the writer lock was busy past ``lock_timeout``."""
        if self._store is not None:
            try:
                ref = commit(self._store, self._memo, write, lock_timeout=lock_timeout)
            except LockTimeout:
                if lock_timeout is None:
                    self._stats.writes["failed"] += 1
                    return True
                return False
            except StoreError as exc:
                self._stats.writes["failed"] += 1
                log.debug("tokcache: write-behind store error: %s", exc)
                return True
            self._stats.writes["stored" if ref is not None else "refused"] += 1
            return True
        assert self._learn is not None
        self._learn(self._model, text, salt, mode)
        self._stats.writes["learned"] += 1
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Write what is queued (at most ``timeout`` s), stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            thread = self._thread
        self.flush(timeout)
        with self._lock:
            self._closed = True
            self._work.notify_all()
        if thread is not None:
            thread.join(timeout)

    def when_stopped(self, release: Callable[[], None]) -> None:
        """Call ``release`` (unmap the segment, close its lock) once the background thread has
        ended: now if it has (or never ran), else from the thread as it ends. A thread still
        storing a write after :meth:`close` (the writer lock held elsewhere: it waits up to the
        store's lock timeout) would fault on an unmapped segment or a closed semaphore."""
        with self._lock:
            thread = self._thread
            if thread is not None and thread.is_alive():
                self._stopped.append(release)
                log.info("tokcache: model %s: the write-behind thread is still storing a write; "
                         "the segment is unmapped once it is done", self._model)
                return
        release()


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (None: no deadline), never negative, at most what a lock
    wait takes (a longer one raises OverflowError; a huge timeout is valid input)."""
    return None if deadline is None else min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX)


class LocalModel:
    """One model's in-process read path. Thread-safe; close when done.

    Create with :meth:`open`. :meth:`tokenize` returns None when the mapping went stale
    (the segment was replaced, or its manifest changed): the caller opens a new one.
    """

    def __init__(self, name: str, reader: StoreReader, manifest_raw: bytes, model: ReadModel, limits: Limits,
                 writer: WriteBehind, memo: ChainMemo[Chunks], writable: Store | None, *, tier: bool = False,
                 min_write_bytes: int = MIN_WRITE_BYTES) -> None:
        self.name = name
        # A read whose uncached tail is shorter stores nothing (see MIN_WRITE_BYTES); the
        # second, for a read that found nothing cached (MIN_FIRST_WRITE_BYTES).
        self.min_write_bytes = min_write_bytes
        self._first_write_bytes = min(min_write_bytes, MIN_FIRST_WRITE_BYTES)
        # The sidecar has a cluster tier (manifest): what no local AR applies to goes to it.
        self.tier = tier
        self.reader = reader
        self.model = model
        self.fingerprint = model.fingerprint
        self.backend = model.encoder.name
        self.memo = memo
        self.lookup: Lookup[Chunks, list[int]] = Lookup(model, reader, memo, limits, heads=writer.heads, defer=True)
        self.writer = writer
        self.settler = Settler(self.lookup.settle, self._hand_off)
        writer.attach(self.settler)
        self._writable = writable
        # _kept_key(text, salt) -> (text, kv-stable write skipped for its size), newest last (see
        # KEPT_FOR_RECORD and KEPT_KEY_CHARS).
        self._kept: OrderedDict[tuple[int, str, str], tuple[str, PendingWrite[Chunks]]] = OrderedDict()
        self._kept_lock = threading.Lock()
        self._keep_for_records = False  # set by the first store_for_record (see KEPT_FOR_RECORD)
        self._manifest_raw = manifest_raw
        self._words = reader._words  # the header words: W_RETIRED is checked on every request
        self._checked = time.monotonic()
        self._stale = False

    @classmethod
    def open(cls, name: str, shm_name: str, *, tokenizer_json: Path | None, fingerprint: str | None = None,
             writable: bool = True, learn: Learn | None = None, stats: LocalStats | None = None,
             encoder: Any = None, min_write_bytes: int = MIN_WRITE_BYTES) -> LocalModel:
        """Map ``shm_name`` and build the read path for model ``name``.

        ``tokenizer_json``: this process's copy of the tokenizer (its fingerprint must be
        the segment's). ``writable``: try to store learned entries directly (else through
        ``learn``). Raises LocalUnavailable with the reason.
        """
        stats = stats or LocalStats()
        if tokenizer_json is None:
            raise LocalUnavailable("no_tokenizer", f"model {name!r}: no local tokenizer.json to encode with "
                                                   "(pass tokenizers={...} to the client)")
        try:
            reader = StoreReader.attach_name(shm_name)
        except SegmentMismatch as exc:
            raise LocalUnavailable("segment_mismatch", f"segment {shm_name}: {exc}") from exc
        except (SegmentError, ValueError) as exc:
            raise LocalUnavailable("no_segment", f"segment {shm_name} cannot be mapped here: {exc}") from exc
        try:
            if fingerprint is not None and reader.fingerprint != fingerprint:
                raise LocalUnavailable("fingerprint", f"segment {shm_name} holds tokenizer {reader.fingerprint}, "
                                                      f"the sidecar's model {name!r} is {fingerprint}")
            raw = reader.manifest()
            if raw is None:
                raise LocalUnavailable("no_manifest", f"segment {shm_name} has no manifest (an older sidecar, or "
                                                      "it is still loading)")
            try:
                manifest = Manifest.from_bytes(raw)
                model = from_manifest(tokenizer_json, manifest, encoder=encoder)
            except ManifestMismatch as exc:
                raise LocalUnavailable("manifest", f"segment {shm_name}: {exc}") from exc
            except (OSError, ValueError) as exc:
                raise LocalUnavailable("tokenizer", f"model {name!r}: cannot load {tokenizer_json}: {exc}") from exc
            limits = Limits(max_text_bytes=manifest.max_text_bytes)
            memo: ChainMemo[Chunks] = ChainMemo(LISTS)
            store = None
            if writable:
                ttl = {Kind.L0: manifest.ttl.get("l0", 0.0), Kind.L1: manifest.ttl.get("l1", 0.0),
                       Kind.AR: manifest.ttl.get("ar", 0.0)}
                try:
                    store = Store.attach(shm_name, fingerprint=reader.fingerprint, ttl=ttl)
                except StoreError as exc:
                    log.info("tokcache: segment %s is not writable here (%s); learned entries go to the sidecar",
                             shm_name, exc)
            writer = WriteBehind(name, store, memo, learn, stats)
            return cls(name, reader, raw, model, limits, writer, memo, store, tier=manifest.ar_tier,
                       min_write_bytes=min_write_bytes)
        except BaseException:
            reader.close()
            raise

    @property
    def stale(self) -> bool:
        """True once the segment was replaced or its manifest changed (checked every RECHECK_S)."""
        if self._stale:
            return True
        if self._words[W_RETIRED] == RETIRED_MARK:
            self._stale = True
        else:
            now = time.monotonic()
            if now - self._checked >= RECHECK_S:
                self._checked = now
                self._stale = self.reader.replaced or self.reader.manifest() != self._manifest_raw
        return self._stale

    def tokenize(self, text: str, *, add_special_tokens: bool, salt: str, mode: str,
                 may_wait: bool = False) -> Result[Chunks, list[int]]:
        """Ids of ``text`` decided in this process (the caller checked :attr:`stale` first).

        ``may_wait``: raise RecordPending (nothing filed, nothing queued) when the text
        continues a recorded output marked as on its way, instead of serving it without it.

        Raises the engine's InvalidRequest / RequestTooLarge for bad input, like the RPC, and
        TierNeeded (before encoding) when the sidecar has a cluster tier and no recorded output
        applies here: only the sidecar can ask the tier, so the request is for it.
        The learned entries are queued for the write-behind before returning.
        """
        # Earlier reads' bookkeeping first (this request may extend what it files), then
        # the previous turn's entries, which may still be on their way to the segment: a
        # request that extends them stores them first (~0.1 ms of work) rather than missing them.
        writer = self.writer
        writer.note_request()
        try:
            if self.settler.pending:
                writer.missed_pause()
                self.settler.run()
            writer.release_due()
            if not writer.idle:
                writer.settle_related(text, WAIT_RELATED_S)
            result = self.lookup.tokenize(text, add_special_tokens=add_special_tokens, salt=salt, mode=mode,
                                          tier=self.tier)
            if may_wait and result.decision.ar_pending:
                raise RecordPending(self.name)  # its bookkeeping is dropped: as if never read
            if result.later is not None:
                self.settler.add(result.later, text, salt, mode)
                writer.settle_soon()
        finally:
            writer.note_done()
        return result

    def store_for_record(self, prompt_text: str, salt: str) -> None:
        """Store, in this thread, the write of ``prompt_text`` that was skipped for its size (see
        KEPT_FOR_RECORD), if kept: an output recorded for it chains to its entries. Reads not
        settled yet are settled first (this prompt's may be among them). Inline, as a request
        stores its previous turn's write: a thread hop here would hold the caller's response
        (vLLM's plugin holds it until the record is stored) for as long as a busy event loop
        lets a worker thread run. Never raises."""
        self._keep_for_records = True
        if self.settler.pending:
            self.settler.run()
        held = self.writer.take_held(prompt_text, salt)
        if held is not None:
            self.writer.store_now(held, prompt_text, salt, "kv-stable")
            return
        if not self._kept:
            return
        key = _kept_key(prompt_text, salt)
        with self._kept_lock:
            kept = self._kept.get(key)
            write = kept[1] if kept is not None and kept[0] == prompt_text else None
            if write is not None:
                del self._kept[key]
        if write is not None:
            self.writer.store_now(write, prompt_text, salt, "kv-stable")

    def hold_record(self, prompt_text: str, output_text: str, salt: str) -> bool:
        """After the sidecar stored the record of ``output_text`` after ``prompt_text``: have
        the write-behind read its chain into this process's memo and copy it into a head,
        between turns, so the turn that continues it (a prefix AR hit) reads and copies only
        its own tail. False when declined (a busy process). Never raises."""
        try:
            offered = self.lookup.hold(output_key(prompt_text, output_text, salt=salt))
        except (UnicodeEncodeError, ValueError) as exc:
            log.debug("tokcache: could not key a recorded output: %r", exc)
            return False
        if offered:
            self.writer.poke()
        return offered

    def mark(self, prompt_text: str, output_text: str, salt: str, expiry: int) -> bool:
        """Mark the record of ``output_text`` after ``prompt_text`` as on its way until ``expiry``
        (Unix seconds; 1 withdraws the mark). False when this process cannot write the
        segment or its lock stayed busy for INLINE_LOCK_S. Never raises for store trouble."""
        if self._writable is None:
            return False
        try:
            key = pending_key(output_key(prompt_text, output_text, salt=salt))
            return self._writable.mark(key, expiry, lock_timeout=INLINE_LOCK_S)
        except (StoreError, UnicodeEncodeError, ValueError) as exc:
            log.debug("tokcache: could not mark a record as pending: %r", exc)
            return False

    def _hand_off(self, write: PendingWrite[Chunks] | None, ready: Ready[Chunks] | None, text: str, salt: str,
                  mode: str, line: Scan, base_line: Scan | None) -> None:
        """Queue what a settled read made: its write (if its uncached tail is long enough; held
        when it continues a conversation, see HOLD_S) and head. ``line``, ``base_line``: see HandOff."""
        if write is not None:
            decision = write.decision
            if decision.encoded_bytes >= (self.min_write_bytes if decision.cached_bytes else self._first_write_bytes):
                if base_line is not None:  # this write holds the entries of the one held for that line
                    self.writer.supersede(base_line, salt, mode)
                if decision.cached_bytes and decision.encoded_bytes < HOLD_MAX_BYTES:
                    self.writer.hold(write, text, salt, mode, line)
                else:
                    self.writer.offer(write, text, salt, mode)
            else:
                self.writer.skip()
                if mode == "kv-stable" and self._keep_for_records:
                    key = _kept_key(text, salt)
                    with self._kept_lock:
                        self._kept[key] = (text, write)
                        self._kept.move_to_end(key)
                        if len(self._kept) > KEPT_FOR_RECORD:
                            self._kept.popitem(last=False)
        if ready is not None and self.lookup.heads.offer(ready):
            self.writer.poke()

    def close(self) -> None:
        """Write what is queued, unmap (once the write-behind thread has ended: see
        WriteBehind.when_stopped). Idempotent; no tokenize may run concurrently."""
        self.writer.close()
        self.writer.when_stopped(self._unmap)

    def _unmap(self) -> None:
        if self._writable is not None:
            self._writable.close()
            self._writable = None
        self.reader.close()


RETRY_S = 5.0  # after a failed attach, how long requests go over RPC before trying again


class _Claim(NamedTuple):
    """A model one thread is to open (LocalPaths._claim): what LocalModel.open needs."""

    model: str
    shm_name: str
    tokenizer_json: Path | None
    fingerprint: str


class OpenJob:
    """A claimed open (:meth:`LocalPaths.claim_open`): call it once, on a worker thread, to
    open the model (its LocalModel, or None when it cannot be opened); or :meth:`cancel` it
    when it cannot be run (an executor that was shut down), else the model would stay
    "being opened", and so read over RPC, for the client's life."""

    __slots__ = ("_paths", "_claim")

    def __init__(self, paths: LocalPaths, claim: _Claim) -> None:
        self._paths = paths
        self._claim = claim

    def __call__(self) -> LocalModel | None:
        return self._paths._open(self._claim)

    def cancel(self) -> None:
        """Give the claim back without opening (do not call it after running the job)."""
        self._paths._unclaim(self._claim.model)


class LocalPaths:
    """A client's in-process read paths, one per model; no RPC of its own (sans I/O).

    The client gives it what it learns over RPC (:meth:`set_models`: the sidecar's
    ``ListModels``) and the tokenizer files it was told about; :meth:`get` returns the
    model's LocalModel, or None (counted by reason; logged once per model and reason)
    when the RPC path has to serve. Thread-safe.
    """

    def __init__(self, tokenizers: dict[str, str | Path] | None, *, writable: bool = True,
                 learn: Learn | None = None, stats: LocalStats | None = None,
                 min_write_bytes: int = MIN_WRITE_BYTES) -> None:
        self.tokenizers = {k: Path(v) for k, v in (tokenizers or {}).items()}
        self.writable = writable
        self.min_write_bytes = min_write_bytes
        self.learn = learn
        self.stats = stats or LocalStats()
        self._infos: dict[str, tuple[str, str, str, str]] = {}  # model -> (shm name, fp, model dir, mode)
        self._models: dict[str, LocalModel] = {}
        self._failed: dict[str, tuple[float, str]] = {}  # model -> (time of the next attempt, reason)
        self._logged: set[tuple[str, str]] = set()
        self._old: list[LocalModel] = []
        self._opening: set[str] = set()  # models a thread is opening now
        self._closed = False
        # Guards _models/_failed/_infos/_logged/_old/_opening; opening and tokenize run outside it.
        self._lock = threading.Lock()

    def knows(self, model: str) -> bool:
        """Whether the sidecar's facts about ``model`` are known (else: call set_models first)."""
        return model in self._infos

    def set_models(self, models: list[Any]) -> None:
        """Take ``ListModels``' answer (``ModelInfo`` objects)."""
        with self._lock:
            for m in models:
                self._infos[m.name] = (m.shm_name, m.fingerprint, m.model_dir, getattr(m, "default_mode", ""))

    def is_open(self, model: str) -> bool:
        """Whether ``model``'s path is open and current (then :meth:`get` returns at once)."""
        local = self._models.get(model)
        return local is not None and not local.stale

    def default_mode(self, model: str) -> str:
        """The sidecar's default mode (``--mode``) for requests that name none."""
        info = self._infos.get(model)
        return (info[3] if info else "") or "kv-stable"

    def get(self, model: str) -> LocalModel | None:
        """The model's in-process path, opening it on first use (in this thread); None: use the
        RPC path.

        Opening (mapping the segment, loading the encoder: ~1 s, more on a busy node)
        happens outside the lock: while one thread opens a model, other callers get None
        at once (their requests go over RPC) instead of waiting for it.
        """
        local = self._models.get(model)
        if local is not None and not local.stale:
            return local
        got = self._claim(model)
        return self._open(got) if isinstance(got, _Claim) else got

    def claim_open(self, model: str) -> OpenJob | None:
        """Claim opening ``model`` now, for a worker thread: the call that opens it (run it
        elsewhere, once, or give the claim back with :meth:`OpenJob.cancel`), or None when
        there is nothing to open (open and current, being opened, a failed attempt's RETRY_S
        pending, not listed, no segment). From the moment it returns, :meth:`get` and
        :meth:`tokenize` in any thread see the model as being opened (RPC meanwhile): an event
        loop claims before it hands the call to an executor, so no request of its own can
        start a second open in between."""
        if self.is_open(model):
            return None
        got = self._claim(model)
        if not isinstance(got, _Claim):
            return None
        return OpenJob(self, got)

    def _unclaim(self, model: str) -> None:
        """Give back a claim whose open never ran (OpenJob.cancel): the model may be opened again."""
        with self._lock:
            self._opening.discard(model)
            if self._failed.get(model, (0.0, ""))[1] == "opening":
                del self._failed[model]

    def _claim(self, model: str) -> LocalModel | _Claim | None:
        """Under the lock: the open path (another thread opened it meanwhile), None (RPC), or
        the claimed open to run (the model is marked as being opened)."""
        with self._lock:
            if self._closed:
                return None
            local = self._models.get(model)
            if local is not None and not local.stale:
                return local
            if local is not None:  # replaced segment or new manifest: map the new one
                del self._models[model]
                self._old.append(local)  # closed with the client: a racing request may still use it
            if model in self._opening:
                self._failed.setdefault(model, (0.0, "opening"))
                return None
            if time.monotonic() < self._failed.get(model, (0.0, ""))[0]:
                return None
            info = self._infos.get(model)
            if info is None:  # not (yet) listed: the client asks ListModels again, at most once a second
                self._failed[model] = (0.0, "unknown_model")
                return None
            shm_name, fingerprint, model_dir, _mode = info
            if not shm_name:
                self._fallback(model, "no_cache", f"the sidecar has no shared-memory cache for {model!r}")
                return None
            tokenizer_json = find_tokenizer_json(self.tokenizers.get(model), model_dir)
            self._opening.add(model)
            self._failed[model] = (0.0, "opening")
        return _Claim(model, shm_name, tokenizer_json, fingerprint)

    def _open(self, claim: _Claim) -> LocalModel | None:
        """Open a claimed model (see :meth:`_claim`) and file it; None when it cannot be."""
        model, shm_name, tokenizer_json, fingerprint = claim
        try:
            local = LocalModel.open(model, shm_name, tokenizer_json=tokenizer_json, fingerprint=fingerprint,
                                    writable=self.writable, learn=self.learn, stats=self.stats,
                                    min_write_bytes=self.min_write_bytes)
        except LocalUnavailable as exc:
            with self._lock:
                self._opening.discard(model)
                self._fallback(model, exc.reason, str(exc))
            return None
        except BaseException:
            with self._lock:
                self._opening.discard(model)
                self._failed.pop(model, None)
            raise
        with self._lock:
            self._opening.discard(model)
            closed = self._closed
            if not closed:
                self._models[model] = local
                self._failed.pop(model, None)
        if closed:  # the client closed while this thread opened it
            local.close()
            return None
        log.info("tokcache: model %r is tokenized in this process from segment %s (%s writes, encoder %s)",
                 model, shm_name, "direct" if local.writer.direct else "sidecar", local.model.encoder.name)
        return local

    def tokenize(self, model: str, text: str, *, add_special_tokens: bool | None, cache_salt: str | None,
                 mode: str | None, trace: Sequence[tuple[str, str]] = (),
                 may_wait: bool = False) -> TokenizeResult | None:
        """The result decided in this process, or None (the RPC path serves; counted).

        Bad input raises the client's typed errors, as the RPC would. ``may_wait``: raise
        RecordPending when the text continues a recorded output marked as on its way (the
        caller asks again every PENDING_POLL_S, with ``may_wait`` False after PENDING_WAIT_S).
        """
        # The request path: one dict lookup and one staleness check before the lookup itself
        # (each call layer costs microseconds when a busy process's caches are cold).
        local = self._models.get(model)
        if local is None or local.stale:
            local = self.get(model)
            if local is None:
                self.count_fallback(model)
                return None
        t0 = time.perf_counter_ns()
        mode = mode or self.default_mode(model)
        try:
            result = local.tokenize(text, add_special_tokens=add_special_tokens is not False,
                                    salt=cache_salt or "", mode=mode, may_wait=may_wait)
        except InvalidRequest as exc:
            raise InvalidArgumentError(str(exc), field=exc.field) from exc
        except RequestTooLarge as exc:
            raise ResourceExhaustedError(str(exc)) from exc
        except TierNeeded:  # a conversation that may come from another node: the sidecar asks the tier
            self.stats.fallbacks["tier"] += 1
            return None
        d = result.decision
        self.stats.tokenize[d.source] += 1
        self.stats.paths["native" if d.native else "python"] += 1
        if d.declined:
            self.stats.declines[d.declined] += 1
        out = local_result(result.ids, local.fingerprint, local.backend, d.source, d.cached_tokens, d.cached_chars,
                           d.encoded_chars, d.ar_spliced_tokens, d.boundaries, d.l1_disabled_reason)
        trace_local(model, local.fingerprint, out, mode, bool(cache_salt), t0, trace)
        return out

    def mark_pending(self, model: str, records: Sequence[tuple[str, str, str]], seconds: float) -> int:
        """Mark each (prompt_text, output_text, salt) record as on its way for ``seconds`` (0:
        withdraw the marks), so a read in any process of the node whose text continues one
        waits for it (see :class:`RecordPending`). For a response sent before the sidecar
        answered its record. Returns how many marks were put; never raises."""
        local = self._models.get(model)
        if local is None or local.stale or not records:
            return 0
        expiry = max(1, math.ceil(time.time() + seconds)) if seconds > 0 else 1
        put = sum(local.mark(prompt, output, salt, expiry) for prompt, output, salt in records)
        if put:
            self.stats.pending["marked" if seconds > 0 else "withdrawn"] += put
        if put < len(records):
            self.stats.pending["mark_failed"] += len(records) - put
        return put

    def _fallback(self, model: str, reason: str, message: str) -> None:
        """Lock held: RPC for ``model`` for RETRY_S; log once per (model, reason)."""
        self._failed[model] = (time.monotonic() + RETRY_S, reason)
        if (model, reason) not in self._logged:
            self._logged.add((model, reason))
            log.warning("tokcache: in-process reads off for model %r (%s): %s; using the sidecar's Tokenize RPC",
                        model, reason, message)

    def count_fallback(self, model: str) -> None:
        """Count one request that went over RPC because the in-process path was unavailable."""
        with self._lock:
            reason = self._failed.get(model, (0.0, "unavailable"))[1]
        self.stats.fallbacks[reason] += 1

    @property
    def idle(self) -> bool:
        """True when no write is pending (a flush would return at once)."""
        return all(local.writer.idle for local in list(self._models.values()))

    def hold_records(self, model: str, records: Sequence[tuple[str, str, str]]) -> int:
        """:meth:`LocalModel.hold_record` of each (prompt text, output text, salt) the sidecar
        stored for ``model``; how many were offered. Never raises."""
        local = self._models.get(model)
        if local is None or local.stale:
            return 0
        held = sum(local.hold_record(prompt, output, salt) for prompt, output, salt in records)
        self.stats.writes["records_held"] += held
        return held

    def store_for_records(self, records: Sequence[tuple[str, str, str]]) -> None:
        """Before a RecordOutput of each (model, prompt text, salt): store the prompt's write
        that was skipped for its size, in this thread (LocalModel.store_for_record). Never raises."""
        for model, prompt_text, salt in records:
            local = self._models.get(model)
            if local is not None:
                local.store_for_record(prompt_text, salt)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every model's pending writes (before a RecordOutput that chains to them)."""
        ok = True
        for local in list(self._models.values()):
            ok = local.writer.flush(timeout) and ok
        return ok

    def close(self) -> None:
        """Write what is pending and unmap every segment. Idempotent."""
        with self._lock:
            self._closed = True
            models, self._models = [*self._models.values(), *self._old], {}
            self._old = []
        for local in models:
            local.close()
