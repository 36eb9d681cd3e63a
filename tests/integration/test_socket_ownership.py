"""A sidecar claims its listen address, never takes it over.

Before: a second sidecar on the same unix socket unlinked it and bound its own (gRPC also
unlinks a unix socket path before binding), and on stop deleted the socket, leaving the
first sidecar running but unreachable. Now a socket a live server answers on is refused,
a stale one (its sidecar was killed) is replaced, and a sidecar removes the socket on stop
only if the path still names the socket it bound.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar_client import SidecarClient
from tests.integration.sidecar_proc import SidecarProcess


def _serve(listen: str, model: Path, shm_prefix: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``tokcache-sidecar serve`` that is expected to exit by itself."""
    cmd = [sys.executable, "-m", "tokcache.sidecar.cli", "serve", "--listen", listen, "--shm-prefix", shm_prefix,
           "--shm-size", "32MiB", "--model", f"qwen3={model}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _refused(out: subprocess.CompletedProcess[str], listen: str) -> None:
    """Exit 1 with one line on stderr naming --listen, nothing announced, no traceback."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, out.stderr
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"tokcache-sidecar: --listen {listen}: "), lines[0]
    assert "listening on" not in out.stdout and "Traceback" not in out.stderr


def _answers(address: str) -> bool:
    with SidecarClient(address, timeout=5) as c:
        return bool(c.list_models())


def test_a_second_sidecar_is_refused_and_the_first_keeps_its_socket(tmp_path: Path, qwen3_path: Path,
                                                                     shm_prefix: str) -> None:
    first = SidecarProcess(tmp_path, {"qwen3": qwen3_path}, shm_prefix).start()
    try:
        inode = first.sock.stat().st_ino
        second = _serve(first.address, qwen3_path, shm_prefix)
        _refused(second, first.address)
        assert "another server is listening on" in second.stderr
        # The first one still owns the same socket and answers on it.
        assert first.sock.stat().st_ino == inode
        assert _answers(first.address)
        assert first.proc is not None and first.proc.poll() is None
        # Announced as listening only once it served, after its models loaded.
        msgs = [json.loads(line)["msg"] for line in first.log().splitlines() if line.startswith("{")]
        listening = [i for i, m in enumerate(msgs) if m.startswith("listening on")]
        serving = [i for i, m in enumerate(msgs) if m.startswith("serving 1 model")]
        assert len(listening) == 1 and serving and serving[0] < listening[0], msgs
    finally:
        assert first.stop() == 0, first.log()
    assert not first.sock.exists()  # its own socket: removed on stop


def test_a_stale_socket_is_replaced(tmp_path: Path, qwen3_path: Path, shm_prefix: str) -> None:
    proc = SidecarProcess(tmp_path, {"qwen3": qwen3_path}, shm_prefix).start()
    try:
        proc.stop(signal.SIGKILL)  # no chance to clean up: the socket file stays
        assert proc.sock.is_socket()
        with pytest.raises(ConnectionRefusedError):  # nothing accepts on it
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(proc.sock))
        proc.start()
        assert _answers(proc.address)
    finally:
        assert proc.stop() == 0, proc.log()


def test_stop_leaves_a_socket_that_is_no_longer_its_own(tmp_path: Path, qwen3_path: Path, shm_prefix: str) -> None:
    proc = SidecarProcess(tmp_path, {"qwen3": qwen3_path}, shm_prefix).start()
    other = socket.socket(socket.AF_UNIX)
    try:
        # Something else now owns the path (an operator moved things, a sidecar of an older version).
        proc.sock.unlink()
        other.bind(str(proc.sock))
        other.listen(1)
        theirs = proc.sock.stat().st_ino
        assert proc.stop() == 0, proc.log()
        assert proc.sock.is_socket() and proc.sock.stat().st_ino == theirs
        assert "no longer the socket this sidecar bound" in proc.log()
    finally:
        other.close()
        proc.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_second_sidecar_on_a_tcp_port_is_refused(tmp_path: Path, qwen3_path: Path, shm_prefix: str) -> None:
    """gRPC binds TCP with SO_REUSEPORT, so two sidecars would otherwise split one port's
    connections between them in silence."""
    listen = f"127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "tokcache.sidecar.cli", "serve", "--listen", listen, "--shm-prefix", shm_prefix,
           "--shm-size", "32MiB", "--model", f"qwen3={qwen3_path}"]
    log = (tmp_path / "first.log").open("wb")
    first = subprocess.Popen(cmd, stdout=log, stderr=log, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "first.log").read_text().count("listening on"):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.1)
        second = _serve(listen, qwen3_path, shm_prefix)
        _refused(second, listen)
        assert "Address already in use" in second.stderr
        assert _answers(listen)
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0
        log.close()
