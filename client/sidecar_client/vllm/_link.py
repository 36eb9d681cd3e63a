"""The plugin's connection to the sidecar: handshake, tokenize, RecordOutputs.

Built on the public :class:`~sidecar_client.AsyncSidecarClient` (one per event loop):
its in-process read path answers a prompt from the node's shared memory with no RPC
whenever the sidecar's segment for vLLM's tokenizer can be mapped here; otherwise the
client's ``Tokenize`` RPC does, with this call's deadline and trace metadata. The plugin
adds what a general client does not need: a short reconnect backoff (a restarted
sidecar is found again within a second), a circuit breaker around every RPC (reads in
this process need none: they cannot hang), and the fingerprint handshake. Calls never
wait for a connection (no ``wait_for_ready``): a dead sidecar costs nothing, a hung one
costs one deadline per breaker probe.

Nothing here raises into vLLM: :meth:`SidecarLink.tokenize` returns either the served
ids or the reason to fall back. Runs on one event loop (no locks); a call from another
loop gets a client of its own.

Handshake: ``ListModels``, then the model whose tokenizer fingerprint equals vLLM's (or
``TOKCACHE_MODEL``, which must match too). A refused handshake is retried every
``breaker_reset_s``; every answer's fingerprint is checked again, so a sidecar restarted
with another tokenizer is caught.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sidecar_client import _core
from sidecar_client._async import AsyncSidecarClient
from sidecar_client._local import LocalPaths
from sidecar_client._models import TokenizeResult
from sidecar_client.errors import (
    DeadlineExceeded,
    InvalidArgumentError,
    ResourceExhaustedError,
    SidecarUnavailable,
    TokcacheError,
    UnknownModelError,
)
from sidecar_client.vllm._config import ENV, PluginConfig
from sidecar_client.vllm._recorder import PendingRecord
from sidecar_client.vllm._stats import PluginStats
from tokcache.breaker import BreakerState, CircuitBreaker

__all__ = ["CHANNEL_OPTIONS", "HandshakeState", "LinkStatus", "Served", "SidecarLink"]

log = logging.getLogger("vllm.tokcache.link")


def _log_open_failure(opening: asyncio.Future[Any]) -> None:
    """Log an in-process open that raised (LocalPaths.get reports the expected refusals itself
    and answers None); retrieving it keeps asyncio from logging "never retrieved" instead."""
    if not opening.cancelled() and (exc := opening.exception()) is not None:
        log.warning("tokcache: opening the in-process path failed; prompts go to the sidecar: %r", exc)


_TRACE_KEYS = frozenset({"traceparent", "tracestate"})

HandshakeState = Literal["pending", "ready", "refused", "unreachable", "disabled"]

# Reconnect quickly: the default backoff grows to 120 s, far longer than a sidecar restart.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    *_core.CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(frozen=True)
class Served:
    """Ids the cache gave for a prompt, how, and where (``served_by``: "local" when decided
    in this process from shared memory, "sidecar" when its Tokenize RPC answered)."""

    token_ids: list[int]
    model: str
    source: str
    cached_tokens: int
    ar_spliced_tokens: int
    served_by: str = "sidecar"


@dataclass(frozen=True)
class LinkStatus:
    """For metrics: breaker and handshake state."""

    breaker: BreakerState
    breaker_opens: int
    model: str
    handshake: HandshakeState
    fingerprint: str


class SidecarLink:
    """One sidecar, one model. ``fingerprint`` is vLLM's tokenizer's (None: the path stays off)."""

    def __init__(self, config: PluginConfig, fingerprint: str | None, stats: PluginStats, *,
                 tokenizer_file: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.tokenizer_file = tokenizer_file
        self.stats = stats
        self._clock = clock
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_reset_s, clock=clock,
                                      on_change=self._breaker_changed)
        self.model: str | None = None
        self.handshake: HandshakeState = "pending"
        self.reason = ""
        self._retry_at = 0.0
        self._inflight: asyncio.Task[None] | None = None
        self._opening: asyncio.Future[Any] | None = None  # the in-process path being opened (a worker thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: AsyncSidecarClient | None = None
        self._models: list[Any] = []  # the last ListModels answer (for a client made later)
        self._refusals = 0
        if fingerprint is None:
            self._set_handshake("disabled", "vLLM's tokenizer has no tokenizer.json to fingerprint "
                                            "(a slow or non-HF tokenizer); the sidecar is not used")

    # -- status ---------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """The handshake chose a model; Tokenize calls go out (breaker permitting)."""
        return self.handshake == "ready"

    def status(self) -> LinkStatus:
        return LinkStatus(self.breaker.state, self.breaker.opens, self.model or "", self.handshake,
                          self.fingerprint or "")

    def _set_handshake(self, state: HandshakeState, reason: str = "") -> None:
        # Log state changes, and a refusal whose reason changed; not every failed retry.
        changed = state != self.handshake or (state == "refused" and reason != self.reason)
        self.handshake, self.reason = state, reason
        if not changed:
            return
        if state == "ready":
            log.info("tokcache: using sidecar model %r at %s (tokenizer fingerprint %s matches vLLM's %s)",
                     self.model, self.config.address, self.fingerprint, self.tokenizer_file or "tokenizer")
        elif state in ("refused", "disabled", "unreachable"):
            log.warning("tokcache: sidecar path off (%s): %s; vLLM tokenizes in-process", state, reason)

    def _breaker_changed(self, old: BreakerState, new: BreakerState) -> None:
        if new == "open":
            log.warning("tokcache: circuit breaker open (%s -> open) after failures talking to %s; "
                        "vLLM tokenizes in-process, probing every %gs", old, self.config.address,
                        self.config.breaker_reset_s)
        elif new == "closed":
            log.info("tokcache: sidecar at %s answers again; circuit breaker closed", self.config.address)

    # -- channel --------------------------------------------------------------------------
    def client(self) -> AsyncSidecarClient:
        """This loop's client (a gRPC channel belongs to the loop it was created on)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            # An old loop's client is left to the GC; its segment mappings go with it.
            tokenizers = {m.name: self.tokenizer_file for m in self._models} if self.tokenizer_file else {}
            self._client = AsyncSidecarClient(self.config.address, timeout=self.config.timeout_s,
                                              zero_rpc=self.config.zero_rpc, tokenizers=tokenizers,
                                              channel_options=CHANNEL_OPTIONS[len(_core.CHANNEL_OPTIONS):])
            if self._client.local is not None:
                self._client.local.stats.pending = self.stats.pending  # counted as plugin metrics too
                self._client.local.stats.paths = self.stats.paths
                self._client.local.stats.declines = self.stats.declines
                if self._models:
                    self._client.local.set_models(self._models)
            self._loop = loop
        return self._client

    async def close(self) -> None:
        """Store pending writes, unmap, close the channel (same loop only); idempotent."""
        client, self._client = self._client, None
        if client is not None and self._loop is asyncio.get_running_loop():
            await client.close()

    # -- handshake ------------------------------------------------------------------------
    def start_handshake(self) -> None:
        """Begin the handshake in the background (call from the event loop); no-op elsewhere."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._maybe_start_handshake()

    def _maybe_start_handshake(self) -> asyncio.Task[None] | None:
        if self._inflight is not None and not self._inflight.done():
            return self._inflight
        if self.handshake in ("ready", "disabled") or self._clock() < self._retry_at:
            return None
        if not self.breaker.allow():
            return None
        self._inflight = asyncio.get_running_loop().create_task(self._handshake(), name="tokcache-handshake")
        return self._inflight

    async def _ready_model(self) -> str | None:
        if self.handshake == "ready":
            return self.model
        task = self._maybe_start_handshake()
        if task is None:
            return None
        try:
            await asyncio.wait_for(asyncio.shield(task), self.config.timeout_s)
        except asyncio.TimeoutError:
            return None
        return self.model if self.ready else None

    async def _handshake(self) -> None:
        try:
            client = self.client()
            models = await client.list_models(timeout=max(1.0, self.config.timeout_s))
        except TokcacheError as exc:
            self.breaker.failure()
            self._set_handshake("unreachable", f"ListModels on {self.config.address} failed: {exc}")
            return
        except Exception as exc:  # a malformed reply: treat as a failed call
            self.breaker.failure()
            self._set_handshake("unreachable", f"ListModels on {self.config.address} failed: {exc!r}")
            return
        self.breaker.success()
        served = ", ".join(f"{m.name}={m.fingerprint}" for m in models) or "none"
        wanted = self.config.model
        if wanted is not None:
            match = next((m for m in models if m.name == wanted), None)
            if match is None:
                self._refuse(f"the sidecar does not serve {ENV['model']}={wanted!r} (it serves {served})")
                return
            if match.fingerprint != self.fingerprint:
                self._refuse(f"sidecar model {wanted!r} serves tokenizer fingerprint {match.fingerprint}, "
                             f"vLLM's tokenizer ({self.tokenizer_file}) is {self.fingerprint}: a different tokenizer")
                return
            chosen = match
        else:
            matches = [m for m in models if m.fingerprint == self.fingerprint]
            if not matches:
                self._refuse(f"no sidecar model serves vLLM's tokenizer ({self.tokenizer_file}, fingerprint "
                             f"{self.fingerprint}); the sidecar serves {served}")
                return
            chosen = matches[0]
        self.model = chosen.name
        self._models = [chosen]
        if client.local is not None:
            if self.tokenizer_file:
                client.local.tokenizers[chosen.name] = Path(self.tokenizer_file)
            client.local.set_models(self._models)
            # Map the segment and load the encoder (~1 s) on a worker thread now, not in the
            # first prompt on the event loop; prompts go over RPC until it is done.
            self._open_local(client.local, chosen.name)
        self._set_handshake("ready")

    def _open_local(self, paths: LocalPaths, model: str) -> None:
        """Open ``model``'s in-process path on a worker thread when there is one to open (call
        from the event loop): the first, a segment replaced by a restarted sidecar, a retry
        after a failed attach (at most every RETRY_S). Claimed here, before the thread runs, so
        this prompt's own RPC fallback (AsyncSidecarClient) finds it being opened."""
        job = paths.claim_open(model)
        if job is None:
            return
        try:
            self._opening = asyncio.get_running_loop().run_in_executor(None, job)
        except RuntimeError as exc:  # the loop's executor was shut down (vLLM is exiting)
            job.cancel()
            log.debug("tokcache: could not start opening %r in this process: %s", model, exc)
            return
        self._opening.add_done_callback(_log_open_failure)

    def _refuse(self, reason: str) -> None:
        self.model = None
        self._retry_at = self._clock() + self.config.breaker_reset_s
        self._set_handshake("refused", reason)

    def _not_ready_reason(self) -> str:
        if self.handshake == "refused":
            return "handshake_refused"
        if self.handshake == "disabled":
            return "no_fingerprint"
        if self.breaker.state != "closed":
            return "breaker_open"
        return "sidecar_unreachable" if self.handshake == "unreachable" else "handshake_pending"

    # -- calls ----------------------------------------------------------------------------
    def _failed(self, err: TokcacheError) -> str:
        """Account a failed call; the fallback reason."""
        if isinstance(err, (InvalidArgumentError, ResourceExhaustedError)):
            self.breaker.success()  # the sidecar is fine; this request is not for it
            return "too_large" if isinstance(err, ResourceExhaustedError) else "rejected"
        if isinstance(err, UnknownModelError):
            self.breaker.success()
            self.model = None
            self._retry_at = 0.0
            self._set_handshake("pending", "")
            return "unknown_model"
        self.breaker.failure()
        if isinstance(err, DeadlineExceeded):
            return "deadline"
        return "unavailable" if isinstance(err, SidecarUnavailable) else "sidecar_error"

    async def tokenize(self, text: str, *, add_special_tokens: bool, cache_salt: str | None,
                       trace: Sequence[tuple[str, str]] = ()) -> Served | str:
        """Ids for ``text`` in kv-stable mode, or the reason to let vLLM tokenize. Never raises.

        In this process when the segment is mapped (no RPC, no breaker: a read cannot
        hang); else over RPC, waiting at most ``timeout_s`` (plus a handshake bounded the
        same way) unless the breaker is open.
        """
        try:
            model = await self._ready_model()
            if model is None:
                return self._not_ready_reason()
            client = self.client()
            metadata = tuple((k, v) for k, v in trace if k in _TRACE_KEYS)
            # Only a path already open here: opening one (mapping, loading the encoder: ~1 s, and
            # again after a sidecar restart replaced the segment) runs on a worker thread, never
            # on vLLM's event loop; the sidecar answers meanwhile.
            local = False
            if client.local is not None:
                local = client.local.is_open(model)
                if not local:
                    self._open_local(client.local, model)
            result: TokenizeResult | None = None
            if local and self.breaker.state != "closed":
                # In-process only: a read that would need the sidecar (a request the cluster
                # tier may know, a segment being re-mapped) must not reach a sidecar the
                # breaker keeps us away from.
                result = await client._local_result(model, text, add_special_tokens, cache_salt, "kv-stable",
                                                    metadata)
                if result is None and not self.breaker.allow():
                    return "breaker_open"
            elif not local and not self.breaker.allow():
                return "breaker_open"
            if result is None:
                result = await client.tokenize(model, text=text, add_special_tokens=add_special_tokens,
                                               cache_salt=cache_salt, mode="kv-stable",
                                               timeout=self.config.timeout_s, metadata=metadata)
        except asyncio.CancelledError:
            raise
        except TokcacheError as exc:
            return self._failed(exc)
        except Exception:
            log.exception("tokcache: unexpected error in Tokenize; falling back")
            self.breaker.failure()
            return "plugin_error"
        if result.served_by == "sidecar":
            self.breaker.success()
        if result.fingerprint != self.fingerprint:
            self.model = None
            self._retry_at = 0.0
            self._set_handshake("pending", "")
            log.warning("tokcache: sidecar model %r now serves tokenizer %s, not vLLM's %s; handshaking again",
                        model, result.fingerprint, self.fingerprint)
            return "fingerprint_changed"
        d = result.decision
        return Served(result.token_ids, model, d.source, d.cached_tokens, d.ar_spliced_tokens, result.served_by)

    def mark_pending(self, records: Sequence[PendingRecord], seconds: float) -> int:
        """Mark (``seconds`` > 0) or unmark (0) ``records`` as on their way in the segment
        this process reads (see ``AsyncSidecarClient.mark_pending``); how many were put.
        Never raises: a mark is an optimisation of the next turn's ids."""
        client = self._client
        if client is None or client.local is None or not records:
            return 0
        try:
            return client.mark_pending(records[0].model, [
                (r.record.get("prompt_text", ""), r.record.get("output_text", ""), r.record.get("cache_salt") or "")
                for r in records], seconds)
        except Exception:
            log.exception("tokcache: could not mark records as pending")
            return 0

    def record_here(self, model: str, record: Mapping[str, Any], trace: Sequence[tuple[str, str]] = ()) -> bool:
        """Verify and store one record in this process, from and into the node's shared memory
        (no RPC): True when it was handled here (recorded or refused, counted), False when this
        process cannot write the segment (the caller sends it to the sidecar). Never raises."""
        client = self._client
        if client is None or client.local is None or self.handshake != "ready" or model != self.model:
            return False
        try:
            done = client.local.record(model, **record, trace=tuple((k, v) for k, v in trace if k in _TRACE_KEYS))
        except InvalidArgumentError as exc:
            self.stats.records["refused"] += 1
            self._refused(str(exc))
            return True
        except TokcacheError as exc:
            self.stats.records["failed"] += 1
            log.debug("tokcache: recording in this process failed: %r", exc)
            return True
        except Exception:
            log.exception("tokcache: unexpected error recording an output in this process")
            self.stats.records["failed"] += 1
            return True
        if done is None:
            return False
        self.stats.records["recorded"] += 1
        return True

    def _refused(self, reason: str) -> None:
        """Log a refused record: the first few in full, then a sample (refusals are expected now
        and then, e.g. special tokens in skipped text; a flood means a bug worth seeing)."""
        self._refusals += 1
        if self._refusals <= 10 or self._refusals % 1000 == 0:
            log.info("tokcache: a record was refused (%d so far): %s", self._refusals, reason)

    async def record(self, model: str, records: list[Mapping[str, Any]], trace: Sequence[tuple[str, str]]) -> None:
        """Send ``records`` on one RecordOutputs stream; counts outcomes in ``stats``. Never raises."""
        n = len(records)
        if self.handshake != "ready" or model != self.model:
            self.stats.record_skips["sidecar_changed"] += n
            return
        if not self.breaker.allow():
            self.stats.record_skips["breaker_open"] += n
            return
        reqs: list[Mapping[str, Any]] = []
        for r in records:
            try:
                _core.build_record(model, **_core.record_kwargs(r))  # checked here: one bad record is skipped
            except TokcacheError:
                self.stats.record_skips["invalid"] += 1
            else:
                reqs.append(r)
        if not reqs:
            return
        try:
            resp = await self.client().record_outputs(model, reqs, timeout=self.config.record_timeout_s,
                                                      metadata=tuple(trace))
        except asyncio.CancelledError:
            raise
        except TokcacheError as exc:
            self._failed(exc)
            self.stats.records["failed"] += len(reqs)
            return
        except Exception:
            log.exception("tokcache: unexpected error in RecordOutputs")
            self.stats.records["failed"] += len(reqs)
            return
        self.breaker.success()
        self.stats.records["recorded"] += resp.recorded
        self.stats.records["refused"] += resp.refused
        for _index, reason in resp.refusals:
            self._refused(reason)
