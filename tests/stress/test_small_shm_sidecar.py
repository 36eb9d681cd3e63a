"""The real sidecar on a /dev/shm smaller than ``--shm-size``, or filled at run time.

Each sidecar runs in a private mount namespace with a small tmpfs on /dev/shm
(``unshare --mount``, as Docker's 64 MB default or a Kubernetes Memory emptyDir would
be); the test talks to it over its unix socket and reaches its /dev/shm through
``/proc/<pid>/root`` or ``nsenter``. Before the fix, a 64 MiB segment on 8 MiB died with
SIGBUS within 20 requests, and so did a segment whose pages the tmpfs could not give back.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.stress.harness import SidecarProc, Workload, channel, stub
from tests.tokcache.store.small_tmpfs import (
    fill,
    in_namespace_of,
    in_small_tmpfs,
    namespace_unavailable,
    python_env,
    shm_of,
)

MIB = 1 << 20

pytestmark = pytest.mark.skipif(namespace_unavailable() is not None,
                                reason=f"needs a private mount namespace: {namespace_unavailable()}")


def _sidecar(tmp: Path, prefix: str, tmpfs: str, shm_size: str, *extra: str, workers: int = 1) -> SidecarProc:
    side = SidecarProc(tmp, prefix, *extra, shm_size=shm_size, workers=workers)
    side.cmd = in_small_tmpfs(tmpfs, side.cmd)
    return side


def _workload(n: int) -> Workload:
    """``n`` growing ChatML texts (exact and kv-stable), each with its reference ids."""
    turns = 5
    work = Workload(conversations=n // turns, turns=turns, words=(100, 400), chats=False, ar_pairs=0).build()
    assert len(work.items) == n
    return work


def _serve_all(side: SidecarProc, work: Workload, items: list[Any]) -> None:
    with channel(side.address) as ch:
        s = stub(ch)
        for k, item in enumerate(items):
            response = work.call(s, item, timeout=60)
            assert item.check(response), f"request {k}: ids differ from the reference"
    assert side.alive(), f"sidecar died ({side.proc and side.proc.returncode}):\n{side.log()}"


def _segment(side: SidecarProc) -> Path:
    found = [p for p in shm_of(side.pid).iterdir() if p.name.startswith(side.prefix + "-")]
    assert len(found) == 1, found
    return found[0]


def _in_sidecar_ns(side: SidecarProc, code: str) -> str:
    """Run Python ``code`` in the sidecar's mount namespace (its /dev/shm); its stdout."""
    done = subprocess.run(in_namespace_of(side.pid, [sys.executable, "-c", code]), capture_output=True, text=True,
                          timeout=120, env=python_env())
    assert done.returncode == 0, done.stderr
    return done.stdout


@contextmanager
def _keep_full(shm: Path) -> Iterator[dict[str, int]]:
    """Another process's file that takes every page of the tmpfs that comes free, until the block ends."""
    stop = threading.Event()
    held = {"bytes": 0}
    failed: list[BaseException] = []

    def grab() -> None:
        fd = os.open(shm / "grabber", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while not stop.is_set():
                try:
                    os.posix_fallocate(fd, held["bytes"], 4096)
                    held["bytes"] += 4096
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    time.sleep(0.002)
        except BaseException as exc:  # a thread's exception is only printed: hand it to the test
            failed.append(exc)
        finally:
            os.close(fd)

    thread = threading.Thread(target=grab, name="tmpfs-filler", daemon=True)
    thread.start()
    try:
        yield held
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive(), "the tmpfs grabber did not stop"
    if failed:
        raise failed[0]


def test_sidecar_clamps_shm_size_to_the_tmpfs_and_serves(tmp_path: Path, shm_prefix: str) -> None:
    side = _sidecar(tmp_path, shm_prefix, "8m", "64MiB").start()
    try:
        m = re.search(r"WARNING.*--shm-size 67108864 bytes does not fit: /dev/shm can back (\d+) bytes"
                      r".*; using (\d+) bytes", side.log())
        assert m, side.log()
        available, used = int(m.group(1)), int(m.group(2))
        assert available == 8 * MIB and used < available
        assert _segment(side).stat().st_size == used
        work = _workload(500)
        _serve_all(side, work, work.items)
        assert "Bus error" not in side.log()
    finally:
        assert side.stop() == 0


def test_workers_clamp_shm_size_too(tmp_path: Path, shm_prefix: str) -> None:
    """--workers: the supervisor creates the segment (sized to the tmpfs), the workers attach to it."""
    side = _sidecar(tmp_path, shm_prefix, "8m", "64MiB", workers=2).start()
    try:
        assert re.search(r"--shm-size 67108864 bytes does not fit: /dev/shm can back", side.log()), side.log()
        assert _segment(side).stat().st_size < 8 * MIB
        work = _workload(100)
        _serve_all(side, work, work.items)
        assert "Bus error" not in side.log() and "Traceback" not in side.log()
    finally:
        assert side.stop() == 0


def test_sidecar_refuses_when_not_even_the_minimum_fits(tmp_path: Path, shm_prefix: str) -> None:
    side = _sidecar(tmp_path, shm_prefix, "1m", "64MiB")
    with pytest.raises(RuntimeError, match="sidecar exited 1"):
        side.start(timeout=60)
    log = side.log()
    errors = [line for line in log.splitlines() if "--shm-size" in line]
    assert errors and all("not enough for the minimum of 1048576 bytes" in line for line in errors), log
    assert "Traceback" not in log


def test_sidecar_survives_a_tmpfs_filled_at_run_time(tmp_path: Path, shm_prefix: str) -> None:
    # Fits as asked; the pressure monitor is off so that this test decides when pages go back.
    side = _sidecar(tmp_path, shm_prefix, "8m", "4MiB", "--pressure-interval", "0").start()
    try:
        assert "does not fit" not in side.log()
        name = "/" + _segment(side).name
        fingerprint = name.rsplit("-", 1)[1]
        store = (f"from tokcache.store import Store; "
                 f"s = Store.open(prefix={shm_prefix!r}, fingerprint={fingerprint!r}, size={4 * MIB})")
        stats = (f"import json; from tokcache.store import read_stats; "
                 f"print(json.dumps(read_stats({shm_prefix!r})[0]))")
        work = _workload(500)
        shm = shm_of(side.pid)
        # 1. The segment was allocated whole: a tmpfs filled up by someone else does not matter.
        assert fill(shm / "filler") > 0 and os.statvfs(shm).f_bavail == 0
        _serve_all(side, work, work.items[:100])
        first = json.loads(_in_sidecar_ns(side, stats))
        assert first["puts"] >= 100
        # 2. Another process (as the --workers supervisor's pressure monitor would) shrinks
        #    the cache: its pages go back, and someone takes them. Writing under the soft cap
        #    needs pages the tmpfs no longer has: the store evicts its own oldest records and
        #    gives their pages back instead.
        _in_sidecar_ns(side, store + "; s.shrink(0)")
        fill(shm / "filler")
        _serve_all(side, work, work.items[100:200])
        second = json.loads(_in_sidecar_ns(side, stats))
        # 3. Pressure over, tmpfs still full: growing back evicts the same way.
        _in_sidecar_ns(side, store + "; s.set_soft_cap(None)")
        fill(shm / "filler")
        _serve_all(side, work, work.items[200:350])
        third = json.loads(_in_sidecar_ns(side, stats))
        for before, after in ((first, second), (second, third)):
            assert after["puts"] > before["puts"] + 50, (before, after)
            assert after["pressure_evictions"] > before["pressure_evictions"], (before, after)
        assert third["soft_cap"] == third["arena_bytes"] and third["resident_bytes"] < 4 * MIB // 2
        # 4. Someone grabs every page the moment it comes free: puts may fail (store errors,
        #    served uncached); every answer is still right and the sidecar lives on.
        with _keep_full(shm) as grabbed:
            _serve_all(side, work, work.items[350:])
        # The evictions freed pages and the grabber took them: the puts really met a full tmpfs.
        assert grabbed["bytes"] > 0
        assert "Bus error" not in side.log()
    finally:
        assert side.stop() == 0
