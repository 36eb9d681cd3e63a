"""The plugin's connection to the sidecar: handshake, Tokenize, RecordOutputs.

Built on the client's shared core (request building, response reading, error
translation) with its own ``grpc.aio`` channel, because the plugin needs what
a general client does not: per-call trace metadata, a short reconnect backoff
(the channel reconnects to a restarted sidecar within a second, so the next
breaker probe finds it), and a breaker around every call. Calls never wait
for a connection (no ``wait_for_ready``): a dead sidecar costs nothing, a
hung one costs one deadline per breaker probe.

Nothing here raises into vLLM: :meth:`SidecarLink.tokenize` returns either the
served ids or the reason to fall back. Runs on one event loop (no locks); a
call from another loop gets a channel of its own.

Handshake: ``ListModels``, then the model whose tokenizer fingerprint equals
vLLM's (or ``TOKCACHE_MODEL``, which must match too). A refused handshake is
retried every ``breaker_reset_s``; every Tokenize reply's fingerprint is
checked again, so a sidecar restarted with another tokenizer is caught.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc

from sidecar_client import _core
from sidecar_client._results import ResultCache
from sidecar_client._tokenize_stream import AsyncTokenizeStream
from sidecar_client.errors import (
    DeadlineExceeded,
    InvalidArgumentError,
    ResourceExhaustedError,
    SidecarUnavailable,
    TokcacheError,
    UnknownModelError,
    translate,
)
from sidecar_client.vllm._breaker import BreakerState, CircuitBreaker
from sidecar_client.vllm._config import ENV, PluginConfig
from sidecar_client.vllm._stats import PluginStats
from tokcache.v1 import tokenizer_pb2 as pb
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc

__all__ = ["CHANNEL_OPTIONS", "HandshakeState", "LinkStatus", "Served", "SidecarLink"]

log = logging.getLogger("vllm.tokcache.link")

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
    """Ids the sidecar returned for a prompt, and how it produced them."""

    token_ids: list[int]
    model: str
    source: str
    cached_tokens: int
    ar_spliced_tokens: int


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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._tstream: AsyncTokenizeStream | None = None
        self._results = ResultCache()
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
    def _stub_here(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._stub is None or self._loop is not loop:
            # A channel belongs to the loop it was created on; an old one is left to the GC.
            self._channel = grpc.aio.insecure_channel(_core.channel_target(self.config.address),
                                                      options=CHANNEL_OPTIONS)
            self._stub = pb_grpc.TokenizerStub(self._channel)
            self._tstream = AsyncTokenizeStream(self._channel, ())
            self._loop = loop
        return self._stub

    async def close(self) -> None:
        """Close the channel (same loop only); idempotent."""
        channel, self._channel, self._stub = self._channel, None, None
        if self._tstream is not None:
            self._tstream.close()
            self._tstream = None
        if channel is not None and self._loop is asyncio.get_running_loop():
            await channel.close()

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
            resp = await self._stub_here().ListModels(pb.ListModelsRequest(), timeout=max(1.0, self.config.timeout_s))
            models = _core.read_models(resp)
        except grpc.RpcError as exc:
            self.breaker.failure()
            self._set_handshake("unreachable", f"ListModels on {self.config.address} failed: {translate(exc)}")
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
        self._set_handshake("ready")

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

        Waits at most ``timeout_s`` (plus a handshake bounded the same way).
        """
        try:
            model = await self._ready_model()
            if model is None:
                return self._not_ready_reason()
            if not self.breaker.allow():
                return "breaker_open"
            # Deltas both ways on the results held for this conversation (see _core.TokenizePlan).
            plan = _core.TokenizePlan(self._results, model, text=text, messages=None, tools=None,
                                      add_generation_prompt=False, continue_final_message=False,
                                      chat_template_kwargs=None, add_special_tokens=add_special_tokens,
                                      cache_salt=cache_salt, mode="kv-stable", return_prompt_text=False)
            for key, value in trace:
                if key in _TRACE_KEYS:
                    setattr(plan.sreq, key, value)
            stub = self._stub_here()
            assert self._tstream is not None
            timeout = self.config.timeout_s

            async def unary(left: float | None) -> Any:
                try:
                    return await stub.Tokenize(plan.req, timeout=left, metadata=tuple(trace) or None)
                except grpc.RpcError as exc:
                    raise translate(exc) from exc

            # The open stream when free (half the per-call cost), else a unary call.
            resp = await self._tstream.send(plan, timeout, unary)
            result = plan.finish(resp)
        except asyncio.CancelledError:
            raise
        except TokcacheError as exc:
            return self._failed(exc)
        except Exception:
            log.exception("tokcache: unexpected error in Tokenize; falling back")
            self.breaker.failure()
            return "plugin_error"
        self.breaker.success()
        if result.fingerprint != self.fingerprint:
            self.model = None
            self._retry_at = 0.0
            self._set_handshake("pending", "")
            log.warning("tokcache: sidecar model %r now serves tokenizer %s, not vLLM's %s; handshaking again",
                        model, result.fingerprint, self.fingerprint)
            return "fingerprint_changed"
        d = result.decision
        return Served(result.token_ids, model, d.source, d.cached_tokens, d.ar_spliced_tokens)

    async def record(self, model: str, records: list[Mapping[str, Any]], trace: Sequence[tuple[str, str]]) -> None:
        """Send ``records`` on one RecordOutputs stream; counts outcomes in ``stats``. Never raises."""
        n = len(records)
        if self.handshake != "ready" or model != self.model:
            self.stats.record_skips["sidecar_changed"] += n
            return
        if not self.breaker.allow():
            self.stats.record_skips["breaker_open"] += n
            return
        reqs = []
        for r in records:
            try:
                reqs.append(_core.build_record(model, **_core.record_kwargs(r)))
            except TokcacheError:
                self.stats.record_skips["invalid"] += 1
        if not reqs:
            return
        try:
            resp = await self._stub_here().RecordOutputs(iter(reqs), timeout=self.config.record_timeout_s,
                                                         metadata=tuple(trace) or None)
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as exc:
            self._failed(translate(exc))
            self.stats.records["failed"] += len(reqs)
            return
        except Exception:
            log.exception("tokcache: unexpected error in RecordOutputs")
            self.stats.records["failed"] += len(reqs)
            return
        self.breaker.success()
        self.stats.records["recorded"] += resp.recorded
        self.stats.records["refused"] += resp.refused
        for refusal in resp.refusals:
            self._refusals += 1
            # The first few in full, then a sample: refusals are expected now and then
            # (special tokens in skipped text), a flood means a bug worth seeing.
            if self._refusals <= 10 or self._refusals % 1000 == 0:
                log.info("tokcache: the sidecar refused a record (%d so far): %s", self._refusals, refusal.reason)
