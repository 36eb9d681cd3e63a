"""The memory-pressure monitor with simulated signals, and its readers on fake /proc and cgroupfs trees."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.tokcache.store.store_helpers import FINGERPRINT, ids_of, key
from tokcache.sidecar.pressure import PressureMonitor, PressurePolicy, SignalReader, Signals, State
from tokcache.store import Kind, Store

SIZE = 4 << 20
GIB = 1 << 30


class FakeSignals:
    """Signals the test sets; a monotonic clock the test advances."""

    def __init__(self) -> None:
        self.signals = Signals(cgroup_usage=GIB // 2, cgroup_limit=GIB, psi_some_avg10=0.0,
                               mem_available=8 * GIB, mem_total=16 * GIB)
        self.now = 1000.0

    def __call__(self) -> Signals:
        return self.signals

    def clock(self) -> float:
        return self.now


@pytest.fixture
def store(shm_prefix: str) -> Iterator[Store]:
    s = Store.open(prefix=shm_prefix, fingerprint=FINGERPRINT, size=SIZE)
    yield s
    s.unlink()
    s.close()


def _fill(store: Store, tag: str) -> None:
    for i in range(store.arena_bytes // 2000 + 10):
        assert store.put(None, 0, ids_of(tag, i, n=500), [(key(tag, i), 500)], Kind.L1)


def _monitor(store: Store, fake: FakeSignals, **policy: float) -> PressureMonitor:
    options = {"calm_seconds": 10.0, "low_watermark": 0.25, "grow_step": 0.25, **policy}
    return PressureMonitor(lambda: [store], PressurePolicy(**options), read=fake, clock=fake.clock)


@pytest.mark.parametrize(
    "signals",
    [
        Signals(cgroup_usage=int(0.95 * GIB), cgroup_limit=GIB),  # near memory.max
        Signals(psi_some_avg10=25.0),  # tasks stalled on memory
        Signals(mem_available=GIB // 2, mem_total=16 * GIB),  # node short of memory
    ],
    ids=["cgroup", "psi", "memavailable"],
)
def test_each_signal_shrinks_then_the_cache_grows_back(store: Store, signals: Signals) -> None:
    fake = FakeSignals()
    monitor = _monitor(store, fake)
    _fill(store, "a")
    arena = store.arena_bytes
    assert monitor.step() is State.NORMAL
    full = store.stats()
    calm = fake.signals
    fake.signals = signals
    assert monitor.step() is State.PRESSURE
    shrunk = store.stats()
    assert shrunk.used_bytes <= arena // 4 and shrunk.soft_cap <= arena // 4
    assert shrunk.pressure_evictions > 0
    assert shrunk.resident_bytes < full.resident_bytes - arena // 2
    # Writes under pressure stay within the low watermark.
    _fill(store, "b")
    assert store.used_bytes <= arena // 4
    # Calm again: nothing grows before calm_seconds, then a step per tick until lifted.
    fake.signals = calm
    assert monitor.step() is State.PRESSURE
    fake.now += 9
    assert monitor.step() is State.PRESSURE and store.soft_cap <= arena // 4
    fake.now += 1
    caps = []
    for _ in range(5):
        state = monitor.step()
        caps.append(store.soft_cap)
        fake.now += 1
        if state is State.NORMAL:
            break
    assert state is State.NORMAL
    assert caps == sorted(caps) and caps[-1] == arena and len(caps) == 3
    _fill(store, "c")
    assert store.used_bytes > arena * 3 // 4
    assert monitor.shrinks == 1


def test_hysteresis_holds_between_the_marks(store: Store) -> None:
    fake = FakeSignals()
    monitor = _monitor(store, fake, calm_seconds=0.0)
    _fill(store, "a")
    fake.signals = Signals(cgroup_usage=int(0.92 * GIB), cgroup_limit=GIB)
    assert monitor.step() is State.PRESSURE
    fake.signals = Signals(cgroup_usage=int(0.85 * GIB), cgroup_limit=GIB)  # below 0.9, above 0.8
    for _ in range(5):
        assert monitor.step() is State.PRESSURE
    assert store.soft_cap <= store.arena_bytes // 4


def test_growth_waits_for_room_under_the_limit(store: Store) -> None:
    fake = FakeSignals()
    monitor = _monitor(store, fake, calm_seconds=0.0, grow_step=0.5)
    _fill(store, "a")
    fake.signals = Signals(cgroup_usage=int(0.95 * 64 * (1 << 20)), cgroup_limit=64 << 20)
    monitor.step()
    capped = store.soft_cap
    # Calm, but 50 % of the arena (1.7 MiB) more would push a 64 MiB cgroup past 80 %.
    fake.signals = Signals(cgroup_usage=int(0.78 * 64 * (1 << 20)), cgroup_limit=64 << 20)
    for _ in range(3):
        assert monitor.step() is State.PRESSURE
    assert store.soft_cap == capped
    fake.signals = Signals(cgroup_usage=int(0.5 * 64 * (1 << 20)), cgroup_limit=64 << 20)
    assert monitor.step() is State.RECOVERING
    assert store.soft_cap > capped


def test_monitor_sweeps_expired_records(shm_prefix: str) -> None:
    fake = FakeSignals()
    now = [1_700_000_000.0]
    store = Store.open(prefix=shm_prefix, fingerprint=FINGERPRINT, size=SIZE, ttl={Kind.L0: 5.0},
                       clock=lambda: now[0])
    try:
        for i in range(20):
            assert store.put(None, 0, ids_of(i, n=50), [(key(i), 50)], Kind.L0)
        monitor = _monitor(store, fake)
        now[0] += 6
        monitor.step()
        assert store.stats().ttl_evictions == 20
        assert store.used_bytes == 0
    finally:
        store.unlink()
        store.close()


def test_thread_starts_and_stops(store: Store) -> None:
    fake = FakeSignals()
    fake.signals = Signals(psi_some_avg10=50.0)
    monitor = PressureMonitor(lambda: [store], PressurePolicy(interval=0.01), read=fake)
    _fill(store, "a")
    monitor.start()
    try:
        for _ in range(500):
            if monitor.state is State.PRESSURE and monitor.shrinks:
                break
            import time

            time.sleep(0.01)
    finally:
        monitor.stop()
    assert monitor.state is State.PRESSURE
    assert store.used_bytes <= store.arena_bytes // 4


def test_policy_validation() -> None:
    bad: dict[str, Any]
    for bad in ({"interval": 0}, {"low_watermark": 0}, {"low_watermark": 1.5}, {"cgroup_ratio": 0.05},
                {"psi_avg10": 0}, {"min_available": 0.6}, {"calm_seconds": -1}):
        with pytest.raises(ValueError):
            PressurePolicy(**bad)


# --- readers on fake trees ---------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc(root: Path, cgroup: str) -> Path:
    proc = root / "proc"
    _write(proc / "self" / "cgroup", cgroup)
    _write(proc / "meminfo", "MemTotal:       16000000 kB\nMemFree:  1 kB\nMemAvailable:    4000000 kB\n")
    _write(proc / "pressure" / "memory", "some avg10=1.50 avg60=0.00 avg300=0.00 total=1\n"
                                         "full avg10=0.50 avg60=0.00 avg300=0.00 total=1\n")
    return proc


def test_reader_cgroup_v2_takes_the_tightest_ancestor(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    fs = tmp_path / "cg"
    _write(fs / "cgroup.controllers", "cpu memory\n")
    ctr = fs / "kubepods" / "pod1" / "ctr"
    _write(ctr / "memory.current", "600\n")
    _write(ctr / "memory.max", "max\n")
    _write(ctr / "memory.stat", "anon 400\ninactive_file 100\nshmem 100\n")
    _write(ctr / "memory.pressure", "some avg10=12.25 avg60=1 avg300=1 total=5\n")
    pod = ctr.parent
    _write(pod / "memory.current", "900\n")
    _write(pod / "memory.max", "1000\n")
    _write(pod / "memory.stat", "inactive_file 50\n")
    reader = SignalReader(proc=proc, cgroup_fs=fs)
    sig = reader()
    assert (sig.cgroup_usage, sig.cgroup_limit) == (850, 1000)  # pod: working set 900 - 50
    assert sig.psi_some_avg10 == 12.25  # the cgroup's own PSI wins over /proc/pressure
    assert sig.mem_available == 4_000_000 * 1024 and sig.mem_total == 16_000_000 * 1024
    assert reader.sources["psi"].endswith("ctr/memory.pressure")


def test_reader_cgroup_v1_fallback_and_namespaced_root(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "4:memory:/docker/abc\n1:cpu:/docker/abc\n0::/\n")
    fs = tmp_path / "cg"
    _write(fs / "unified" / "cgroup.controllers", "")  # hybrid: v2 without the memory controller
    mem = fs / "memory"  # a cgroup namespace: our cgroup is the mount root
    _write(mem / "memory.usage_in_bytes", "800\n")
    _write(mem / "memory.limit_in_bytes", "1000\n")
    _write(mem / "memory.stat", "cache 10\ntotal_inactive_file 200\n")
    sig = SignalReader(proc=proc, cgroup_fs=fs)()
    assert (sig.cgroup_usage, sig.cgroup_limit) == (600, 1000)
    assert sig.psi_some_avg10 == 1.5  # no memory.pressure in the v2 root: /proc/pressure/memory
    _write(mem / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    assert SignalReader(proc=proc, cgroup_fs=fs)().cgroup_ratio is None


def test_reader_without_anything(tmp_path: Path) -> None:
    sig = SignalReader(proc=tmp_path / "none", cgroup_fs=tmp_path / "none")()
    assert sig == Signals()
    assert sig.describe() == "no signals"
