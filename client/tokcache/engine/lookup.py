"""Tokenize through the shared cache: find the hit, encode the tail, build the result.

This is the one place a cache decision is made. The sidecar runs it on its read-write
store for ``Tokenize`` RPCs; a client runs it on a read-only mapping of the same segment
in its own process. Given the same segment contents and text, both take the same hit
and return the same ids: nothing here depends on what a process happens to remember
(memos only save copying bytes that are read anyway, never change hit or miss).

For a text ``T`` with safe cuts ``c1 < … < cK`` (ends of boundary tokens):

1. **find the hit** — L0: the whole of ``T``. Else L1: the longest cut whose prefix is
   cached (gallop back from the last cut with index-only probes, binary-search the
   bracket). Else, in kv-stable mode, a prefix AR entry (a recorded output) ending
   where a later boundary token starts wins over the L1 cut.
2. **encode the tail** — the text after the hit, one piece per remaining cut, in one
   native call; in kv-stable mode a piece whose text is a recorded output is spliced
   with the generated ids (segment AR).
3. **build the result** — the hit's ids + the tail's, in the caller's container
   (:mod:`tokcache.engine.ids`), and the new cache entries as a :class:`PendingWrite`:
   data that whoever owns the write path stores after the reply.

Correctness rests on: cuts only after added tokens that passed the boundary self-check,
an encoder that passed the exactness gate, and a store that returns the ids put for a
key or nothing.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol

from tokcache.engine import boundaries as _boundaries
from tokcache.engine.affixes import Affixes
from tokcache.engine.boundaries import BoundaryScanner, Encoded, Scan
from tokcache.engine.encoder import Encoder
from tokcache.engine.errors import InvalidRequest, RequestTooLarge
from tokcache.engine.ids import LISTS, MAX_PARTS, Chunks, IdFormat, Ids, Out, joined, sliced, untrack
from tokcache.engine.memo import ChainMemo
from tokcache.store import Kind, Known, RecordRef, StoreError, Walk
from tokcache.store.keys import (
    KEY_GRID,
    MODE_EXACT,
    MODE_KV_STABLE,
    KeyState,
    TextKeys,
    pending_key,
    root_hasher,
    segment_key,
    segment_root,
)

__all__ = [
    "CacheView",
    "Decision",
    "Later",
    "Limits",
    "Lookup",
    "PENDING_POLL_S",
    "PENDING_WAIT_S",
    "PendingWait",
    "PendingWrite",
    "ReadModel",
    "Result",
    "TierNeeded",
    "mode_tag",
    "utf8",
]

# The native steady-state path (tokcache.engine._speedups: extend, cut_tokens) when the
# extension was built (TOKCACHE_PURE_PYTHON=1: never); this module's Python is the reference.
_native: Any = _boundaries._native

# The longest-prefix search probes the last this many keyed cuts first (one native call;
# a keyed cut per ~2 KB, see tokcache.store.keys.KEY_GRID: the window spans ~128 KB), then
# gallops below them. Only the cuts a text appended are hashed for it (the others' keys
# come from the text it extends). Also how many shorter keyed cuts are tried when a
# winner's chain is broken.
TAIL_PROBES = 64
# Segment AR: pieces shorter than this are not looked up; a recorded output
# may start after at most this many leading newlines of a piece (role headers).
MIN_SEGMENT_BYTES = 4
_SEGMENT_HEADER_BYTES = 64
_SEGMENT_MAX_STARTS = 3
# A read whose text continues an output marked as on its way (``Decision.ar_pending``: a
# response went out before the sidecar stored its record, see Store.mark) is read again
# every PENDING_POLL_S, for at most PENDING_WAIT_S (a mark lives as long as its record's
# RPC may), then served without that output's ids. Whoever serves the read waits: a client
# reading in its own process, or the sidecar's Tokenize.
PENDING_POLL_S = 0.005
PENDING_WAIT_S = 2.0


def utf8(text: str, field: str = "text") -> bytes:
    """``text`` as UTF-8; InvalidRequest naming ``field`` for a lone surrogate."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(field, f"not valid Unicode at index {exc.start} (a lone surrogate)") from exc


_TAGS = {"exact": MODE_EXACT, "kv-stable": MODE_KV_STABLE}

# Why the native fast path (Lookup._extend) left a request to the Python path
# (Decision.declined): _speedups.extend's codes 1.. in their order (its TK_* enum), then
# the reasons decided before the call. Counted by the clients (LocalStats.declines).
_DECLINED = (
    "",
    "no_base",  # (no longer: a text that extends none this process read is hashed from the start)
    "base_state",  # that text holds no usable key state for its namespace
    "invalid_text",  # a lone surrogate (the Python path reports it)
    "too_large",  # over max_text_bytes (the Python path reports it)
    "unstable",  # the appended text moved a boundary at or before the state's cut
    "window_keys",  # a key of the probe window that text never made
    "l0",  # the whole text is cached: the Python path reads L0 hits
    "no_window_hit",  # no keyed cut of the window is cached (a miss, or a gallop further back)
    "chain_not_held",  # (no longer: a chain this process does not hold is read)
    "ar_keys",  # that text never made the AR keys the recorded-output search needs
    # Decided before (or after) the native call:
    "chain_broken",  # the hit's chain no longer reads (evicted under the read): the Python path tries below it
)


def mode_tag(mode: str) -> bytes:
    """The key namespace of a mode name ("exact" or "kv-stable")."""
    tag = _TAGS.get(mode)
    if tag is None:
        raise InvalidRequest("mode", f"expected 'kv-stable' or 'exact', got {mode!r}")
    return tag


class CacheView(Protocol):
    """What the lookup reads of a segment: ``Store`` (read-write) or ``StoreReader``."""

    def tail(self) -> int: ...
    def native_region(self) -> tuple[Any, int, int] | None: ...
    def probe(self, key: bytes) -> bool: ...
    def last_present(self, keys: list[bytes], lo: int, hi: int) -> int: ...
    def slot(self, key: bytes) -> tuple[int, int] | None: ...
    def holds_ar(self) -> bool: ...
    def marks_live(self, now: float) -> bool: ...
    def read(self, key: bytes, known: Known | None = None, *, widened: bool = True) -> Walk | None: ...
    @property
    def id_bytes(self) -> int: ...


class PendingWait:
    """One read's wait for the recorded outputs its text continues that are marked as on their
    way (``Decision.ar_pending``), the same for every reader (the clients, the sidecar)::

        wait = PendingWait()
        while True:
            may_wait = wait.open
            ...read; if it is pending and may_wait: sleep(wait.poll()) and read again
        outcome = wait.outcome(may_wait)  # None: never pending; "waited"; "gave_up"
    """

    __slots__ = ("_deadline",)

    def __init__(self) -> None:
        self._deadline: float | None = None

    @property
    def open(self) -> bool:
        """Whether a read may still wait for a pending output (else it is served without it)."""
        return self._deadline is None or time.monotonic() < self._deadline

    def poll(self) -> float:
        """A read found an output pending: seconds to sleep before reading again (the
        PENDING_WAIT_S bound starts at the first)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + PENDING_WAIT_S
        return PENDING_POLL_S

    def outcome(self, may_wait: bool) -> str | None:
        """How the last read (made with ``may_wait``) ended the wait: None if no read was ever
        pending, ``"waited"`` (served with the output), ``"gave_up"`` (served without it)."""
        if self._deadline is None:
            return None
        return "waited" if may_wait else "gave_up"


class TierNeeded(Exception):  # a signal to the caller, not an error
    """Raised by ``tokenize(..., tier=True)`` before encoding: no recorded output ends where
    this kv-stable request's cached prefix does (no prefix AR hit), and pieces of its tail
    after the last one a local record applies to could be outputs recorded on another node.

    ``candidates``: (segment key, piece text as UTF-8) for each of those pieces' starts the
    tail encoder would look up. The caller (the sidecar) asks its cluster tier for them, verifies and
    stores what it gets, and calls again without ``tier``; a client that cannot ask the
    tier sends the request to the sidecar instead.
    """

    def __init__(self, candidates: list[tuple[bytes, bytes]]) -> None:
        super().__init__(f"{len(candidates)} segment keys to ask the tier for")
        self.candidates = candidates


@dataclass(frozen=True)
class Limits:
    """Request size limits; over them a request is refused (RESOURCE_EXHAUSTED)."""

    max_text_bytes: int = 8 << 20
    max_messages: int = 10_000


@dataclass(frozen=True)
class ReadModel:
    """What the read side needs of one tokenizer (see ``tokcache.engine.model``)."""

    fingerprint: str
    encoder: Encoder
    scanner: BoundaryScanner
    affixes: Affixes
    l1_disabled_reason: str
    vocab_size: int
    # The ids of the boundary tokens: in a tail encoded in one call, each cut is right
    # after one of them (an added token always encodes to exactly its own id).
    boundary_ids: frozenset[int] = frozenset()
    # The same, by each token's UTF-8 text: where a cut falls in a tail's ids is found
    # from the spans' texts (list.index), not by testing every id.
    boundary_id_of: Mapping[bytes, int] = field(default_factory=dict)
    # Which cuts carry an L1 key (tokcache.store.keys.KEY_GRID; the segment's manifest says).
    key_grid: int = KEY_GRID


@dataclass(slots=True)
class Decision:
    """How the ids of one request were produced (mirrors the proto CacheDecision)."""

    source: str = "miss"  # miss | l0 | l1 | ar
    cached_tokens: int = 0
    cached_chars: int = 0
    encoded_chars: int = 0
    ar_spliced_tokens: int = 0
    boundaries: int = 0
    l1_disabled_reason: str = ""
    # Per-layer lookup results (None: layer not consulted), for metrics.
    l0_hit: bool | None = None
    l1_hit: bool | None = None
    ar_prefix_hit: bool | None = None
    segment_splices: int = 0
    cached_bytes: int = 0
    encoded_bytes: int = 0
    stored: bool | None = None
    store_errors: int = 0
    # A mark says a recorded output past the hit is on its way (see Lookup._pending): a
    # caller that can wait may ask again shortly; this result lacks that output's ids.
    ar_pending: bool = False
    # Served by the native fast path (Lookup._extend) rather than the Python one: the same
    # decision either way; counted, as a process whose fast path misses costs more CPU.
    native: bool = False
    # Why the native fast path left this request to the Python path ("" when it served it or
    # was not there to try; see _DECLINED), counted by reason.
    declined: str = ""
    # Phase -> (perf_counter_ns start, end), for trace child spans.
    timings: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(slots=True)
class PendingWrite(Generic[Ids]):
    """The cache entries a lookup learned, to be stored after the reply.

    One record: ``ids`` (the tail's ids) continuing ``parent``'s
    ``parent_tokens`` tokens, with the L1 keys of the keyed cuts among ``first_new..n-1`` (``ends``: the
    tokens of ``ids`` up to each) and the L0 key of the whole text. ``full`` holds the
    whole text's raw ids (the container a memo may keep once the record exists).
    """

    parent: bytes | None
    parent_tokens: int
    ids: Chunks
    keys: TextKeys
    first_new: int
    n_cuts: int
    ends: list[int] | None  # tokens of ``ids`` after each piece; None: found from boundary_id_of
    full: Ids
    decision: Decision
    boundary_id_of: Mapping[bytes, int] = field(default_factory=dict)
    # Where cuts fall in ``ids`` (byte offset -> tokens before it), when its encoding says.
    cut_tokens: dict[int, int] | None = None

    def entries(self) -> list[tuple[bytes, int] | tuple[bytes, int, Kind]]:
        """(key, ids used) per new cut, and the L0 key (its own kind: ``--ttl-l0`` applies).

        Runs on the write path (after the reply): computing the cut keys and where each
        cut falls in ``ids`` costs nothing on the request path.
        """
        keys, keyed, first, spans = self.keys, self.keys.keyed, self.first_new, self.keys.spans
        out: list[tuple[bytes, int] | tuple[bytes, int, Kind]] = []
        new = range(bisect_left(keyed, first), len(keyed))
        at = self.cut_tokens
        if at is not None and all(spans[keyed[p]][1] in at for p in new):
            # Where the keyed cuts fall in the tail's ids is known from its encoding.
            out += [(keys.key_at(p), at[spans[keyed[p]][1]]) for p in new]
        else:
            ends = self.ends
            if ends is None:
                ends = self._cut_ends()
            if len(ends) == self.n_cuts - first + 1:  # else only the L0 key (cannot happen)
                out += [(keys.key_at(p), ends[keyed[p] - first]) for p in new if keyed[p] < self.n_cuts]
        out.append((self.keys.exact_key(), len(self.ids), Kind.L0))
        return out

    def _cut_ends(self) -> list[int]:
        """Tokens of ``ids`` up to each new cut, then all: each cut is right after its
        boundary token, whose id comes once in the tail's ids per occurrence in its text."""
        ids, id_of = joined(self.ids), self.boundary_id_of
        data, spans = self.keys.data, self.keys.spans
        ends: list[int] = []
        pos = 0
        try:
            for start, end in spans[self.first_new:self.n_cuts]:
                pos = ids.index(id_of[data[start:end]], pos) + 1
                ends.append(pos)
        except (KeyError, ValueError):  # not found as expected (cannot happen): cut no keys
            return [len(ids)]
        ends.append(len(ids))
        return ends

    @property
    def exact_key(self) -> bytes:
        return self.keys.exact_key()


@dataclass(slots=True)
class Result(Generic[Ids, Out]):
    """The ids of one request (which the caller owns), how, and what to store."""

    ids: Out
    decision: Decision
    write: PendingWrite[Ids] | None = None
    # A deferring Lookup's (see Lookup.defer) bookkeeping, for Lookup.settle to turn into
    # ``write`` after the reply; None when it is already here.
    later: Later[Ids] | None = None
    # The text's raw ids (no special tokens added) as this process keeps them, ``n`` of them:
    # what a record of the output that follows this prompt compares the caller's ids with.
    full: Ids | None = None
    n: int = 0


@dataclass(slots=True)
class _Hit(Generic[Ids]):
    """Step 1's answer: the cached prefix (``ids[:tokens]``), where the text after it
    starts, and what the new record would chain to."""

    ids: Ids | None
    tokens: int
    start: int  # byte offset of the tail
    parent: bytes | None
    first_new: int  # index of the first cut not covered by the prefix
    exact: bool = False


@dataclass(slots=True)
class _Tail(Generic[Out]):
    """Step 2's answer: the tail's ids, the tokens after each piece (None: not computed),
    and the spliced AR tokens.

    A tail that reused this process's previous encoding (``prior``, see
    Lookup._canonical_tail) is ``prior.ids[lo:hi] + new``, kept as :class:`Chunks`
    (:meth:`chunks`): the write, the next turn's memo and a caller's list are made from
    its parts. ``canonical``: the plain encoding of its text, to remember (``cut``: where
    ``new`` starts in the text, or the tail's start)."""

    ids: list[int] | None
    ends: list[int] | None
    spliced: int
    new: list[int] | None = None
    prior: Encoded | None = None
    lo: int = 0
    hi: int = 0
    cut: int = 0
    canonical: bool = False
    chunked: Chunks | None = None  # (see chunks)

    def chunks(self) -> Chunks:
        """The tail's ids as Chunks (made once; its lists untracked, see ``untrack``). A reused
        encoding's are ``prior``'s parts up to ``hi`` and ``new``: no id copied while the
        conversation's hit stays where ``prior``'s starts (``lo`` 0), as it does while its
        turns' entries are not stored yet (a record stores them with the output): joining
        ``prior.ids[:hi] + new`` into one list would copy the conversation's ids every turn."""
        ch = self.chunked
        if ch is None:
            if self.ids is not None:
                ids = untrack(self.ids)
                ch = Chunks(((ids, len(ids)),) if ids else (), len(ids))
            else:
                assert self.prior is not None and self.new is not None
                new = untrack(self.new)
                if self.lo == 0:
                    head = self.prior.ids.take(self.hi).parts
                else:  # the hit moved on: one copy of what is left
                    part = untrack(sliced(self.prior.ids, self.lo, self.hi))
                    head = ((part, len(part)),) if part else ()
                parts = head + ((new, len(new)),) if new else head
                n = self.hi - self.lo + len(new)
                if len(parts) > MAX_PARTS:  # one copy, then short chains again
                    flat = untrack(joined(Chunks(parts, n)))
                    parts = ((flat, n),)
                ch = Chunks(parts, n)
            self.chunked = ch
        return ch

    def flat(self) -> list[int]:
        """The tail's ids as one list (made once)."""
        if self.ids is None:
            self.ids = joined(self.chunks())
        return self.ids


@dataclass(slots=True)
class Later(Generic[Ids]):
    """What a read leaves for after its reply (:meth:`Lookup.settle`): filing its scan for
    the next turn (``native_keys`` set: the native fast path's scan, not filed yet), its key
    state, its canonical encoding, and the write it makes. Data, not a closure."""

    scan: Scan
    keys: TextKeys | None  # None: made from native_keys
    native_keys: tuple[Any, ...] | None  # (salt, tag, keyed, keys, exact, state cut, state hasher, AR keys)
    store: CacheView | None
    ar: bool
    hit: _Hit[Ids]
    tail: _Tail[Any]
    decision: Decision
    full: Ids | None  # the whole text's ids, when the reply needed them (else made in settle)


class Lookup(Generic[Ids, Out]):
    """Tokenize through one segment. Thread-safe; one per (model, process)."""

    def __init__(self, model: ReadModel, store: CacheView | None, memo: ChainMemo[Ids],
                 limits: Limits | None = None, *, defer: bool = False) -> None:
        self.model = model
        # True: a result leaves its bookkeeping (Result.later) for the caller to settle after
        # the reply; False: settled before returning (Result.write).
        self.defer = defer
        self.store = store
        self.memo: ChainMemo[Ids] = memo
        self.fmt: IdFormat[Ids, Out] = memo.fmt
        # The encoder's lists as this format keeps them (IdFormat.own): as they come when the
        # encoder already shares one int object per id (Encoder.shared_ints). Interning
        # fastokens' output would replace each int by itself: a pass over every new id for nothing.
        self._own = _same if model.encoder.shared_ints else self.fmt.own
        self.limits = limits or Limits()
        # (store, the native fast path's context for it): see _extend.
        self._fast_ctx: tuple[CacheView, tuple[Any, ...]] | None = None

    # -- the request path ----------------------------------------------------------------

    def tokenize(self, text: str, *, add_special_tokens: bool, salt: str = "",
                 mode: str = "kv-stable", tier: bool = False) -> Result[Ids, Out]:
        """Ids of ``text`` (== HF tokenizers ``encode(text, add_special_tokens)`` in exact
        mode; recorded output ids win in kv-stable mode), via the cache.

        Raises InvalidRequest (lone surrogates, unknown mode) and RequestTooLarge. A
        failing store degrades to plain encoding; it never fails the request. Nothing is
        written: the caller stores ``Result.write`` (if any) after answering. With ``tier``
        a kv-stable request that no local AR applies to raises :class:`TierNeeded`.
        """
        if len(text) > self.limits.max_text_bytes:  # chars <= bytes: a cheap first test
            raise RequestTooLarge("text", self.limits.max_text_bytes)
        declined = ""
        if _native is not None and self.model.scanner.matcher is not None:
            fast = self._extend(text, add_special_tokens=add_special_tokens, salt=salt, mode=mode, tier=tier)
            if not isinstance(fast, str):
                return fast
            declined = fast
        try:
            scan = self.model.scanner.scan_text(text)
        except UnicodeEncodeError as exc:
            raise InvalidRequest("text", f"not valid Unicode: lone surrogate {text[exc.start]!r} at index "
                                         f"{exc.start}") from exc
        return self._tokenize(scan, len(text), add_special_tokens=add_special_tokens, salt=salt, mode=mode,
                              tier=tier, declined=declined)

    def _tokenize(self, scan: Scan, n_chars: int, *, add_special_tokens: bool, salt: str,
                  mode: str, tier: bool = False, declined: str = "") -> Result[Ids, Out]:
        data = scan.data
        if len(data) > self.limits.max_text_bytes:
            raise RequestTooLarge("text", self.limits.max_text_bytes)
        tag = mode_tag(mode)
        affixes = self.model.affixes
        decision = Decision(l1_disabled_reason=self.model.l1_disabled_reason, declined=declined)
        if add_special_tokens and not affixes.separable:
            # The post-processor does more than wrap raw ids: no cache for this request.
            decision.l1_disabled_reason = f"add_special_tokens: {affixes.reason}"
            decision.encoded_chars = n_chars
            ids = self.fmt.from_list(self._own(self.model.encoder.encode_full(data.decode("utf-8"))))
            return Result(self.fmt.result(ids, self.fmt.count(ids)), decision)
        t0 = time.perf_counter_ns()
        spans = scan.spans
        decision.boundaries = len(spans)
        # Hash only what was appended to a text hashed before (same namespace).
        ns = (salt, tag)
        keys = TextKeys(data, spans, salt, tag, scan.base.hashers.get(ns) if scan.base is not None else None,
                        grid=self.model.key_grid)
        store, ar = self._usable_store(tag, decision)
        # One hashing pass: the L1 keys of the last keyed cuts, the L0 key (AR keys, if any
        # can apply, once the L1 hit is known: only past it).
        keys.scan_tail(len(keys.keyed) - TAIL_PROBES, keep=scan.stable)
        state = keys.state()
        if state is not None:
            _file_state(scan, ns, state)
        hit = self._find_hit(store, keys, spans, ar, decision)
        if tag == MODE_KV_STABLE and store is not None and not hit.exact:
            decision.ar_pending = self._pending(store, keys, hit.first_new + (decision.source == "ar"))
        return self._serve(scan, keys, store, ar, hit, decision, n_chars, add_special_tokens, salt, tag, tier, t0)

    def _serve(self, scan: Scan, keys: TextKeys | None, store: CacheView | None, ar: bool, hit: _Hit[Ids],
               decision: Decision, n_chars: int, add_special_tokens: bool, salt: str, tag: bytes, tier: bool,
               t0: int, tail_chars: int | None = None,
               native_keys: tuple[Any, ...] | None = None) -> Result[Ids, Out]:
        """Steps 2 and 3 once the hit is known: encode the tail, build the result (and its
        bookkeeping: :meth:`settle`). ``tail_chars``: the tail's length in characters when the
        caller counted it (then the tail is decoded only if its encoding cannot reuse this
        process's previous one). ``keys`` None: the fast path's, made in settle from
        ``native_keys`` (see :class:`Later`)."""
        t1 = time.perf_counter_ns()
        decision.timings["lookup"] = (t0, t1)
        data, affixes = scan.data, self.model.affixes
        prefix, suffix = (affixes.prefix, affixes.suffix) if add_special_tokens else ((), ())
        if hit.exact:
            assert hit.ids is not None
            decision.cached_tokens = hit.tokens
            decision.cached_chars = n_chars
            decision.cached_bytes = len(data)
            return Result(self.fmt.result(hit.ids, hit.tokens, prefix, suffix), decision, full=hit.ids, n=hit.tokens)
        # The cluster tier is asked only when nothing recorded applies here: a conversation
        # whose last output was recorded on this node needs nothing from elsewhere.
        ask = tier and store is not None and tag == MODE_KV_STABLE and decision.source != "ar"
        tail_text: str | None = None
        if tail_chars is None:
            tail_text = data[hit.start:].decode("utf-8") if hit.start else (scan.text or data.decode("utf-8"))
            tail_chars = len(tail_text)
        if keys is not None:
            keyed = keys.keyed
        else:
            assert native_keys is not None
            keyed = native_keys[2]
        tail = self._encode_tail(store if ar else None, scan, keyed, tail_text, hit, salt, tag, ask)
        decision.timings["encode"] = (t1, time.perf_counter_ns())
        if tail.spliced:
            decision.segment_splices = tail.spliced
            decision.ar_spliced_tokens += tail.spliced
            if decision.source in ("miss", "l1"):
                decision.source = "ar"
        if decision.source != "miss":
            decision.cached_tokens = hit.tokens
            decision.cached_chars = n_chars - tail_chars
        decision.encoded_chars = tail_chars
        decision.cached_bytes = hit.start
        decision.encoded_bytes = len(data) - hit.start
        ch = tail.chunks()
        full = self._full(hit, ch)
        out = self.fmt.result(full, hit.tokens + ch.n, prefix, suffix)
        later = Later(scan, keys, native_keys, store, ar, hit, tail, decision, full)
        n = hit.tokens + ch.n
        if self.defer:
            return Result(out, decision, later=later, full=full, n=n)
        return Result(out, decision, self.settle(later), full=full, n=n)

    def _full(self, hit: _Hit[Ids], tail: Chunks) -> Ids:
        """The whole text's ids: the hit's, then ``tail``'s."""
        more = self.fmt.from_chunks(tail)
        return more if hit.ids is None else self.fmt.grow(hit.ids, hit.tokens, more)

    def settle(self, later: Later[Ids]) -> PendingWrite[Ids] | None:
        """A result's bookkeeping, after its reply: file a fast-path scan for the next turn,
        remember the tail's canonical encoding, and make the write (None: no store). Settle a
        lookup's results in the order they were returned, each once, before its next request
        (which extends what they file)."""
        scan, hit, tail = later.scan, later.hit, later.tail
        keys = later.keys
        if keys is None:
            assert later.native_keys is not None
            salt, tag, keyed, keys_list, exact, state_cut, state_hasher, ar_keys = later.native_keys
            self.model.scanner.keep(scan)
            ns = (salt, tag)
            base = scan.base
            keys = TextKeys.from_state(scan.data, scan.spans, salt, tag, keyed, keys_list, exact, state_cut,
                                       state_hasher, base.hashers.get(ns) if base is not None else None,
                                       grid=self.model.key_grid, ar_keys=ar_keys)
            state = keys.state()
            assert state is not None  # (from_state makes one)
            _file_state(scan, ns, state)
        if tail.canonical:
            self._remember(scan, keys.keyed, tail, hit.start)
        ids = tail.chunks()
        full = later.full if later.full is not None else self._full(hit, ids)
        enc = scan.encoded
        if enc is not None and enc.ids is not ids:
            enc = None  # kept only when the tail is its text's plain encoding
        write = None
        if later.store is not None:
            write = PendingWrite(hit.parent, hit.tokens, ids, keys, hit.first_new, len(scan.spans), tail.ends, full,
                                 later.decision, self.model.boundary_id_of,
                                 enc.cut_tokens if enc is not None else None)
        # The text this one extends served this request alone (its key states and encoding are
        # now this text's too), and the next turn extends this one: let it go now, not when that
        # turn supersedes this text (one text and its ids per conversation less in memory).
        scan.base = None
        return write

    def _extend(self, text: str, *, add_special_tokens: bool, salt: str, mode: str,
                tier: bool) -> Result[Ids, Out] | str:
        """The native fast path (``_speedups.extend``) of :meth:`tokenize` for the common case:
        no L0 entry, and the L1 hit is a keyed cut in the window. When ``text`` extends one this
        process tokenized, only the appended part is scanned and hashed; else all of it (a
        conversation another process served last). When recorded outputs may apply (kv-stable,
        AR in the segment) the native call also makes the AR keys past that cut and finds the
        highest live one. The winning chain is read here as the Python path reads it (the
        native call answers it from this process's memo when it holds it); while a
        pending-record mark may be live (kv-stable), the marks of those keys past the hit are
        probed here (``Decision.ar_pending``). A string (why not, see _DECLINED):
        :meth:`tokenize` serves it from the start.

        The same decision as the Python path, by construction (the same keys, probes and
        window) and by test (both run on the same histories).
        """
        store = self.store
        tag = _TAGS.get(mode)
        if tier or tag is None or store is None or (add_special_tokens and not self.model.affixes.separable):
            return ("tier" if tier else "mode" if tag is None else "no_store" if store is None
                    else "special_tokens")
        t0 = time.perf_counter_ns()
        try:
            now = time.time()
            # While a pending-record mark may be live, this text's own marks are probed past the
            # hit as the Python path probes them (_pending), from the AR keys the native call
            # makes then, rather than leaving every kv-stable read to the Python path: a mark
            # lives as long as its record's deadline, and a node whose sidecar is slow puts
            # them all the time.
            marked = tag == MODE_KV_STABLE and store.marks_live(now)
            ar = tag == MODE_KV_STABLE and store.holds_ar()
            ctx = self._fast_ctx
            if ctx is None or ctx[0] is not store:
                region: tuple[Any, int, int] | None = store.native_region()
                if region is None:
                    return "no_region"
                scanner = self.model.scanner
                index, index_off, n_buckets = region
                args = (scanner.matcher, scanner.maxlen, self.model.key_grid, TAIL_PROBES, index, index_off,
                        n_buckets, *self.memo.native_view(), self.limits.max_text_bytes)
                ctx = self._fast_ctx = (store, args)
            ns = (salt, tag)
            # The latest texts, then the roots a rewritten history extends (BoundaryScanner.bases).
            bases, latest = self.model.scanner.bases()
            got = _native.extend(text, bases, ns, ctx[1], store.tail(), now, ar or marked, root_hasher(salt, tag))
            if type(got) is int:
                return _DECLINED[got]
            (base, data, spans, tail, tail_from, kept_end, stable, keyed, keys_list, state_hasher, state_cut, exact,
             pos, key, held, tokens, tail_chars, ar_keys, ar_at) = got
            # A text that extends a root rather than one of the latest starts a line of its own.
            # (index: the first entry that is ``base``, Scans comparing by identity; one C call
            # where a generator's frame cost a cold request ~3 µs)
            root = None if base is None or bases.index(base) >= latest else base.line_root
            j = keyed[pos]
            decision = Decision(source="l1", boundaries=len(spans), l1_disabled_reason=self.model.l1_disabled_reason,
                                l0_hit=False, l1_hit=True, native=True)
            ar_hit: _Hit[Ids] | None = None
            if ar:
                decision.ar_prefix_hit = False
                if ar_at >= 0:
                    # The recorded output's chain first: it runs through the L1 hit's record (a
                    # recorded output is one record with its prompt's keys), which the L1 read
                    # below then finds in this process's memo.
                    ar_hit = self._ar_hit(store, ar_keys, j, ar_at, spans, decision)
            if held is None:  # a chain this process does not hold: read what it lacks
                found = self._read(store, key)
                if found is None:
                    return "chain_broken"
                held, tokens = found
            hit: _Hit[Ids] = _Hit(held, tokens, spans[j][1], key, j + 1)
            if ar_hit is not None:
                # Tokens gained over the L1 prefix: the recorded output (and the few prompt
                # tokens between the L1 cut and the output).
                decision.ar_spliced_tokens = ar_hit.tokens - tokens
                hit = ar_hit
            if decision.source == "ar":
                tail_chars = None  # counted from the L1 cut: the tail is decoded instead
            if marked:
                decision.ar_pending = self._marked(store, ar_keys, hit.first_new + (decision.source == "ar"))
        except StoreError:
            return "store_error"
        # Filed for the next turn, and its keys made, in settle (after the reply).
        scan = Scan(data, spans, tail, tail_from, kept_end, len(base.data) if base is not None else 0, text,
                    base=base, stable=stable, root=root)
        return self._serve(scan, None, store, ar, hit, decision, len(text), add_special_tokens, salt, tag, False,
                           t0, tail_chars, (salt, tag, keyed, keys_list, exact, state_cut, state_hasher, ar_keys))

    def _splices(self, store: CacheView, scan: Scan, hit: _Hit[Ids], salt: str,
                 tag: bytes) -> dict[int, tuple[int, bytes]]:
        """Segment AR: the pieces of ``scan``'s tail after ``hit`` (the bytes before each boundary
        past it, then after the last) that are recorded outputs, from their start or after one
        of their first newlines (a role header): piece index -> (that start, the output's ids as
        packed u32). The index is probed in one native call (each piece's keys hashed there);
        only keys it holds are read, each proven by its record as any read is."""
        data, spans = scan.data, scan.spans
        region = store.native_region() if _native is not None else None
        splices: dict[int, tuple[int, bytes]] = {}
        if region is None:
            a = hit.start
            for k, s_i in enumerate([s for s, _ in spans[hit.first_new:]] + [len(data)]):
                body = data[a:s_i]
                if len(body) >= MIN_SEGMENT_BYTES and (got := _splice_at(store, body, _segment_starts(body), salt,
                                                                         tag)) is not None:
                    splices[k] = got
                if s_i < len(data):
                    a = spans[hit.first_new + k][1]
            return splices
        try:
            hits = _native.segment_probe(data, spans, hit.first_new, hit.start, segment_root(salt, tag), *region,
                                         store.tail(), time.time(), MIN_SEGMENT_BYTES, _SEGMENT_HEADER_BYTES,
                                         _SEGMENT_MAX_STARTS)
        except StoreError:
            return splices
        for k, p, _key in hits:
            i = hit.first_new + k
            a = spans[i - 1][1] if k else hit.start
            body = data[a:spans[i][0] if i < len(spans) else len(data)]
            starts = _segment_starts(body)
            # From the start the index named (a slot is a hint: a read that fails tries the next).
            got = _splice_at(store, body, starts[starts.index(p):] if p in starts else starts, salt, tag)
            if got is not None:
                splices[k] = got
        return splices

    def _canonical_tail(self, scan: Scan, keyed: list[int], tail_text: str | None, start: int) -> _Tail[Out]:
        """The canonical ids of ``tail_text`` (``scan.data[start:]``; None: decoded here if
        needed), reusing what this process encoded for the text ``scan`` extends: its ids
        from ``start`` (a cut within what it encoded) up to its last stable cut — safe
        boundaries, so the parts concatenate exactly — then only the text after that cut
        is encoded.

        A conversation's hit stays at, or moves a few keyed cuts past, the last stored
        keyed cut while this process serves it: each turn encodes only what it appended,
        however long the uncached tail. Only for tails encoded without splices (nothing
        recorded applies), whose ids depend on the text alone. :meth:`_remember` records
        where the keyed cuts and the last stable cut fall in the ids (for the next turn,
        and this turn's write), after the reply.
        """
        base = scan.base
        memo = base.encoded if base is not None else None
        if memo is not None and base is not None and base.stable and memo.start <= start:
            cut = base.spans[base.stable - 1][1]
            lo, hi = memo.cut_tokens.get(start), memo.cut_tokens.get(cut)
            if start < cut and lo is not None and hi is not None:
                new = self._own(self.model.encoder.encode(scan.data[cut:].decode("utf-8")))
                return _Tail(None, None, 0, new, memo, lo, hi, cut, canonical=True)
        ids = self._own(self.model.encoder.encode(tail_text if tail_text is not None
                                                  else scan.data[start:].decode("utf-8")))
        return _Tail(ids, None, 0, cut=start, canonical=True)

    def _remember(self, scan: Scan, keyed: list[int], tail: _Tail[Out], start: int) -> None:
        """File a canonical tail's encoding as ``scan``'s (see :meth:`_canonical_tail`), with
        where its keyed cuts and last stable cut fall in it."""
        ids = tail.chunks()
        id_of = self.model.boundary_id_of
        prior = tail.prior
        if prior is not None:
            assert tail.new is not None
            at = {c: t - tail.lo for c, t in prior.cut_tokens.items() if c >= start}
            off = tail.hi - tail.lo  # where ``new`` starts in the tail's ids
            for c, t in _cut_tokens(scan, keyed, tail.new, id_of, tail.cut, 0, {}).items():
                at[c] = t + off
            scan.encoded = Encoded(start, ids, at)
        else:
            assert tail.ids is not None
            scan.encoded = Encoded(start, ids, _cut_tokens(scan, keyed, tail.ids, id_of, start, 0, {start: 0}))

    # -- step 1: the hit -----------------------------------------------------------------

    def _usable_store(self, tag: bytes, decision: Decision) -> tuple[CacheView | None, bool]:
        """The store (None if it fails) and whether AR entries may exist for this mode."""
        store = self.store
        if store is None:
            return None, False
        try:
            return store, tag == MODE_KV_STABLE and store.holds_ar()
        except StoreError:
            decision.store_errors += 1
            return None, False

    def _read(self, store: CacheView, key: bytes) -> tuple[Ids, int] | None:
        """(container, tokens) of ``key``'s chain, reading only what the memo lacks.

        A key of a record this process holds (it wrote or read it) costs an index probe:
        the slot names the record, the chain's floor is still live, the memo has the ids.
        """
        slot = store.slot(key)
        if slot is None:
            return None
        held = self.memo.held_key(slot[0], key)
        if held is not None and held[2] >= slot[1]:
            return held[0], held[1]
        found = store.read(key, self.memo.known, widened=False)
        if found is None:
            return None
        if found.held is None:
            ids = self.fmt.from_stored(found.rest, store.id_bytes)
        elif found.rest:
            ids = self.fmt.grow(found.held, found.held_tokens, self.fmt.from_stored(found.rest, store.id_bytes))
        else:
            ids = found.held  # the key's own record is held: nothing to read, nothing to copy
        tokens = found.own.base + found.own.n
        self.memo.put(found.own, ids, found.keys or {key: found.own.n})
        return ids, tokens

    def stored_exact(self, key: bytes) -> Ids | None:
        """The ids stored under ``key``, a text's L0 key (``tokcache.store.keys.l0_key``), or
        None (absent, unreadable, a failing store). When present they are what :meth:`tokenize`
        serves for that text (its exact hit, probed first), found without scanning the text."""
        store = self.store
        if store is None:
            return None
        try:
            found = self._read(store, key)
        except StoreError:
            return None
        return None if found is None else found[0]

    def _find_hit(self, store: CacheView | None, keys: TextKeys, spans: Sequence[tuple[int, int]], ar: bool,
                  decision: Decision) -> _Hit[Ids]:
        n = len(spans)
        if store is None:
            return _Hit(None, 0, 0, None, 0)
        try:
            exact = self._read(store, keys.exact_key())
            decision.l0_hit = exact is not None
            if exact is not None:
                decision.source = "l0"
                return _Hit(exact[0], exact[1], -1, None, n, exact=True)
            p, ids, tokens = self._longest(store, keys)
            j = keys.keyed[p] if p >= 0 else -1  # the cut index
            decision.l1_hit = j >= 0
            hit: _Hit[Ids] = _Hit(ids, tokens, spans[j][1] if j >= 0 else 0, keys.key_at(p) if p >= 0 else None,
                                  j + 1)
            if j >= 0:
                decision.source = "l1"
            if ar:
                # The longest recorded output that ends where a boundary past the L1 cut
                # starts: the highest such cut whose key is present and whose chain reads.
                decision.ar_prefix_hit = False
                keys.fill_ar(j + 1, n)
                found = self._ar_hit(store, keys.ar_keys, j, store.last_present(keys.ar_keys, j + 1, n), spans,
                                     decision)
                if found is not None:
                    # Tokens gained over the L1 prefix: the recorded output (and the few
                    # prompt tokens between the L1 cut and the output).
                    decision.ar_spliced_tokens = found.tokens - hit.tokens
                    hit = found
            return hit
        except StoreError:
            decision.store_errors += 1
            return _Hit(None, 0, 0, None, 0)

    def _ar_hit(self, store: CacheView, ar_keys: list[bytes], j: int, i: int, spans: Sequence[tuple[int, int]],
                decision: Decision) -> _Hit[Ids] | None:
        """The prefix AR hit past the L1 cut ``j``: from ``i``, the highest live AR key (-1: none)
        down, the first whose chain reads; else None. Raises StoreError."""
        while i >= 0:
            key = ar_keys[i]
            found = self._read(store, key)
            if found is not None:
                decision.ar_prefix_hit = True
                decision.source = "ar"
                return _Hit(found[0], found[1], spans[i][0], key, i)
            i = store.last_present(ar_keys, j + 1, i)
        return None

    @staticmethod
    def _pending(store: CacheView, keys: TextKeys, lo: int) -> bool:
        """Whether a mark (``Store.mark``) says an output recorded in another process ends
        at a cut ``>= lo`` past the hit: its response was sent before the sidecar stored it
        (the response's wait for its record timed out), so a client may already send the
        turn that follows it. Free while no mark put in the segment may be live: the gate the
        native path (:meth:`_extend`) uses, so both probe the same marks, and neither does once
        every mark ever put has expired (a mark only says "wait" until its deadline)."""
        try:
            if not store.marks_live(time.time()):
                return False
            n = len(keys.ar_keys)
            if lo >= n:
                return False
            keys.fill_ar(lo, n)
        except StoreError:
            return False
        return Lookup._marked(store, keys.ar_keys, lo)

    @staticmethod
    def _marked(store: CacheView, ar_keys: list[Any], lo: int) -> bool:
        """Whether one of the marks of the AR keys ``ar_keys[lo:]`` (all made) is live."""
        try:
            marks = [pending_key(k) for k in ar_keys[lo:]]
            return bool(marks) and store.last_present(marks, 0, len(marks)) >= 0
        except StoreError:
            return False

    def _longest(self, store: CacheView, keys: TextKeys) -> tuple[int, Ids | None, int]:
        """(keyed position, container, tokens) of the longest keyed cut whose prefix is
        cached, or (-1, None, 0).

        The last TAIL_PROBES keyed cuts are probed from the end down in one store call (a
        conversation's previous turn is among them). If none is present, the ones before
        are searched by galloping back with index-only probes and binary-searching the
        bracket (a rewritten history). Only the winner's chain is read; a winner whose
        chain turns out broken is skipped for the next shorter present cut.
        Deterministic in the segment's contents.
        """
        n = len(keys.keyed)
        window = max(0, n - TAIL_PROBES)
        keys.fill(window, n)
        lo = store.last_present(keys.keys, window, n)
        if lo < 0 and window > 0:
            lo = self._gallop(store, keys, window)
        if lo < 0:
            return -1, None, 0
        for p in range(lo, max(-1, lo - TAIL_PROBES), -1):
            found = self._read(store, keys.key_at(p))
            if found is not None:
                return p, found[0], found[1]
        return -1, None, 0

    @staticmethod
    def _gallop(store: CacheView, keys: TextKeys, n: int) -> int:
        """A present keyed position below ``n`` (probed n-1, n-2, n-4, ... then binary-searched), or -1."""
        hi = n - 1  # highest position that may be present
        lo = -1  # known present (or -1)
        step = 1
        probe = n - 1
        while probe > lo:
            if store.probe(keys.key_at(probe)):
                lo = probe
                break
            hi = probe - 1
            probe = n - 1 - step
            step *= 2
        if lo < 0 and probe < 0 <= hi and store.probe(keys.key_at(0)):
            lo = 0
        if lo < 0:
            return -1
        # Present at lo, absent at every probed position above it: binary search (lo, hi].
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if store.probe(keys.key_at(mid)):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- step 2: the tail ----------------------------------------------------------------

    def _encode_tail(self, store: CacheView | None, scan: Scan, keyed: list[int], tail_text: str | None, hit: _Hit[Ids],
                     salt: str, tag: bytes, tier: bool = False) -> _Tail[Out]:
        """Encode ``data[hit.start:]`` piece by piece (body, boundary token), one native call;
        with a store, splice recorded outputs (segment AR).

        A body whose text — from its start, or after one of its first newlines (a role
        header such as ``assistant\\n``) — is a recorded output is encoded as
        ``encode(header) + recorded ids``.
        """
        encoder = self.model.encoder
        data, spans = scan.data, scan.spans
        if store is None and self.model.boundary_ids and not tier:
            # The cuts are safe boundaries, so the tail encodes in one call; where each
            # cut falls is found from the boundary ids on the write path, if ever needed.
            # Nothing recorded applies here (no store is given then): a head may serve.
            return self._canonical_tail(scan, keyed, tail_text, hit.start)
        splices = self._splices(store, scan, hit, salt, tag) if store is not None else {}
        if not splices and not tier and self.model.boundary_ids:
            return self._canonical_tail(scan, keyed, tail_text, hit.start)
        pieces: list[tuple[bytes, bytes]] = []
        a = hit.start
        for s_i, e_i in spans[hit.first_new:]:
            pieces.append((data[a:s_i], data[s_i:e_i]))
            a = e_i
        pieces.append((data[a:], b""))
        if tier:
            # The pieces after the last one a local record applies to may be outputs
            # recorded on another node (a tail reaching back past a keyed cut can hold
            # this node's older outputs before them).
            last = max(splices, default=-1)
            candidates = [(segment_key(salt, tag, body[p:]), body[p:]) for k, (body, _) in enumerate(pieces)
                          if k > last and len(body) >= MIN_SEGMENT_BYTES for p in _segment_starts(body)]
            if candidates:
                raise TierNeeded(candidates)
        if not splices:
            if self.model.boundary_ids:
                return self._canonical_tail(scan, keyed, tail_text, hit.start)
            flat, ends = encoder.encode_pieces([(b + t).decode("utf-8") for b, t in pieces])
            return _Tail(self._own(flat), ends, 0)
        # Spliced pieces are encoded as two texts (header, token) around the recorded ids.
        texts: list[str] = []
        for k, (body, token) in enumerate(pieces):
            if k in splices:
                texts += [body[:splices[k][0]].decode("utf-8"), token.decode("utf-8")]
            else:
                texts.append((body + token).decode("utf-8"))
        flat, ends = encoder.encode_pieces(texts)
        flat = self._own(flat)
        out: list[int] = []
        piece_ends: list[int] = []
        prev = e = spliced = 0
        for k in range(len(pieces)):
            if k in splices:
                ar_ids = self.fmt.own_u32(splices[k][1])
                out += flat[prev:ends[e]]
                out += ar_ids
                out += flat[ends[e]:ends[e + 1]]
                spliced += len(ar_ids)
                prev = ends[e + 1]
                e += 2
            else:
                out += flat[prev:ends[e]]
                prev = ends[e]
                e += 1
            piece_ends.append(len(out))
        return _Tail(out, piece_ends, spliced)


def _same(ids: list[int]) -> list[int]:
    """``ids`` as they are (see Lookup._own)."""
    return ids


def _file_state(scan: Scan, ns: tuple[str, bytes], state: KeyState) -> None:
    """Keep ``state`` (where hashing ``scan``'s text stopped) for the text that extends it.

    Its lists (keys, None and cut indices: in no cycle) are untracked by the cyclic garbage
    collector (tokcache.engine.ids.untrack): the scans a reader keeps hold ~770 of them in a
    long run, the AR keys' ~300 items each, and every collection visited each item (a full
    one ~15 ms in 57 KB agent chats, every ~2500 requests)."""
    untrack(state.ar)
    untrack(state.l1)
    untrack(state.keyed)
    scan.hashers[ns] = state


def _cut_tokens(scan: Scan, keyed: list[int], ids: list[int], id_of: Mapping[bytes, int], start: int, pos: int,
                at: dict[int, int]) -> dict[int, int]:
    """``at`` completed with where the keyed cuts of ``scan``'s text after byte ``start`` (at
    token ``pos`` of ``ids``) and its last stable cut fall in ``ids`` (byte offset -> tokens
    before it). Each boundary token encodes to its own id once per occurrence, in order:
    one list.index per cut walks there. On a surprise (it cannot happen) ``at`` stays as far
    as it got, and a later lookup of a missing cut re-encodes."""
    spans, data = scan.spans, scan.data
    last = scan.stable - 1
    i = bisect_left(spans, (start, -1))
    k = bisect_left(keyed, i)
    if _native is not None and isinstance(id_of, dict):  # the same walk in C
        _native.cut_tokens(data, spans, i, last, keyed, k, ids, pos, id_of, at)
        return at
    try:
        while i <= last:
            s, e = spans[i]
            pos = ids.index(id_of[data[s:e]], pos) + 1
            if (k < len(keyed) and keyed[k] == i) or i == last:
                at[e] = pos
            if k < len(keyed) and keyed[k] <= i:
                k += 1
            i += 1
    except (KeyError, ValueError):
        pass
    return at


def commit(store: WriteView, memo: ChainMemo[Ids], write: PendingWrite[Ids], *,
           lock_timeout: float | None = None) -> RecordRef | None:
    """Store a pending write: one record, its keys; remember its ids in ``memo``.

    Returns the record, or None when the store refused it (parent gone, full) — the
    result was served anyway. Raises StoreError when the store fails (LockTimeout when
    another writer holds the segment longer than ``lock_timeout``: the store's default).
    """
    entries = write.entries()
    ref = store.put(write.parent, write.parent_tokens, LISTS.to_u32(write.ids, write.ids.n), entries, Kind.L1,
                    lock_timeout=lock_timeout)
    write.decision.stored = ref is not None
    if ref is not None:
        shift = ref.n - len(write.ids)  # > 0 when the store inlined the parent's ids
        memo.put(ref, memo.fmt.compact(write.full), {e[0]: e[1] + shift for e in entries})
    return ref


class WriteView(Protocol):
    """What :func:`commit` needs: ``Store.put``."""

    def put(self, parent: bytes | None, parent_tokens: int, ids: bytes,
            entries: Sequence[tuple[bytes, int] | tuple[bytes, int, Kind]], kind: Kind, *,
            lock_timeout: float | None = None) -> RecordRef | None: ...


def _splice_at(store: CacheView, body: bytes, starts: Sequence[int], salt: str, tag: bytes) -> tuple[int, bytes] | None:
    """The first of ``starts`` from which ``body`` is a recorded output: (start, its ids as packed
    u32), or None."""
    for p in starts:
        try:
            found = store.read(segment_key(salt, tag, memoryview(body)[p:]))
        except StoreError:
            found = None
        if found is not None and found.held is None:
            return p, found.rest
    return None


def _segment_starts(piece: bytes) -> list[int]:
    """Offsets where a recorded output may start in a piece: 0 and after early newlines."""
    starts = [0]
    pos = piece.find(b"\n", 0, _SEGMENT_HEADER_BYTES)
    while pos >= 0 and len(starts) < _SEGMENT_MAX_STARTS:
        starts.append(pos + 1)
        pos = piece.find(b"\n", pos + 1, _SEGMENT_HEADER_BYTES)
    return [s for s in starts if s < len(piece)]
