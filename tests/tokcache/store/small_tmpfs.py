"""Run a command with a small tmpfs on /dev/shm, in a private mount namespace.

``unshare --mount --propagation private`` gives the command its own copy of the mount
table, so the tmpfs mounted over /dev/shm there is seen by it and its children only:
the host's /dev/shm is untouched, and everything the command creates there disappears
with the namespace. Needs root (or user namespaces); :func:`namespace_unavailable` says
why not, for a skip. Other processes reach that tmpfs through ``/proc/<pid>/root/dev/shm``
of a process inside, or by running under ``nsenter --mount=/proc/<pid>/ns/mnt``.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_MOUNT = 'mount -t tmpfs -o size="$0",mode=1777 tokcache-test /dev/shm && exec "$@"'


def in_small_tmpfs(size: str, cmd: Sequence[str]) -> list[str]:
    """``cmd`` wrapped to run (same pid, via exec) with a ``size`` tmpfs ("8m") on /dev/shm."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _MOUNT, size, *cmd]


def in_namespace_of(pid: int, cmd: Sequence[str]) -> list[str]:
    """``cmd`` wrapped to run in the mount namespace of ``pid`` (it sees that /dev/shm)."""
    return ["nsenter", f"--mount=/proc/{pid}/ns/mnt", *cmd]


def shm_of(pid: int) -> Path:
    """/dev/shm as process ``pid`` sees it."""
    return Path(f"/proc/{pid}/root/dev/shm")


def python_env() -> dict[str, str]:
    """The environment for a Python child that imports ``tests.*`` (and ``tokcache`` as this process does)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


@functools.cache
def namespace_unavailable() -> str | None:
    """Why a test cannot mount a tmpfs in a private mount namespace here, or None."""
    for tool in ("unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        done = subprocess.run(in_small_tmpfs("1m", ["true"]), capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare --mount failed: {exc}"
    if done.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace: {done.stderr.decode(errors='replace').strip()}"
    return None


def run_child(size: str, scenario: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m tests.tokcache.store.small_tmpfs_child SCENARIO ARGS`` with a ``size`` tmpfs."""
    cmd = [sys.executable, "-m", "tests.tokcache.store.small_tmpfs_child", scenario, *args]
    return subprocess.run(in_small_tmpfs(size, cmd), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=python_env())


def fill(path: str | os.PathLike[str]) -> int:
    """Grow the file at ``path`` until its tmpfs has no free page left (as another process
    would); returns the bytes it holds."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        for chunk in (1 << 20, 64 << 10, 4 << 10):
            while True:
                try:
                    os.posix_fallocate(fd, size, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
                size += chunk
        return size
    finally:
        os.close(fd)
