"""Tokenize and record in the caller's process, from and into the sidecar's shared memory.

The sidecar owns a POSIX shared-memory segment per tokenizer and publishes in it what a
reader needs (the encoder backend it proved exact, the safe boundary tokens, the
affixes: the *manifest*). A process on the same node maps that segment, builds the same
:class:`~tokcache.engine.lookup.ReadModel` from its own copy of ``tokenizer.json``
(checked against the segment's fingerprint) and runs the same
:class:`~tokcache.engine.lookup.Lookup` the sidecar runs for ``Tokenize``: a hit costs
hashing, a few index probes, the chain records this process does not already hold, and
encoding the new tail — no RPC, no sidecar CPU, no deadline to miss.

Writes happen in the request that makes them, in this process, under the segment's writer
lock (a process that can map the segment writable could write anything into it anyway, so
this adds no trust):

* **A record is the conversation's write.** A recorded output (:meth:`LocalModel.record`,
  verified here as the sidecar verifies it: ``tokcache.engine.record``) is stored as one
  chain with the entries of the prompt it follows. So a read whose output will be recorded
  stores nothing itself: the prompt it served is kept (:class:`~tokcache.engine.record.Served`)
  until the record takes it. Once a process has recorded an output, its kv-stable reads
  leave their entries to their records.
* **Other reads** (a process that only tokenizes, exact-mode reads) store their entries
  before returning, when they encoded at least ``min_write_bytes`` of new text: less would
  cost this process more than another process's re-encoding of it (which it saves).
* A prompt whose record does not come within ``RECORD_DEFER_S`` (an aborted request, a
  ``/tokenize`` call) is stored by this process's next read or record, when it leaves the
  bounded table of served prompts, or by :meth:`LocalModel.flush`.

A process that cannot write the segment hands writes to the sidecar: a read's as a
``Tokenize`` RPC whose reply nobody waits for, a record as ``RecordOutput`` (the client).

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

from sidecar_client import _models, _validate
from sidecar_client._fingerprint import find_tokenizer_json
from sidecar_client._models import TokenizeResult, local_result
from sidecar_client._telemetry import trace_local, trace_local_record
from sidecar_client.errors import InvalidArgumentError, ResourceExhaustedError
from tokcache.engine.errors import InvalidRequest, RequestTooLarge
from tokcache.engine.ids import LISTS, Chunks
from tokcache.engine.lookup import Limits, Lookup, PendingWrite, ReadModel, Result, TierNeeded, commit
from tokcache.engine.memo import ChainMemo
from tokcache.engine.record import OutputChecks, Recorder, RecordResult, Served
from tokcache.engine.tokenizer import Manifest, ManifestMismatch, from_manifest
from tokcache.store import Kind, LockTimeout, SegmentError, SegmentMismatch, Store, StoreError, StoreReader
from tokcache.store._layout import RETIRED_MARK, W_RETIRED
from tokcache.store.keys import output_key, pending_key

__all__ = ["MIN_WRITE_BYTES", "LocalModel", "LocalPaths", "LocalStats", "LocalUnavailable", "OpenJob",
           "RecordPending"]

log = logging.getLogger("sidecar_client.local")

RECHECK_S = 1.0  # how often a mapping is checked against the name (replaced?) and the manifest
# A read that stores its own entries (see the module docstring) does so when it encoded at
# least this many UTF-8 bytes. Storing costs the request a record write (~20-40 µs plus the
# writer lock); another process's re-encoding of what was not stored costs ~6 µs per KB, and
# this process re-encodes none of it (its next turn starts from its own previous encoding,
# Lookup._canonical_tail). A read that found nothing cached stores from MIN_FIRST_WRITE_BYTES:
# a conversation's first entries let every later turn start from a hit.
MIN_WRITE_BYTES = 4096
MIN_FIRST_WRITE_BYTES = 1024
# Prompts a process keeps for the records of their outputs (per model): more than the
# requests an API server has in flight. The oldest is stored (by size, as a read's write)
# and dropped past it.
SERVED_MAX = 4096
# Served prompts are filed under their text's length and last this many characters (and the
# salt), the text compared when taken: hashing the whole text (a fresh str) costs ~20 µs
# for a 57 KB prompt.
SERVED_KEY_CHARS = 256
# How long a read's own write waits for the writer lock before it leaves its entries
# unstored (counted ``busy``): the request must not wait on another process's write.
READ_LOCK_S = 0.01
# How long a record waits for the writer lock: a record is the conversation's only write,
# and its caller (vLLM's response) waits for it.
RECORD_LOCK_S = 0.5
# How long a read's entries wait for the record of its output (a generation's length) before
# the next read or record of this process stores them: a read that no record follows (a
# /tokenize request, an aborted generation) must not keep what it learned from others for
# long. A generation that takes longer costs one more write, never a miss.
RECORD_DEFER_S = 10.0


def _record(local: LocalModel, item: dict[str, Any], out_ids: list[int]) -> _models.RecordResult:
    """One checked ``record_output`` item into ``local`` (engine errors are the caller's to map)."""
    stop = item["stop_reason"]
    r = local.record(prompt_text=item["prompt_text"], prompt_ids=item["prompt_token_ids"],
                     output_text=item["output_text"], output_ids=out_ids, finish_reason=item["finish_reason"] or "",
                     stop_token_id=None if stop is None or isinstance(stop, str) else int(stop),
                     stop_string=stop if isinstance(stop, str) else None, salt=item["cache_salt"] or "",
                     prompt_add_special_tokens=bool(item["prompt_add_special_tokens"]))
    return _models.RecordResult(recorded_tokens=r.recorded_tokens, stop_token_dropped=r.stop_token_dropped,
                                entries=r.entries)


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
    - ``writes``: what reads did with their entries: ``stored`` (by the read), ``deferred``
      (left to the record of their output), ``for_record`` (stored by that record, in one
      chain with the output), ``skipped`` (under ``min_write_bytes``), ``learned`` (sent to
      the sidecar: no write access here), ``busy`` (the writer lock stayed taken), ``refused``
      (the store took nothing: parent gone, full), ``failed`` (a store error)
    - ``records``: outputs recorded in this process (``recorded``, ``refused``: failed
      verification); a record sent to the sidecar (RecordOutput) is the sidecar's to count
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
    records: Counter[str] = field(default_factory=Counter)
    pending: Counter[str] = field(default_factory=Counter)
    paths: Counter[str] = field(default_factory=Counter)
    declines: Counter[str] = field(default_factory=Counter)

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"tokenize": dict(self.tokenize), "fallbacks": dict(self.fallbacks), "writes": dict(self.writes),
                "records": dict(self.records), "pending": dict(self.pending), "paths": dict(self.paths),
                "declines": dict(self.declines)}


Learn = Callable[[str, str, str, str], None]
"""learn(model, text, salt, mode): ask the sidecar to tokenize (and so store) ``text``; must not block."""


def _served_key(text: str, salt: str) -> tuple[int, str, str]:
    """The key a served prompt is filed under (see SERVED_KEY_CHARS). Texts that share it
    replace each other: the one replaced is stored as a read's write would be."""
    return len(text), text[-SERVED_KEY_CHARS:], salt


class LocalModel:
    """One model's in-process path: reads and records. Thread-safe; close when done.

    Create with :meth:`open`. :meth:`tokenize` is not to be called once :attr:`stale` is
    True (the segment was replaced, or its manifest changed): the caller opens a new one.
    """

    def __init__(self, name: str, reader: StoreReader, manifest_raw: bytes, model: ReadModel, limits: Limits,
                 memo: ChainMemo[Chunks], writable: Store | None, checks: OutputChecks, stats: LocalStats, *,
                 learn: Learn | None = None, tier: bool = False, min_write_bytes: int = MIN_WRITE_BYTES) -> None:
        self.name = name
        self.min_write_bytes = min_write_bytes
        self._first_write_bytes = min(min_write_bytes, MIN_FIRST_WRITE_BYTES)
        # The sidecar has a cluster tier (manifest): what no local AR applies to goes to it.
        self.tier = tier
        self.reader = reader
        self.model = model
        self.fingerprint = model.fingerprint
        self.backend = model.encoder.name
        self.memo = memo
        self.stats = stats
        self.lookup: Lookup[Chunks, list[int]] = Lookup(model, reader, memo, limits)
        self.recorder: Recorder[Chunks, list[int]] | None = None if writable is None else Recorder(
            model, checks, self.lookup, self._serve, writable, max_text_bytes=limits.max_text_bytes,
            store_failed=self._store_failed, lock_timeout=RECORD_LOCK_S)
        self._writable = writable
        self._learn = learn
        # _served_key(text, salt) -> the prompt a read served, for its record; newest last.
        self._served: OrderedDict[tuple[int, str, str], Served[Chunks, list[int]]] = OrderedDict()
        # True once this process recorded an output (here or over RPC): its kv-stable reads
        # then leave their entries to their records.
        self._records_follow = False
        # (when, served) of reads whose entries wait for their records, oldest first.
        self._deferred: deque[tuple[float, Served[Chunks, list[int]]]] = deque()
        self._lock = threading.Lock()  # guards _served, _deferred and _records_follow
        self._manifest_raw = manifest_raw
        self._words = reader._words  # the header words: W_RETIRED is checked on every request
        self._checked = time.monotonic()
        self._stale = False
        self._closed = False

    @classmethod
    def open(cls, name: str, shm_name: str, *, tokenizer_json: Path | None, fingerprint: str | None = None,
             writable: bool = True, learn: Learn | None = None, stats: LocalStats | None = None,
             encoder: Any = None, min_write_bytes: int = MIN_WRITE_BYTES) -> LocalModel:  # noqa: ANN401
        """Map ``shm_name`` and build the in-process path for model ``name``.

        ``tokenizer_json``: this process's copy of the tokenizer (its fingerprint must be
        the segment's). ``writable``: store entries and records directly (else reads hand
        theirs to ``learn`` and records go over RPC). Raises LocalUnavailable with the reason.
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
                checks = OutputChecks(tokenizer_json, manifest.vocab_size)
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
                    log.info("tokcache: segment %s is not writable here (%s); entries and records go to the "
                             "sidecar", shm_name, exc)
            return cls(name, reader, raw, model, limits, memo, store, checks, stats, learn=learn,
                       tier=manifest.ar_tier, min_write_bytes=min_write_bytes)
        except BaseException:
            reader.close()
            raise

    @property
    def writes_directly(self) -> bool:
        """True when entries and records go straight into the segment (else through the sidecar)."""
        return self._writable is not None

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

    # -- reads -----------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special_tokens: bool, salt: str, mode: str,
                 may_wait: bool = False) -> Result[Chunks, list[int]]:
        """Ids of ``text`` decided in this process (the caller checked :attr:`stale` first).

        ``may_wait``: raise RecordPending (nothing kept, nothing stored) when the text
        continues a recorded output marked as on its way, instead of serving it without it.

        Raises the engine's InvalidRequest / RequestTooLarge for bad input, like the RPC, and
        TierNeeded (before encoding) when the sidecar has a cluster tier and no recorded output
        applies here: only the sidecar can ask the tier, so the request is for it. The read's
        entries are stored, or kept for the record of its output, before it returns.
        """
        result = self.lookup.tokenize(text, add_special_tokens=add_special_tokens, salt=salt, mode=mode,
                                      tier=self.tier)
        if may_wait and result.decision.ar_pending:
            raise RecordPending(self.name)
        self._keep(text, salt, mode, add_special_tokens, result)
        return result

    def _keep(self, text: str, salt: str, mode: str, add_special_tokens: bool,
              result: Result[Chunks, list[int]]) -> None:
        """File what a read served for the record of its output, and store its entries now
        unless that record will (see the module docstring)."""
        write = result.write
        if result.full is None:
            if write is not None:  # (special tokens the cache cannot separate: nothing is cached)
                self._store_read(write, text, salt, mode)
            return
        defer = self._records_follow and mode == "kv-stable"
        if write is not None:
            if defer:
                self.stats.writes["deferred"] += 1
            else:
                self._store_read(write, text, salt, mode)
        affixes = self.model.affixes
        prefix, suffix = (affixes.prefix, affixes.suffix) if add_special_tokens else ((), ())
        served = Served(text, salt, mode, add_special_tokens, result.ids, result.full, result.n, write, prefix, suffix)
        key = _served_key(text, salt)
        now = time.monotonic()
        with self._lock:
            old = self._served.pop(key, None)
            self._served[key] = served
            out = self._served.popitem(last=False)[1] if len(self._served) > SERVED_MAX else None
            if defer and write is not None:
                self._deferred.append((now, served))
        self._store_overdue(now)
        for gone in (old, out):
            if (gone is not None and gone is not served and gone.write is not None
                    and gone.write.decision.stored is None):
                self._store_read(gone.write, gone.text, gone.salt, gone.mode)

    def _store_read(self, write: PendingWrite[Chunks], text: str, salt: str, mode: str) -> None:
        """Store a read's entries now, in this thread, if it encoded enough (see MIN_WRITE_BYTES).
        Never raises."""
        decision = write.decision
        if decision.encoded_bytes < (self.min_write_bytes if decision.cached_bytes else self._first_write_bytes):
            self.stats.writes["skipped"] += 1
            decision.stored = False
            return
        store = self._writable
        if store is None:
            decision.stored = False
            if self._learn is not None:
                try:
                    self._learn(self.name, text, salt, mode)
                    self.stats.writes["learned"] += 1
                except Exception:  # never fail a read for a write
                    log.debug("tokcache: handing a write to the sidecar failed", exc_info=True)
                    self.stats.writes["failed"] += 1
            return
        try:
            ref = commit(store, self.memo, write, lock_timeout=READ_LOCK_S)
        except LockTimeout:
            decision.stored = False
            self.stats.writes["busy"] += 1
            return
        except StoreError as exc:
            decision.stored = False
            self._store_failed(exc, "a read's entries are not stored")
            self.stats.writes["failed"] += 1
            return
        self.stats.writes["stored" if ref is not None else "refused"] += 1

    def _store_overdue(self, now: float) -> None:
        """Store the entries of reads whose records did not come within RECORD_DEFER_S."""
        deferred = self._deferred
        while deferred and deferred[0][0] < now - RECORD_DEFER_S:
            with self._lock:
                if not deferred or deferred[0][0] >= now - RECORD_DEFER_S:
                    return
                served = deferred.popleft()[1]
            write = served.write
            if write is not None and write.decision.stored is None:
                self._store_read(write, served.text, served.salt, served.mode)

    def _store_failed(self, exc: StoreError, consequence: str) -> None:
        log.debug("tokcache: model %s: store error (%s): %s", self.name, consequence, exc)

    # -- records ---------------------------------------------------------------------------

    def note_record(self) -> None:
        """This process records its outputs (also over RPC): its kv-stable reads leave their
        entries to their records from now on."""
        self._records_follow = True

    def served(self, prompt_text: str, salt: str) -> Served[Chunks, list[int]] | None:
        """Take the prompt a read of this process served for ``prompt_text`` (None: none kept)."""
        with self._lock:
            key = _served_key(prompt_text, salt)
            got = self._served.get(key)
            if got is None or not (got.text is prompt_text or got.text == prompt_text):
                return None
            return got

    def record(self, *, prompt_text: str, prompt_ids: Sequence[int] | bytes, output_text: str,
               output_ids: list[int], finish_reason: str, stop_token_id: int | None, stop_string: str | None,
               salt: str, prompt_add_special_tokens: bool) -> RecordResult:
        """Verify and store an output in this process (``tokcache.engine.record``), in one chain
        with the entries its prompt's read left. Needs a writable mapping
        (:attr:`writes_directly`). Raises InvalidRequest / RequestTooLarge as RecordOutput would
        (nothing stored)."""
        recorder = self.recorder
        assert recorder is not None, "records need a writable mapping"
        self._records_follow = True
        served = self.served(prompt_text, salt)
        try:
            result = recorder.record(prompt_text=prompt_text, prompt_ids=prompt_ids, output_text=output_text,
                                     output_ids=output_ids, finish_reason=finish_reason, stop_token_id=stop_token_id,
                                     stop_string=stop_string, salt=salt,
                                     prompt_add_special_tokens=prompt_add_special_tokens, served=served)
        except (InvalidRequest, RequestTooLarge):
            self.stats.records["refused"] += 1
            # The read's entries waited for this record: they are stored without it.
            if served is not None and served.write is not None and served.write.decision.stored is None:
                self._store_read(served.write, served.text, served.salt, served.mode)
            raise
        finally:
            self._store_overdue(time.monotonic())
        self.stats.records["recorded"] += 1
        if result.prompt == "served" and served is not None and served.write is not None:
            self.stats.writes["for_record"] += 1
        return result

    def _serve(self, prompt_text: str, salt: str) -> tuple[list[int], PendingWrite[Chunks] | None]:
        """What a kv-stable read serves for a recorded prompt this process did not keep, and the
        entries it learned, left for the record."""
        result = self.lookup.tokenize(prompt_text, add_special_tokens=False, salt=salt, mode="kv-stable")
        return result.ids, result.write

    def mark(self, prompt_text: str, output_text: str, salt: str, expiry: int) -> bool:
        """Mark the record of ``output_text`` after ``prompt_text`` as on its way until ``expiry``
        (Unix seconds; 1 withdraws the mark). False when this process cannot write the
        segment or its lock stayed busy for READ_LOCK_S. Never raises for store trouble."""
        if self._writable is None:
            return False
        try:
            key = pending_key(output_key(prompt_text, output_text, salt=salt))
            return self._writable.mark(key, expiry, lock_timeout=READ_LOCK_S)
        except (StoreError, UnicodeEncodeError, ValueError) as exc:
            log.debug("tokcache: could not mark a record as pending: %r", exc)
            return False

    # -- lifecycle -------------------------------------------------------------------------

    def flush(self) -> None:
        """Store the entries of the prompts kept for records that have not come (each by size,
        as a read's write). Never raises."""
        with self._lock:
            kept = [s for s in self._served.values() if s.write is not None and s.write.decision.stored is None]
        for s in kept:
            assert s.write is not None
            self._store_read(s.write, s.text, s.salt, s.mode)

    def close(self) -> None:
        """Store what is kept (:meth:`flush`), then unmap. Idempotent; no call may run concurrently."""
        if self._closed:
            return
        self._closed = True
        self.flush()
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
                 model, shm_name, "direct" if local.writes_directly else "sidecar", local.model.encoder.name)
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

    def writes_directly(self, model: str) -> LocalModel | None:
        """``model``'s open path when it can store records in this process, else None (the
        record goes to the sidecar)."""
        local = self._models.get(model)
        if local is None or local.stale or not local.writes_directly:
            return None
        return local

    def note_record(self, model: str) -> None:
        """An output of ``model`` is recorded over RPC (see :meth:`LocalModel.note_record`)."""
        local = self._models.get(model)
        if local is not None:
            local.note_record()

    def record(self, model: str, *, prompt_text: Any, prompt_token_ids: Any, output_text: Any,  # noqa: ANN401
               output_token_ids: Any, finish_reason: Any, stop_reason: Any, cache_salt: Any,  # noqa: ANN401
               prompt_add_special_tokens: Any,  # noqa: ANN401
               trace: Sequence[tuple[str, str]] = ()) -> _models.RecordResult | None:
        """``record_output`` in this process: the result, or None when ``model``'s segment is not
        writable here (the caller sends RecordOutput; noted, see :meth:`note_record`). Checks
        the arguments first and raises the client's typed errors, as the RPC would: a refusal
        is InvalidArgumentError naming the field. A ``tokcache.RecordOutput`` span, a child of
        the W3C context in ``trace`` (else the current one), shows it when tracing is on."""
        _validate.model_name(model)
        local = self.writes_directly(model)
        if local is None:
            self.note_record(model)
            return None
        t0 = time.perf_counter_ns()
        item = {"prompt_text": prompt_text, "prompt_token_ids": prompt_token_ids, "output_text": output_text,
                "output_token_ids": output_token_ids, "finish_reason": finish_reason, "stop_reason": stop_reason,
                "cache_salt": cache_salt, "prompt_add_special_tokens": prompt_add_special_tokens}
        out_ids = _validate.record_here(model, **item)
        try:
            done = _record(local, item, out_ids)
        except InvalidRequest as exc:
            trace_local_record(model, local.fingerprint, "refused", 0, 0, t0, trace)
            # A bad prompt is named first, as the RPC path's checks name it (checked in full
            # only now: a served prompt's ids were compared with what was served).
            _validate.record_prompt(prompt_text, prompt_token_ids)
            raise InvalidArgumentError(str(exc), field=exc.field) from exc
        except RequestTooLarge as exc:
            trace_local_record(model, local.fingerprint, "refused", 0, 0, t0, trace)
            raise ResourceExhaustedError(str(exc)) from exc
        trace_local_record(model, local.fingerprint, "recorded", done.recorded_tokens, done.entries, t0, trace)
        return done

    def record_many(self, model: str, records: Any) -> _models.RecordSummary | None:  # noqa: ANN401
        """``record_outputs`` in this process, or None (see :meth:`record`). Every item's
        arguments are checked before any is stored (InvalidArgumentError naming
        ``records[i].<key>``); a record that fails verification is listed, not raised."""
        _validate.model_name(model)
        local = self.writes_directly(model)
        if local is None:
            self.note_record(model)
            return None
        items = [_validate.record_item(r, f"records[{i}]") for i, r in enumerate(_validate.records(records))]
        checked = [_validate.record_here(model, **item, where=f"records[{i}].") for i, item in enumerate(items)]
        for i, item in enumerate(items):  # every argument checked before any record is stored
            _validate.record_prompt(item["prompt_text"], item["prompt_token_ids"], f"records[{i}].")
        refusals: list[tuple[int, str]] = []
        for i, (item, out_ids) in enumerate(zip(items, checked, strict=True)):
            try:
                _record(local, item, out_ids)
            except (InvalidRequest, RequestTooLarge) as exc:
                refusals.append((i, str(exc)))
        return _models.RecordSummary(recorded=len(items) - len(refusals), refused=len(refusals), refusals=refusals)

    def flush(self) -> None:
        """Store what every model keeps for records that have not come (LocalModel.flush)."""
        for local in list(self._models.values()):
            local.flush()

    def close(self) -> None:
        """Write what is pending and unmap every segment. Idempotent."""
        with self._lock:
            self._closed = True
            models, self._models = [*self._models.values(), *self._old], {}
            self._old = []
        for local in models:
            local.close()
