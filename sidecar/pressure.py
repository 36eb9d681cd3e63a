"""Memory-pressure monitor: shrink the shared-memory cache when the node or pod runs short.

Pages of ``/dev/shm`` are tmpfs pages: they count against the memory cgroup of the
process that touched them (in Kubernetes, the pod's limit) and cannot be reclaimed
without swap. So when memory runs short the cache itself must let go.

Signals, read every ``interval`` seconds (any one is enough to call it pressure):

* **cgroup**: working set (``memory.current`` minus ``inactive_file`` from
  ``memory.stat``, as the kubelet counts it) over ``memory.max``, for this process's
  cgroup and every ancestor visible (the tightest wins). cgroup v2 first; v1
  (``memory.usage_in_bytes`` / ``memory.limit_in_bytes``) where the memory controller
  is only mounted there.
* **PSI**: ``some avg10`` of the cgroup's ``memory.pressure`` (v2), else
  ``/proc/pressure/memory``: the share of time tasks stalled waiting for memory.
* **MemAvailable** over ``MemTotal`` from ``/proc/meminfo``.

Policy (hysteresis, so the cache does not flap): on pressure every store is shrunk to
``low_watermark`` of its arena at once (``Store.shrink``: soft cap, evict, pages back to
the kernel; counted as pressure evictions). Once every signal has been below its low
mark for ``calm_seconds`` the soft cap grows by ``grow_step`` of the arena per interval
— only while the cgroup would stay under its low mark if the cache filled everything it
is then allowed (the granted soft cap, not just what is used now) — until it is
lifted. Each tick also sweeps expired records (TTL) off every store.

One monitor per segment is enough (the soft cap lives in the shared header): the single
server process runs it, or the supervisor when ``--workers`` > 1.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeVar

from tokcache.store import Store, StoreError

if TYPE_CHECKING:
    from tokcache.sidecar.config import Config

log = logging.getLogger(__name__)

_T = TypeVar("_T")

__all__ = ["PressureMonitor", "PressurePolicy", "Signals", "SignalReader", "State"]

DEFAULT_INTERVAL: Final = 1.0
DEFAULT_LOW_WATERMARK: Final = 0.25
DEFAULT_CGROUP_RATIO: Final = 0.90
DEFAULT_PSI_AVG10: Final = 10.0
DEFAULT_MIN_AVAILABLE: Final = 0.05
DEFAULT_CALM_SECONDS: Final = 30.0
DEFAULT_GROW_STEP: Final = 0.125
# cgroup v1 reports "no limit" as a page-rounded LONG_MAX; anything this big is no limit.
_NO_LIMIT: Final = 1 << 60


@dataclass(frozen=True)
class PressurePolicy:
    """Thresholds and pacing. Ratios are fractions (0.9 = 90 %), PSI is a percentage.

    Low marks (hysteresis): the cgroup ratio 0.1 below ``cgroup_ratio``, PSI a fifth of
    ``psi_avg10``, available memory twice ``min_available``.
    """

    interval: float = DEFAULT_INTERVAL
    low_watermark: float = DEFAULT_LOW_WATERMARK
    cgroup_ratio: float = DEFAULT_CGROUP_RATIO
    psi_avg10: float = DEFAULT_PSI_AVG10
    min_available: float = DEFAULT_MIN_AVAILABLE
    calm_seconds: float = DEFAULT_CALM_SECONDS
    grow_step: float = DEFAULT_GROW_STEP

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval) and self.interval > 0):
            raise ValueError(f"interval must be > 0 seconds, got {self.interval}")
        for name in ("low_watermark", "grow_step"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0.1 < self.cgroup_ratio <= 1:
            raise ValueError(f"cgroup_ratio must be in (0.1, 1], got {self.cgroup_ratio}")
        if not 0 < self.psi_avg10 <= 100:
            raise ValueError(f"psi_avg10 must be in (0, 100], got {self.psi_avg10}")
        if not 0 <= self.min_available < 0.5:
            raise ValueError(f"min_available must be in [0, 0.5), got {self.min_available}")
        if self.calm_seconds < 0:
            raise ValueError(f"calm_seconds must be >= 0, got {self.calm_seconds}")

    @classmethod
    def from_config(cls, config: Config) -> PressurePolicy:
        """The policy set by a server Config's ``pressure_*`` fields."""
        return cls(
            interval=config.pressure_interval,
            low_watermark=config.pressure_low_watermark,
            cgroup_ratio=config.pressure_cgroup_ratio,
            psi_avg10=config.pressure_psi_avg10,
            min_available=config.pressure_min_available,
        )

    @property
    def cgroup_low(self) -> float:
        return self.cgroup_ratio - 0.1

    @property
    def psi_low(self) -> float:
        return self.psi_avg10 / 5

    @property
    def available_high(self) -> float:
        return self.min_available * 2


@dataclass(frozen=True)
class Signals:
    """One reading. None: not available here (no cgroup limit, no PSI, ...)."""

    cgroup_usage: int | None = None  # working set of the tightest cgroup, bytes
    cgroup_limit: int | None = None
    psi_some_avg10: float | None = None
    mem_available: int | None = None
    mem_total: int | None = None

    @property
    def cgroup_ratio(self) -> float | None:
        if self.cgroup_usage is None or not self.cgroup_limit:
            return None
        return self.cgroup_usage / self.cgroup_limit

    @property
    def available_ratio(self) -> float | None:
        if self.mem_available is None or not self.mem_total:
            return None
        return self.mem_available / self.mem_total

    def describe(self) -> str:
        parts = []
        if self.cgroup_ratio is not None:
            parts.append(f"cgroup {self.cgroup_usage} / {self.cgroup_limit} B ({self.cgroup_ratio:.0%})")
        if self.psi_some_avg10 is not None:
            parts.append(f"psi some avg10 {self.psi_some_avg10:.1f}%")
        if self.available_ratio is not None:
            parts.append(f"MemAvailable {self.available_ratio:.1%}")
        return ", ".join(parts) or "no signals"


class SignalReader:
    """Reads :class:`Signals` for this process from ``/proc`` and the cgroup filesystem.

    The roots are parameters so tests can point them at a fake tree. Paths are resolved
    once, at construction; a file that cannot be read yields None for its signal.
    """

    def __init__(self, *, proc: str | Path = "/proc", cgroup_fs: str | Path = "/sys/fs/cgroup") -> None:
        self._proc = Path(proc)
        fs = Path(cgroup_fs)
        v2_path, v1_path = _own_cgroups(self._proc / "self" / "cgroup")
        v2_mount = next((m for m in (fs, fs / "unified") if (m / "cgroup.controllers").exists()), None)
        self._v2 = _join(v2_mount, v2_path) if v2_mount is not None and v2_path is not None else None
        v1_mount = fs / "memory"
        self._v1 = _join(v1_mount, v1_path) if v1_path is not None and v1_mount.is_dir() else None
        # Memory limits: v2 where its memory controller is enabled, else v1.
        self._limit_dirs: list[tuple[Path, str, str, str]] = []
        if self._v2 is not None and v2_mount is not None and (self._v2 / "memory.current").exists():
            self._limit_dirs = [(d, "memory.current", "memory.max", "inactive_file") for d in _up(self._v2, v2_mount)]
        elif self._v1 is not None and (self._v1 / "memory.usage_in_bytes").exists():
            self._limit_dirs = [
                (d, "memory.usage_in_bytes", "memory.limit_in_bytes", "total_inactive_file")
                for d in _up(self._v1, v1_mount)
            ]
        psi = self._v2 / "memory.pressure" if self._v2 is not None else None
        self._psi = psi if psi is not None and psi.exists() else self._proc / "pressure" / "memory"

    @property
    def sources(self) -> dict[str, str]:
        """Where each signal comes from (for logs)."""
        return {
            "cgroup": str(self._limit_dirs[0][0]) if self._limit_dirs else "none",
            "psi": str(self._psi),
            "meminfo": str(self._proc / "meminfo"),
        }

    def __call__(self) -> Signals:
        usage, limit = self._cgroup()
        available, total = _meminfo(self._proc / "meminfo")
        return Signals(usage, limit, _psi_some_avg10(self._psi), available, total)

    def _cgroup(self) -> tuple[int | None, int | None]:
        best: tuple[int | None, int | None] = (None, None)
        best_ratio = -1.0
        for directory, usage_file, limit_file, inactive_key in self._limit_dirs:
            limit = _read_int(directory / limit_file)
            usage = _read_int(directory / usage_file)
            if limit is None or limit >= _NO_LIMIT or usage is None or limit <= 0:
                continue
            working = max(0, usage - (_stat_value(directory / "memory.stat", inactive_key) or 0))
            if working / limit > best_ratio:
                best, best_ratio = (working, limit), working / limit
        return best


class State(enum.Enum):
    NORMAL = "normal"  # no soft cap
    PRESSURE = "pressure"  # shrunk to the low watermark; waiting for calm
    RECOVERING = "recovering"  # growing back step by step


class PressureMonitor:
    """Applies :class:`PressurePolicy` to the stores returned by ``stores``.

    :meth:`step` does one evaluation (tests call it directly with an injected ``read``
    and ``clock``); :meth:`start` runs it every ``policy.interval`` seconds on a daemon
    thread until :meth:`stop`. Stop the monitor before closing its stores.
    """

    def __init__(
        self,
        stores: Callable[[], Iterable[Store]],
        policy: PressurePolicy | None = None,
        *,
        read: Callable[[], Signals] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy or PressurePolicy()
        self._stores = stores
        self._read: Callable[[], Signals] = read if read is not None else SignalReader()
        self._clock = clock
        self.state = State.NORMAL
        self.last: Signals = Signals()
        self.shrinks = 0
        self.grow_steps = 0
        self._calm_since: float | None = None
        # Set by stop(); the thread waits on it between steps.
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> State:
        """Read the signals once and shrink, hold or grow. Never raises for store errors."""
        policy = self.policy
        sig = self._read()
        self.last = sig
        now = self._clock()
        stores = list(self._stores())
        for store in stores:
            _quietly(store.sweep, store)
        if self._pressured(sig):
            self._calm_since = None
            if self.state is not State.PRESSURE:
                log.warning("memory pressure (%s): shrinking the cache to %.0f%% of its arena",
                            sig.describe(), 100 * policy.low_watermark)
            self.state = State.PRESSURE
            for store in stores:
                target = int(store.arena_bytes * policy.low_watermark)
                if store.soft_cap > target or store.used_bytes > target:
                    result = _quietly(store.shrink, store, target)
                    if result is not None:
                        self.shrinks += 1
                        log.warning("%s: live log %d -> %d B, resident %d -> %d B", store.name,
                                    result.used_before, result.used_after, result.resident_before,
                                    result.resident_after)
            return self.state
        if self.state is State.NORMAL:
            return self.state
        if not self._calm(sig):
            self._calm_since = None
            return self.state  # between the marks: hold
        if self._calm_since is None:
            self._calm_since = now
        if now - self._calm_since < policy.calm_seconds:
            return self.state
        # What the cache could still grow into with one more step: unfilled soft cap
        # granted before counts too (granting is instant, filling takes traffic).
        growth = sum(max(0, min(s.arena_bytes, s.soft_cap + int(s.arena_bytes * policy.grow_step)) - s.used_bytes)
                     for s in stores)
        if not self._room_for(sig, growth):
            return self.state
        self.state = State.RECOVERING
        lifted = True
        for store in stores:
            arena = store.arena_bytes
            new = store.soft_cap + int(arena * policy.grow_step)
            cap = _quietly(store.set_soft_cap, store, None if new >= arena else new)
            lifted = lifted and cap is not None and cap >= arena
        self.grow_steps += 1
        if lifted:
            self.state = State.NORMAL
            self._calm_since = None
            log.info("memory pressure over (%s): cache may use its whole segment again", sig.describe())
        return self.state

    def _pressured(self, sig: Signals) -> bool:
        p = self.policy
        ratio, avail = sig.cgroup_ratio, sig.available_ratio
        return (
            (ratio is not None and ratio >= p.cgroup_ratio)
            or (sig.psi_some_avg10 is not None and sig.psi_some_avg10 >= p.psi_avg10)
            or (avail is not None and avail <= p.min_available)
        )

    def _calm(self, sig: Signals) -> bool:
        p = self.policy
        ratio, avail = sig.cgroup_ratio, sig.available_ratio
        return (
            (ratio is None or ratio < p.cgroup_low)
            and (sig.psi_some_avg10 is None or sig.psi_some_avg10 < p.psi_low)
            and (avail is None or avail > p.available_high)
        )

    def _room_for(self, sig: Signals, extra: int) -> bool:
        """Whether ``extra`` more bytes of cache would keep every signal under its low mark."""
        p = self.policy
        if sig.cgroup_usage is not None and sig.cgroup_limit:
            if (sig.cgroup_usage + extra) / sig.cgroup_limit >= p.cgroup_low:
                return False
        if sig.mem_available is not None and sig.mem_total:
            if (sig.mem_available - extra) / sig.mem_total <= p.available_high:
                return False
        return True

    def start(self) -> None:
        """Run :meth:`step` every interval on a daemon thread. Idempotent."""
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="tokcache-pressure", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it (at most ``timeout`` s). Idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stopping.wait(self.policy.interval):
            try:
                self.step()
            except Exception:  # a monitor bug must not take the server down
                log.exception("pressure monitor step failed")


def _quietly(fn: Callable[..., _T], store: Store, *args: object) -> _T | None:
    try:
        return fn(*args)
    except StoreError:
        log.exception("%s: %s failed", store.name, getattr(fn, "__name__", "store call"))
        return None


# --- reading /proc and cgroupfs ------------------------------------------------------------


def _own_cgroups(path: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) of this process from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, cg = parts
        if hid == "0" and controllers == "":
            v2 = cg
        elif "memory" in controllers.split(","):
            v1 = cg
    return v2, v1


def _join(mount: Path, cgroup: str) -> Path:
    """The directory of ``cgroup`` under ``mount``; the mount itself when it is not there
    (a cgroup namespace shows our own cgroup as the root)."""
    candidate = mount / cgroup.lstrip("/")
    return candidate if candidate.is_dir() else mount


def _up(directory: Path, mount: Path) -> list[Path]:
    """``directory`` and its ancestors up to (and including) ``mount``."""
    out = [directory]
    while directory != mount and mount in directory.parents:
        directory = directory.parent
        out.append(directory)
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def _psi_some_avg10(path: Path) -> float | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("some "):
                for field in line.split()[1:]:
                    name, _, value = field.partition("=")
                    if name == "avg10":
                        return float(value)
    except (OSError, ValueError):
        return None
    return None


def _meminfo(path: Path) -> tuple[int | None, int | None]:
    available = total = None
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemAvailable", "MemTotal"):
                value = int(rest.split()[0]) * 1024  # kB
                if name == "MemAvailable":
                    available = value
                else:
                    total = value
    except (OSError, ValueError, IndexError):
        return None, None
    return available, total
