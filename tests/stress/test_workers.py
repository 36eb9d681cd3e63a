"""``serve --workers 3``: one address, load spread over the workers, one segment, restarts, drain."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import grpc

from tests.stress.harness import SidecarProc, Workload, channel, cpu_ticks, stub, unlink_prefix
from tokcache.store import read_stats


def _load(address: str, workload: Workload, connections: int, rounds: int) -> tuple[int, int, int]:
    """(ok, wrong, errors) from ``connections`` threads, each on its own connection."""
    counts = [0, 0, 0]
    lock = threading.Lock()  # guards counts

    def run(k: int) -> None:
        with channel(address) as ch:
            s = stub(ch)
            for i in range(rounds):
                item = workload.items[(k * 7 + i * 13) % len(workload.items)]
                try:
                    good = item.check(workload.call(s, item, 30))
                    idx = 0 if good else 1
                except grpc.RpcError:
                    idx = 2
                with lock:
                    counts[idx] += 1

    threads = [threading.Thread(target=run, args=(k,)) for k in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return counts[0], counts[1], counts[2]


def test_workers_share_one_address_and_one_segment(tmp_path: Path) -> None:
    prefix = f"tkwork-{uuid.uuid4().hex[:8]}"
    workload = Workload(conversations=12, turns=4, ar_pairs=6, chats=False).build()
    proc = SidecarProc(tmp_path, prefix, shm_size="8MiB", workers=3)
    try:
        proc.start(timeout=240)
        deadline = time.monotonic() + 120
        while len(proc.worker_pids()) < 3 or not _all_ready(proc, workload):
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.2)
        workers = proc.worker_pids()
        assert len(workers) == 3
        before = {pid: cpu_ticks(pid) for pid in workers}
        ok, wrong, errors = _load(proc.address, workload, connections=24, rounds=40)
        assert (wrong, errors) == (0, 0) and ok == 24 * 40
        busy = {pid: cpu_ticks(pid) - before[pid] for pid in workers}
        print(f"CPU ticks per worker for 24 connections x 40 requests: {sorted(busy.values())}")
        # The kernel spread the 24 connections over all three listeners.
        assert all(ticks > 0 for ticks in busy.values()), busy
        stats = read_stats(prefix)
        assert len(stats) == 1  # one segment for everyone
        assert stats[0]["hits"] > 0 and stats[0]["puts"] > 0
        # A worker that dies is replaced; the others serve meanwhile.
        victim = workers[0]
        os.kill(victim, signal.SIGKILL)
        ok, wrong, _errors = _load(proc.address, workload, connections=6, rounds=20)
        assert wrong == 0 and ok > 0
        deadline = time.monotonic() + 120
        while victim in proc.worker_pids() or len(proc.worker_pids()) < 3:
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.2)
        assert "exited with -9" in proc.log(20000)
        # Drain: SIGTERM to the supervisor stops every worker, exit 0.
        pids = proc.worker_pids()
        assert proc.stop(timeout=60) == 0, proc.log()
        for pid in pids:
            assert not os.path.exists(f"/proc/{pid}") or "spawn_main" not in _cmd(pid)
    finally:
        proc.kill()
        unlink_prefix(prefix)


def _all_ready(proc: SidecarProc, workload: Workload) -> bool:
    """Every worker has loaded its models: many fresh connections all succeed."""
    ok, wrong, errors = _load(proc.address, workload, connections=9, rounds=1)
    return errors == 0 and wrong == 0


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""
