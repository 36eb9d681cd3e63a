"""The plugin's per-process state, between vLLM's hooks and the sidecar link.

One :class:`PluginRuntime` per frontend process (vLLM may build several
renderers; they share it). It owns the link, the record queue, the map of
served prompts and the counters. Its methods take plain values, so the logic
is testable without vLLM; ``_renderer.py`` adapts vLLM's objects to them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar_client.vllm._config import PluginConfig
from sidecar_client.vllm._link import SidecarLink
from sidecar_client.vllm._outputs import (
    ChoiceAssembler,
    CompletionLike,
    ServedPrompts,
    held_back_tokens,
    skip_reason,
)
from sidecar_client.vllm._recorder import QUEUE_BOUND, PendingRecord, RecordQueue
from sidecar_client.vllm._stats import PluginStats
from sidecar_client.vllm._trace import trace_metadata

__all__ = ["PluginRuntime", "RequestRecorder"]

log = logging.getLogger("vllm.tokcache.runtime")


class PluginRuntime:
    """Sidecar tokenization and output recording for one process. Event loop only."""

    def __init__(self, config: PluginConfig, fingerprint: str | None, *, tokenizer_file: Path | None = None,
                 decode: Callable[[list[int]], str] | None = None, stats: PluginStats | None = None) -> None:
        """``decode(ids)`` is vLLM's tokenizer's decode without skipping special tokens."""
        self.config = config
        self.decode = decode
        self.stats = stats or PluginStats()
        self.link = SidecarLink(config, fingerprint, self.stats,
                                tokenizer_file=str(tokenizer_file) if tokenizer_file else "")
        self.served = ServedPrompts()
        self.recorder = RecordQueue(QUEUE_BOUND, self.link.record, self.stats)

    def fallback(self, reason: str) -> None:
        """Count a prompt vLLM tokenizes itself."""
        self.stats.fallbacks[reason] += 1

    async def tokenize(self, text: str, *, add_special_tokens: bool, cache_salt: str | None,
                       trace: Sequence[tuple[str, str]] = (), max_length: int | None = None) -> list[int] | None:
        """The sidecar's ids for ``text``, or None (counted) to use vLLM's tokenizer. Never raises.

        ``max_length``: vLLM's tokenizer would truncate beyond it; such prompts
        are left to vLLM (which truncates or rejects them). If the previous
        turn's record is still queued, waits for it first (at most ``timeout_s``).
        """
        if self.recorder.related(text, cache_salt):  # the previous turn's record is still on its way
            self.stats.record_waits += 1
            await self.recorder.wait_related(text, cache_salt, self.config.timeout_s)
        t0 = time.perf_counter()
        outcome = await self.link.tokenize(text, add_special_tokens=add_special_tokens, cache_salt=cache_salt,
                                           trace=trace)
        if isinstance(outcome, str):
            self.fallback(outcome)
            return None
        self.stats.observe_tokenize(outcome.served_by, time.perf_counter() - t0)
        self.stats.served[outcome.served_by] += 1
        if max_length is not None and len(outcome.token_ids) > max_length:
            self.fallback("too_long")
            return None
        self.stats.tokenize[outcome.source] += 1
        self.stats.cached_tokens += outcome.cached_tokens
        self.stats.ar_spliced_tokens += outcome.ar_spliced_tokens
        self.served.add(cache_salt, text, outcome.token_ids, model=outcome.model,
                        add_special_tokens=add_special_tokens)
        return outcome.token_ids

    async def wait_records(self, records: Sequence[PendingRecord]) -> None:
        """Wait until the records of a finishing response were answered by the sidecar.

        Bounded by ``record_wait_s``; never raises (cancellation aside). Called before the
        output that finishes a choice is handed to vLLM, so a client that has the response
        finds its record in the node's shared cache from any process. A record still
        unanswered then (at once when ``record_wait_s`` is 0) is *marked* as on its way in the
        segment before the response goes (:meth:`SidecarLink.mark_pending`), so the next turn,
        in whichever process, waits for it rather than re-encoding the output; the mark is
        withdrawn once the record was answered (stored, refused or failed).
        """
        pending = [r for r in records if r.done is not None and not r.done.done()]
        if not pending:
            return
        if self.link.breaker.state == "open":
            return  # the sidecar is failing: its records will not come back in time either
        if self.config.record_wait_s <= 0:
            # Told not to wait (TOKCACHE_RECORD_WAIT_MS=0): the response goes now, so every
            # record still on its way is marked, as one that ran out of time would be.
            self._mark(pending)
            return
        t0 = time.perf_counter()
        _, still = await asyncio.wait([r.done for r in pending if r.done is not None],
                                      timeout=self.config.record_wait_s)
        self.stats.observe_record_wait(time.perf_counter() - t0, timed_out=bool(still))
        if still:
            # A sidecar that cannot take a record in time (hung, overloaded) counts as a
            # failure: after a few, the breaker opens and responses stop waiting.
            self.link.breaker.failure()
            self._mark([r for r in pending if r.done in still])

    def _mark(self, late: list[PendingRecord]) -> None:
        """Mark ``late`` (unanswered records of a response about to go) as on their way, each
        withdrawn once answered (see :meth:`wait_records`)."""
        if self.link.mark_pending(late, self.config.record_timeout_s + 1.0):
            for r in late:
                assert r.done is not None
                r.done.add_done_callback(functools.partial(self._withdraw, r))

    def _withdraw(self, record: PendingRecord, _done: asyncio.Future[None]) -> None:
        """Its record was answered (stored, refused or failed): withdraw its mark."""
        self.link.mark_pending([record], 0.0)

    def start_request(self, prompt: Any, *, delta: bool,
                      trace_headers: Mapping[str, str] | None) -> RequestRecorder | None:
        """A recorder for a request whose prompt the sidecar tokenized, else None (counted).

        ``prompt`` is what ``AsyncLLM.generate`` received: a token-input dict
        with ``prompt`` (text), ``prompt_token_ids`` and maybe ``cache_salt``.
        """
        if not isinstance(prompt, Mapping):
            return None  # streaming-input sessions, EngineCoreRequest: nothing to record
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if not isinstance(text, str) or not isinstance(ids, list) or prompt.get("type", "token") != "token":
            self.stats.record_skips["not_text"] += 1
            return None
        salt = prompt.get("cache_salt")
        served = self.served.take(salt, text, ids)
        if served is None:
            self.stats.record_skips["not_served"] += 1
            return None
        return RequestRecorder(self, model=served.model, prompt_text=text, prompt_token_ids=ids,
                               add_special_tokens=served.add_special_tokens, cache_salt=salt, delta=delta,
                               trace=trace_metadata(trace_headers))


@dataclass
class RequestRecorder:
    """Collects one request's outputs (per choice) and queues a record per finished choice."""

    runtime: PluginRuntime
    model: str
    prompt_text: str
    prompt_token_ids: list[int]
    add_special_tokens: bool
    cache_salt: str | None
    delta: bool
    trace: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        self._assembler = ChoiceAssembler(delta=self.delta)

    def feed(self, outputs: Sequence[CompletionLike]) -> list[PendingRecord]:
        """Take one ``RequestOutput.outputs`` and record the choices that finished in it: in this
        process when it can write the node's segment (before returning: the output that
        finishes a choice goes to vLLM after its record is stored, the time counted as the
        response's wait), else queued for the sidecar; the queued ones with a ``done`` future,
        for the response to wait on (see :meth:`PluginRuntime.wait_records`). Never raises."""
        waits: list[PendingRecord] = []
        try:
            finished = self._assembler.feed(outputs)
        except Exception:
            log.exception("tokcache: could not read vLLM's outputs; not recording this request")
            self._assembler = ChoiceAssembler(delta=self.delta)
            return waits
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        stats = self.runtime.stats
        for choice in finished:
            reason = skip_reason(choice)
            if reason is not None:
                stats.record_skips[reason] += 1
                continue
            ids = choice.token_ids
            decode = self.runtime.decode
            if decode is not None:
                try:
                    held = held_back_tokens(ids, choice.text, decode)
                except Exception:
                    held = 0
                if held:
                    ids = ids[:-held]
                    stats.records["trimmed"] += 1
            record = {"prompt_text": self.prompt_text, "prompt_token_ids": self.prompt_token_ids,
                      "output_text": choice.text, "output_token_ids": ids,
                      "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                      "cache_salt": self.cache_salt, "prompt_add_special_tokens": self.add_special_tokens}
            t0 = time.perf_counter()
            if self.runtime.link.record_here(self.model, record, self.trace):
                stats.observe_record_wait(time.perf_counter() - t0, timed_out=False)
                continue
            done = loop.create_future() if loop is not None else None
            item = PendingRecord(self.model, record, self.trace, done)
            if self.runtime.recorder.offer(item) and done is not None:
                waits.append(item)
        return waits
