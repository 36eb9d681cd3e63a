"""One served model: its tokenizer, template and cache; Tokenize through the shared lookup; RecordOutput.

The read side (finding the cached prefix, encoding the tail, splicing recorded outputs)
is :class:`tokcache.engine.lookup.Lookup`, the same code a client runs in its own
process on a read-only mapping: a decision made here and one made there are the same.
What only the sidecar does lives here: proving the tokenizer (exactness gate, boundary
self-check) and publishing the verdicts in the segment's manifest, rendering chat
templates, writing the entries a Tokenize learned, and verifying recorded outputs
before anyone can read them (the sidecar is the authority for AR records).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokcache.engine.errors import InvalidRequest, RequestTooLarge
from tokcache.engine.ids import BYTES
from tokcache.engine.lookup import Decision, Later, Limits, Lookup, PendingWrite, Result, commit, utf8
from tokcache.engine.memo import ChainMemo
from tokcache.engine.record import OutputChecks, Recorder, RecordResult, verify_segment
from tokcache.engine.tokenizer import Manifest, Proven, fingerprint_of, prove
from tokcache.ids import le_bytes
from tokcache.sidecar.engine.render import ChatRenderer
from tokcache.sidecar.tier import decode_value
from tokcache.store import Kind, Store, StoreError
from tokcache.store.keys import KEY_GRID

log = logging.getLogger(__name__)

__all__ = ["Decision", "Limits", "ModelEngine", "Outcome", "RecordResult", "fingerprint_of", "utf8"]

@dataclass
class Outcome:
    """Result of :meth:`ModelEngine.tokenize`: ids as little-endian uint32 bytes."""

    ids: bytes
    decision: Decision
    # The entries the lookup learned, stored by commit() (None: nothing to store).
    write: PendingWrite[bytes] | None = field(default=None, repr=False)
    engine: ModelEngine | None = field(default=None, repr=False)
    # The read's bookkeeping (Lookup.settle), until its engine settles it, which makes ``write``.
    later: Later[bytes] | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.ids) // 4

    def commit(self) -> None:
        """Settle the read's bookkeeping (and any read's before it), then store the new
        entries (no-op when there are none or they were stored)."""
        if self.engine is None:
            return
        if self.later is not None:
            self.engine.settle_pending()
        write, self.write = self.write, None
        if write is not None:
            self.engine.commit(write)


class ModelEngine:
    """Everything needed to serve one tokenizer; thread-safe after construction."""

    def __init__(self, name: str, path: Path, *, store: Store | None,
                 limits: Limits | None = None, backends: tuple[str, ...] = ("fastokens", "tokenizers"),
                 key_grid: int = KEY_GRID) -> None:
        self.name = name
        self.path = path
        tokenizer_json = path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"model {name!r}: {tokenizer_json} not found")
        self.tokenizer_json = tokenizer_json
        self.proven: Proven = prove(tokenizer_json, backends=backends, key_grid=key_grid)
        model = self.proven.model
        self.fingerprint = model.fingerprint
        self.encoder = model.encoder
        self.reference = self.proven.choice.reference
        self.vocab_size = model.vocab_size
        self.boundary_check = self.proven.boundaries
        self.scanner = model.scanner
        self.affixes = model.affixes
        self.renderer: ChatRenderer | None = ChatRenderer.from_dir(path)
        self.checks = OutputChecks(tokenizer_json, self.vocab_size, reference=self.reference.tokenizer)
        self.token_bytes = self.checks.token_bytes
        # Ids that vLLM may leave out of the text at the end of an output (EOS and friends).
        self.special_ids = self.checks.special_ids
        self.limits = limits or Limits()
        self.memo: ChainMemo[bytes] = ChainMemo(BYTES)
        self._store_failures = 0  # failed store writes, and when one was last logged (monotonic)
        self._store_failure_logged = 0.0
        # Reads leave their bookkeeping (filing the scan and encoding the next turn extends,
        # making the write) for after the reply: Outcome.commit, or the next read before its
        # lookup (it extends what they file), in the order read. That is ~45 µs of a 57 KB
        # chat's turn on the native path, off the RPC's latency.
        self.lookup = Lookup(model, store, self.memo, self.limits, defer=True)
        self._unsettled: deque[Outcome] = deque()
        self._settle_lock = threading.Lock()  # guards _unsettled: settled one at a time, in order
        self._store: Store | None = None
        self._recorder: Recorder[bytes, bytes] | None = None
        self.store = store
        choice = self.proven.choice
        log.info(
            "model %s: fingerprint %s, backend %s (passed %s, failed %s), %d boundary tokens%s, %s",
            name, self.fingerprint, self.encoder.name, ",".join(choice.passed), ",".join(choice.failed) or "-",
            len(self.boundary_check.boundary_tokens),
            f" (L1 off: {self.boundary_check.disabled_reason})" if self.boundary_check.disabled_reason else "",
            _describe_affixes(self.affixes.prefix, self.affixes.suffix, self.affixes.separable, self.affixes.reason),
        )

    @property
    def store(self) -> Store | None:
        """The model's segment (None: no cache). Set once the store is open (before serving)."""
        return self._store

    @store.setter
    def store(self, store: Store | None) -> None:
        self._store = store
        self.lookup.store = store
        self._recorder = None if store is None else Recorder(
            self.proven.model, self.checks, self.lookup, self._serve_prompt, store,
            max_text_bytes=self.limits.max_text_bytes, store_failed=self._store_failed)

    def manifest(self, models: list[str], ttl: dict[str, float] | None = None, *, ar_tier: bool = False) -> Manifest:
        """What a reader of this model's segment needs (``models``: the names served for it;
        ``ar_tier``: a cluster tier is configured, so readers send what no local AR applies to here)."""
        return Manifest.of(self.proven, self.tokenizer_json, limits=self.limits, models=models,
                           model_dirs=[str(self.path.resolve())], ttl=ttl, ar_tier=ar_tier)

    def publish(self, models: list[str], ttl: dict[str, float] | None = None, *, ar_tier: bool = False) -> bool:
        """Publish the manifest in the segment (True), or log why readers cannot use it."""
        if self.store is None:
            return False
        try:
            self.store.publish(self.manifest(models, ttl, ar_tier=ar_tier).to_bytes())
        except (ValueError, StoreError) as exc:
            log.warning("model %s: manifest not published (%s); clients use the RPC path", self.name, exc)
            return False
        return True

    # -- rendering --------------------------------------------------------

    def render(self, messages: Any, **options: Any) -> str:
        """Render chat messages with the model's template (see ChatRenderer.render)."""
        if self.renderer is None:
            raise InvalidRequest("chat", f"model {self.name!r} has no chat template")
        if isinstance(messages, list) and len(messages) > self.limits.max_messages:
            raise RequestTooLarge("chat.messages", self.limits.max_messages)
        return self.renderer.render(messages, **options)

    # -- tokenize ---------------------------------------------------------

    def tokenize(self, text: str, *, add_special_tokens: bool, salt: str = "",
                 mode: str = "kv-stable", defer_store: bool = False, tier: bool = False) -> Outcome:
        """Ids of ``text`` (== HF tokenizers ``encode(text, add_special_tokens)``), via the cache.

        With ``defer_store`` the new cache entries are not written yet: the caller
        answers first and then calls ``Outcome.commit()``. Raises InvalidRequest for
        text that is not valid Unicode and RequestTooLarge over the size limit. A failing
        store degrades to plain encoding; it never fails the request. ``tier``: raise
        :class:`~tokcache.engine.lookup.TierNeeded` (before encoding) when no recorded output
        applies locally; the caller asks the cluster tier, passes what it got to
        :meth:`accept_tier`, and calls again without ``tier``.

        A text that extends one this process tokenized is served by the read side's native
        fast path, as in a client's process (:meth:`~tokcache.engine.lookup.Lookup.tokenize`);
        the RPC path's requests come as ``str``, so this is their entry.
        """
        self.settle_pending()
        result = self.lookup.tokenize(text, add_special_tokens=add_special_tokens, salt=salt, mode=mode, tier=tier)
        return self._outcome(result, defer_store)

    def _outcome(self, result: Result[bytes, bytes], defer_store: bool) -> Outcome:
        out = Outcome(result.ids, result.decision, result.write, self, result.later)
        if result.later is not None:
            with self._settle_lock:
                self._unsettled.append(out)
        if not defer_store:
            out.commit()
        return out

    def settle_pending(self) -> None:
        """Settle the reads whose bookkeeping waits, in the order read (each makes its
        Outcome's write). Never raises: a read whose bookkeeping fails only costs the next
        turn its fast path and this one its entries (logged)."""
        with self._settle_lock:
            while self._unsettled:
                out = self._unsettled.popleft()
                later, out.later = out.later, None
                if later is None:
                    continue
                try:
                    out.write = self.lookup.settle(later)
                except Exception:
                    log.exception("model %s: settling a read failed; its entries are not stored", self.name)

    def commit(self, write: PendingWrite[bytes]) -> None:
        """Store what a Tokenize learned (never raises: a failing store only costs the entries)."""
        assert self.store is not None
        t0 = time.perf_counter_ns()
        try:
            commit(self.store, self.memo, write)
        except StoreError as exc:
            self._store_failed(exc, "result served uncached")
            write.decision.store_errors += 1
        write.decision.timings["insert"] = (t0, time.perf_counter_ns())

    # -- AR: recorded outputs ---------------------------------------------

    def record_output(self, *, prompt_text: str, prompt_ids: list[int] | bytes, output_text: str,
                      output_ids: list[int], finish_reason: str = "stop", stop_token_id: int | None = None,
                      stop_string: str | None = None, salt: str = "",
                      prompt_add_special_tokens: bool = False) -> RecordResult:
        """Verify a finished generation and store its chain (``tokcache.engine.record``: the
        same writer a client runs in its own process).

        ``prompt_ids``: a list, or packed little-endian uint32 (as RecordOutput carries them:
        compared as they are, never unpacked when they are what tokcache serves). Raises
        InvalidRequest (no record stored) when the output ids do not decode to the text, an id
        is out of the vocabulary, the finish was a stop string, or the prompt ids are neither
        what tokcache serves for ``prompt_text`` nor its canonical tokenization.
        """
        recorder = self._recorder
        if recorder is None:
            raise InvalidRequest("model", "no cache configured")
        return recorder.record(prompt_text=prompt_text, prompt_ids=prompt_ids, output_text=output_text,
                               output_ids=output_ids, finish_reason=finish_reason, stop_token_id=stop_token_id,
                               stop_string=stop_string, salt=salt, prompt_add_special_tokens=prompt_add_special_tokens)

    def _serve_prompt(self, prompt_text: str, salt: str) -> tuple[bytes, PendingWrite[bytes] | None]:
        """What Tokenize serves for a recorded prompt (kv-stable, no special tokens) and the
        entries it learned, unstored: the record stores them with the output."""
        out = self.tokenize(prompt_text, add_special_tokens=False, salt=salt, mode="kv-stable", defer_store=True)
        self.settle_pending()
        write, out.write = out.write, None
        return out.ids, write

    def accept_tier(self, candidates: list[tuple[bytes, bytes]], values: dict[bytes, bytes]) -> tuple[int, int]:
        """Verify segment entries read from the cluster tier and store the good ones here.

        ``candidates``: (segment key, piece text) as :class:`TierNeeded` named them;
        ``values``: the tier's value per key. A value is used only if it was written for
        this tokenizer (fingerprint), its ids are in the vocabulary and decode exactly to
        the piece's text — the checks a local RecordOutput passes, so a tampered or foreign
        value is never spliced. Returns (stored, invalid). Never raises.
        """
        if not values or self.store is None:
            return 0, 0
        stored = invalid = 0
        for key, text in candidates:
            value = values.get(key)
            if value is None:
                continue
            ids = decode_value(value, self.fingerprint)
            if ids is None or not verify_segment(text, ids, vocab_size=self.vocab_size, decode=self._decode):
                invalid += 1
                continue
            stored += 1 if self._put_ar(None, 0, le_bytes(array("I", ids)), [(key, len(ids))]) else 0
        return stored, invalid

    def _put_ar(self, parent: bytes | None, parent_tokens: int, ids: bytes,
                keys: list[tuple[bytes, int]]) -> int:
        """Store one AR record; the number of keys stored (0 if the store refused or failed)."""
        assert self.store is not None
        try:
            return len(keys) if self.store.put(parent, parent_tokens, ids, keys, Kind.AR) else 0
        except StoreError as exc:
            self._store_failed(exc, "output not recorded")
            return 0

    def _store_failed(self, exc: StoreError, consequence: str) -> None:
        """Log a failed store write: the first in full, then one line a minute with the count.

        A full /dev/shm fails every write while it lasts; a traceback per request would
        flood the log (the metric tokcache_store_fallbacks_total counts them all)."""
        now = time.monotonic()
        self._store_failures += 1
        if self._store_failures == 1:
            log.exception("store write failed (%s); %s", exc, consequence)
            self._store_failure_logged = now
        elif now - self._store_failure_logged >= 60.0:
            log.warning("store writes failing: %d so far, latest: %s; %s", self._store_failures, exc, consequence)
            self._store_failure_logged = now

    def _decode(self, ids: list[int]) -> str:
        return self.checks.decode(ids)

    def info(self) -> dict[str, Any]:
        """Static facts about this model, for ListModels and logs."""
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "backend": self.encoder.name,
            "vocab_size": self.vocab_size,
            "boundary_tokens": len(self.boundary_check.boundary_tokens),
            "l1_disabled_reason": self.boundary_check.disabled_reason,
            "has_chat_template": self.renderer is not None,
            "shm_name": self.store.name if self.store is not None else "",
        }


def _describe_affixes(prefix: tuple[int, ...], suffix: tuple[int, ...], separable: bool, reason: str) -> str:
    if not separable:
        return f"special tokens not separable ({reason}): add_special_tokens requests bypass the cache"
    if not prefix and not suffix:
        return "no special tokens added around prompts"
    return f"adds {list(prefix)} before and {list(suffix)} after prompts with add_special_tokens"
