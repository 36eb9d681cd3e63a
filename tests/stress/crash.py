"""Kill/restart cycles under concurrent load: the body of the crash test and bench/crash_cycles.py.

Each cycle: start a real sidecar on the surviving segment; check a warm hit (a text
answered in the previous life comes back from the cache, with the right ids); put
concurrent load on it from several threads (own connections, random items of a fixed
:class:`~tests.stress.harness.Workload`, text + chat + RecordOutput + AR follow-ups); after
a random delay — sometimes before it is even ready — SIGKILL it; note whether it died
holding the writer lock; count the ``/dev/shm`` objects. Every OK response is checked
against the reference as it arrives; errors (UNAVAILABLE around the kill) are counted
apart from wrong answers.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import posix_ipc

from tests.stress.harness import Item, SidecarProc, Workload, channel, shm_usage, stub, unpack
from tokcache.store._layout import W_LOCK_EPOCH
from tokcache.v1 import tokenizer_pb2 as pb

CACHED = (pb.CACHE_SOURCE_L0, pb.CACHE_SOURCE_L1, pb.CACHE_SOURCE_AR)


@dataclass
class CycleResult:
    cycle: int
    kill_after_s: float
    killed_before_ready: bool
    ok: int = 0
    wrong: int = 0
    errors: int = 0
    warm_checked: int = 0
    warm_hits: int = 0
    died_holding_lock: bool = False
    shm_objects: int = 0
    shm_allocated: int = 0  # every object (segment + semaphore page)
    shm_size: int = 0
    segment_allocated: int = 0  # the segment alone: <= the byte cap


@dataclass
class CrashReport:
    cycles: int
    threads: int
    shm_cap: int
    workload_items: int
    workload_text_bytes: int
    requests_ok: int = 0
    wrong_answers: int = 0
    errors: int = 0
    cycles_with_warm_hit: int = 0
    cycles_warm_checked: int = 0
    kills_before_ready: int = 0
    kills_holding_lock: int = 0
    lock_recoveries: int = 0
    corrupt_reads: int = 0
    shm_after_first: dict[str, Any] = field(default_factory=dict)
    shm_after_last: dict[str, Any] = field(default_factory=dict)
    shm_max_objects: int = 0
    shm_max_allocated: int = 0
    segment_max_allocated: int = 0
    final_stats: dict[str, Any] = field(default_factory=dict)
    wrong_examples: list[str] = field(default_factory=list)
    seconds: float = 0.0
    per_cycle: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _shm_state(prefix: str) -> tuple[int, int, int, int]:
    """(objects, bytes allocated, bytes of file sizes, bytes allocated by the segment itself)."""
    usage = shm_usage(prefix)
    size = segment = 0
    for name in usage.names:
        try:
            st = (Path("/dev/shm") / name).stat()
        except FileNotFoundError:
            continue
        size += st.st_size
        if not name.startswith("sem."):
            segment += st.st_blocks * 512
    return usage.count, usage.allocated, size, segment


def _held_epoch(prefix: str) -> int | None:
    """The writer lock's acquisition epoch (W_LOCK_EPOCH in the segment header) while its
    semaphore is held (value 0), else None."""
    usage = shm_usage(prefix)
    held = False
    for usage_name in usage.names:
        if usage_name.startswith("sem.") and usage_name.endswith(".lock"):
            try:
                sem = posix_ipc.Semaphore("/" + usage_name[len("sem."):])
            except posix_ipc.Error:
                continue
            try:
                held = sem.value == 0
            finally:
                sem.close()
    if not held:
        return None
    for usage_name in usage.names:
        if not usage_name.startswith("sem."):
            try:
                with (Path("/dev/shm") / usage_name).open("rb") as f:
                    f.seek(8 * W_LOCK_EPOCH)
                    return int.from_bytes(f.read(8), "little")
            except OSError:
                continue
    return -1  # held, segment unreadable: counted as a new holder


class _Load:
    """Client threads hammering one sidecar until stopped; results checked as they come."""

    def __init__(self, address: str, workload: Workload, threads: int, seed: int, timeout: float) -> None:
        self.address = address
        self.workload = workload
        self.stop = threading.Event()
        self.counts: Counter[str] = Counter()
        self.wrong: list[str] = []
        self.answered: list[Item] = []  # text items answered OK, most recent last
        # Guards counts/wrong/answered across the client threads.
        self.lock = threading.Lock()
        self.timeout = timeout
        self.threads = [threading.Thread(target=self._run, args=(seed + i,), daemon=True) for i in range(threads)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(self.timeout + 5)

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        items = self.workload.items
        with channel(self.address) as ch:
            s = stub(ch)
            while not self.stop.is_set():
                # Skewed: a hot head of the pool (hits) and the rest (inserts, evictions).
                idx = int(len(items) * rng.random() ** 2)
                item = items[idx]
                try:
                    response = self.workload.call(s, item, self.timeout)
                except grpc.RpcError:
                    with self.lock:
                        self.counts["errors"] += 1
                    if not self.stop.is_set():
                        time.sleep(0.01)
                    continue
                good = item.check(response)
                with self.lock:
                    self.counts["ok" if good else "wrong"] += 1
                    if not good and len(self.wrong) < 10:
                        self.wrong.append(f"{item.kind}: got {unpack(response.token_ids)[:12]}...")
                    if good and item.kind in ("text", "ar-text"):
                        self.answered.append(item)
                        del self.answered[:-50]


def _warm_check(address: str, workload: Workload, previous: list[Item], timeout: float) -> tuple[int, int, int]:
    """(checked, cached hits, wrong) for the last items answered before the kill."""
    checked = hits = wrong = 0
    with channel(address) as ch:
        s = stub(ch)
        for item in reversed(previous[-5:]):
            response = workload.call(s, item, timeout)
            checked += 1
            if not item.check(response):
                wrong += 1
            elif response.decision.source in CACHED:
                hits += 1
    return checked, hits, wrong


def run_crash_cycles(
    tmp: Path,
    prefix: str,
    *,
    cycles: int,
    threads: int = 6,
    shm_size: str = "1MiB",
    workload: Workload | None = None,
    kill_window: tuple[float, float] = (0.2, 3.0),
    before_ready: float = 0.1,
    seed: int = 7,
    timeout: float = 30.0,
    log: Any = None,
) -> CrashReport:
    """Run ``cycles`` kill/restart cycles; see the module docstring. Leaves the segment in place."""
    rng = random.Random(seed)
    workload = workload or Workload().build()
    report = CrashReport(cycles, threads, 0, len(workload.items), workload.text_bytes)
    started = time.monotonic()
    previous: list[Item] = []
    counted_epoch: int | None = None  # the lock epoch of the last kill counted as holding it
    for cycle in range(cycles):
        early = rng.random() < before_ready
        delay = rng.uniform(*kill_window)
        result = CycleResult(cycle, delay, early)
        proc = SidecarProc(tmp / f"c{cycle % 2}", prefix, shm_size=shm_size)
        try:
            if early:
                # SIGKILL while it loads (attaching the segment, loading tokenizers).
                assert proc.proc is None
                with proc.log_path.open("ab") as out:
                    proc.proc = subprocess.Popen(proc.cmd, stdout=out, stderr=out, env=proc.env)
                time.sleep(rng.uniform(0.05, 2.5))
                proc.kill()
                report.kills_before_ready += 1
            else:
                proc.start(timeout=180)
                if previous:
                    checked, hits, wrong = _warm_check(proc.address, workload, previous, timeout)
                    result.warm_checked, result.warm_hits = checked, hits
                    result.wrong += wrong
                load = _Load(proc.address, workload, threads, seed * 1000 + cycle * 31, timeout)
                load.start()
                time.sleep(delay)
                proc.kill()
                load.join()
                result.ok += load.counts["ok"]
                result.wrong += load.counts["wrong"]
                result.errors += load.counts["errors"]
                report.wrong_examples += load.wrong[: 10 - len(report.wrong_examples)]
                if load.answered:
                    previous = list(load.answered)
        except BaseException:  # SIGTERM/Ctrl-C/failure: leave no sidecar behind
            proc.kill()
            raise
        # A kill that left the lock held by a holder not counted yet (a new epoch). A lock left
        # held by an earlier life stays held through lives that never write (killed while
        # loading, or before their first write): counted once, as it is recovered once.
        epoch = _held_epoch(prefix)
        result.died_holding_lock = epoch is not None and epoch != counted_epoch
        if result.died_holding_lock:
            counted_epoch = epoch
        result.shm_objects, result.shm_allocated, result.shm_size, result.segment_allocated = _shm_state(prefix)
        report.requests_ok += result.ok
        report.wrong_answers += result.wrong
        report.errors += result.errors
        report.kills_holding_lock += result.died_holding_lock
        report.cycles_warm_checked += result.warm_checked > 0
        report.cycles_with_warm_hit += result.warm_hits > 0
        report.shm_max_objects = max(report.shm_max_objects, result.shm_objects)
        report.shm_max_allocated = max(report.shm_max_allocated, result.shm_allocated)
        report.segment_max_allocated = max(report.segment_max_allocated, result.segment_allocated)
        state = {"objects": result.shm_objects, "allocated": result.shm_allocated, "size": result.shm_size}
        if cycle == 0:
            report.shm_after_first = state
        report.shm_after_last = state
        report.per_cycle.append(asdict(result))
        if log is not None:
            log(f"cycle {cycle}: {'early ' if early else ''}kill after {delay:.2f}s ok={result.ok} "
                f"wrong={result.wrong} err={result.errors} warm={result.warm_hits}/{result.warm_checked} "
                f"lock_held={result.died_holding_lock} shm={state}")
    # A last clean life: the segment is still valid and warm; read its counters.
    final = SidecarProc(tmp / "final", prefix, shm_size=shm_size)
    try:
        final.start(timeout=180)
        if previous:
            checked, hits, wrong = _warm_check(final.address, workload, previous, timeout)
            report.cycles_warm_checked += 1
            report.cycles_with_warm_hit += hits > 0
            report.wrong_answers += wrong
        final.stop()
    finally:
        final.kill()
    from tokcache.store import read_stats

    stats = read_stats(prefix)
    if stats:
        report.final_stats = stats[0]
        report.shm_cap = int(stats[0].get("capacity", 0))
        report.lock_recoveries = int(stats[0].get("lock_recoveries", 0))
        report.corrupt_reads = int(stats[0].get("corrupt", 0))
    report.seconds = time.monotonic() - started
    return report
