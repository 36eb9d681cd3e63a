"""A throwaway memory cgroup for pressure tests: create, move a child in, set a limit, remove.

Tries cgroup v2 (a child of our own cgroup, if the ``memory`` controller is enabled for
children there), else the v1 ``memory`` hierarchy. :func:`available` says whether either
works here (root in a container with a writable cgroupfs); tests skip, and the demo
falls back to simulated signals, when it does not.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")


class MemoryCgroup:
    """One new memory cgroup. ``version`` is 1 or 2; files are named for that version."""

    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self.version = version

    @classmethod
    def create(cls, name: str | None = None) -> MemoryCgroup:
        name = name or f"tokcache-test-{uuid.uuid4().hex[:8]}"
        v2_root = CGROUP_FS
        if "memory" in _read(v2_root / "cgroup.controllers").split() and "memory" in _read(
            v2_root / "cgroup.subtree_control"
        ).split():
            path = v2_root / name
            path.mkdir()
            return cls(path, 2)
        v1_root = CGROUP_FS / "memory"
        if (v1_root / "memory.limit_in_bytes").exists():
            path = v1_root / name
            path.mkdir()
            return cls(path, 1)
        raise OSError("no writable memory cgroup hierarchy")

    @property
    def usage(self) -> int:
        return int(_read(self.path / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")))

    @property
    def limit(self) -> int | None:
        text = _read(self.path / ("memory.max" if self.version == 2 else "memory.limit_in_bytes"))
        return None if text in ("max", "") or int(text) >= 1 << 60 else int(text)

    def set_limit(self, limit: int | None) -> None:
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        value = ("max" if self.version == 2 else "-1") if limit is None else str(limit)
        (self.path / name).write_text(value)

    def stat(self, key: str) -> int:
        for line in _read(self.path / "memory.stat").splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
        return 0

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def pids(self) -> list[int]:
        return [int(p) for p in _read(self.procs_file).split()]

    def remove(self, timeout: float = 10.0) -> None:
        """rmdir once its processes are gone (they must have been stopped by the caller)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def available() -> bool:
    """Whether a memory cgroup can be created (and removed) here."""
    try:
        cg = MemoryCgroup.create(f"tokcache-probe-{uuid.uuid4().hex[:8]}")
    except OSError:
        return False
    cg.remove()
    return True


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
