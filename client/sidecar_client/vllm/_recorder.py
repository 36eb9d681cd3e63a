"""A bounded queue of records drained in the background, in batches.

The generate wrapper calls :meth:`RecordQueue.offer` (never blocks, never
raises); a drainer task sends what accumulated with one ``RecordOutputs``
stream per (model, trace context). When the queue is full the new record is
dropped and counted: a slow or dead sidecar costs cache entries, never stream
latency. Everything runs on one event loop (no locks).

Read-your-writes, across processes: an agent sends the next turn the moment a
response ends, and with several API servers that turn may land in another
process. So the response itself waits (bounded) for its record: each record
carries a ``done`` future, resolved when its batch was answered, and the
generate wrapper holds back the output that finishes a choice until then
(``PluginRuntime.wait_records``). Within one process,
:meth:`RecordQueue.wait_related` also lets a Tokenize wait for a pending record
whose prompt + output the new text continues (the case where the response's
wait timed out); unrelated prompts never wait.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sidecar_client.vllm._stats import PluginStats

__all__ = ["DEFAULT_BATCH", "QUEUE_BOUND", "PendingRecord", "RecordQueue", "SendBatch", "TraceMetadata"]

# Plugin loggers live under "vllm." so vLLM's logging config (handler, format, level) applies.
log = logging.getLogger("vllm.tokcache.recorder")

DEFAULT_BATCH = 64
# Finished outputs a process keeps while its sidecar is slow: far more than the choices vLLM
# finishes while one batch is answered. Past it a slow or dead sidecar costs records (counted
# as dropped), never memory or a response's latency.
QUEUE_BOUND = 1024

TraceMetadata = tuple[tuple[str, str], ...]
# send(model, records, trace metadata) -> None; raises on transport failure (counted, batch dropped)
SendBatch = Callable[[str, list[Mapping[str, Any]], TraceMetadata], Awaitable[None]]


@dataclass(frozen=True)
class PendingRecord:
    """One finished choice waiting to be sent (keyword arguments of ``record_output``).

    ``done`` (optional) is resolved once the batch holding this record has been answered
    by the sidecar (recorded or refused) or has failed: the response that produced the
    record may wait on it, so that a client which has the response finds the record in
    the shared cache from any process on the node.
    """

    model: str
    record: Mapping[str, Any]
    trace: TraceMetadata = ()
    done: asyncio.Future[None] | None = None


class RecordQueue:
    """Bounded FIFO + drainer. ``offer`` from the event loop; ``aclose`` to flush on shutdown."""

    def __init__(self, bound: int, send: SendBatch, stats: PluginStats, *, batch: int = DEFAULT_BATCH) -> None:
        if bound < 1 or batch < 1:
            raise ValueError("bound and batch must be >= 1")
        self.bound = bound
        self.batch = batch
        self._send = send
        self._stats = stats
        self._items: deque[PendingRecord] = deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._inflight: list[PendingRecord] = []  # the batch being sent
        self._progress: asyncio.Event | None = None  # set (and replaced) when a batch is done

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, item: PendingRecord) -> bool:
        """Queue ``item``; False (and counted as dropped) if the queue is full or closed."""
        if self._closed or len(self._items) >= self.bound:
            self._stats.records["dropped"] += 1
            if item.done is not None and not item.done.done():
                item.done.set_result(None)  # nobody waits for a record that will never be sent
            return False
        self._items.append(item)
        self._stats.records["queued"] += 1
        self._ensure_drainer()
        return True

    def _ensure_drainer(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (tests of the bound): items wait for one
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._drain(self._wake), name="tokcache-record-drainer")
        assert self._wake is not None
        self._wake.set()

    def take_batch(self) -> list[PendingRecord]:
        """Pop up to ``batch`` items, oldest first."""
        n = min(self.batch, len(self._items))
        return [self._items.popleft() for _ in range(n)]

    async def _drain(self, wake: asyncio.Event) -> None:
        while True:
            if not self._items:
                if self._closed:
                    return
                wake.clear()
                await wake.wait()
                continue
            await self.flush_once()

    async def flush_once(self) -> None:
        """Send one batch, grouped by (model, trace). Never raises (except cancellation)."""
        self._inflight = self.take_batch()
        groups: dict[tuple[str, TraceMetadata], list[Mapping[str, Any]]] = {}
        for item in self._inflight:
            groups.setdefault((item.model, item.trace), []).append(item.record)
        try:
            for (model, trace), records in groups.items():
                try:
                    await self._send(model, records, trace)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the transport failed: drop the batch, keep draining
                    self._stats.records["failed"] += len(records)
                    log.debug("tokcache: dropping %d record(s): %r", len(records), exc)
        finally:
            for item in self._inflight:
                if item.done is not None and not item.done.done():
                    item.done.set_result(None)
            self._inflight = []
            progress, self._progress = self._progress, None
            if progress is not None:
                progress.set()

    def related(self, text: str, salt: str | None) -> bool:
        """A queued or in-flight record (same salt) whose prompt + output ``text`` continues."""
        for item in (*self._inflight, *self._items):
            r = item.record
            if (r.get("cache_salt") or None) != (salt or None):
                continue
            prompt, output = r.get("prompt_text", ""), r.get("output_text", "")
            if text.startswith(prompt) and text.startswith(output, len(prompt)):
                return True
        return False

    async def wait_related(self, text: str, salt: str | None, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until no pending record is continued by ``text``.

        True at once in the common case (nothing related pending); False on timeout.
        """
        if not self.related(text, salt):
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.related(text, salt):
            remaining = deadline - loop.time()
            if remaining <= 0 or self._task is None or self._task.done():
                return False
            if self._progress is None:
                self._progress = asyncio.Event()
            try:
                await asyncio.wait_for(self._progress.wait(), remaining)
            except asyncio.TimeoutError:
                return False
        return True

    async def aclose(self, timeout: float = 2.0) -> None:
        """Stop accepting, try to send what is queued within ``timeout``, stop the drainer."""
        self._closed = True
        task = self._task
        if task is None or task.done():
            return
        assert self._wake is not None
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except (asyncio.TimeoutError, Exception):
            task.cancel()
