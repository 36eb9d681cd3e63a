"""Start and stop a real sidecar process for integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sidecar_client import DeadlineExceeded, SidecarClient, SidecarUnavailable


class SidecarProcess:
    """``tokcache-sidecar serve`` in a subprocess on a unix socket; logs go to a file."""

    def __init__(self, tmp: Path, models: dict[str, Path], shm_prefix: str, *extra: str,
                 env: dict[str, str] | None = None) -> None:
        self.sock = tmp / "tokcache.sock"
        self.address = f"unix://{self.sock}"
        self.log_path = tmp / "sidecar.log"
        self.cmd = [sys.executable, "-m", "tokcache.sidecar.cli", "serve", "--listen", self.address,
                    "--shm-prefix", shm_prefix, "--shm-size", "32MiB", *extra]
        for name, path in models.items():
            self.cmd += ["--model", f"{name}={path}"]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> SidecarProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=log, env=self.env)
        deadline = time.monotonic() + timeout
        with SidecarClient(self.address, timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sidecar exited {self.proc.returncode}:\n{self.log()}")
                try:
                    if client.list_models():
                        return self
                except (SidecarUnavailable, DeadlineExceeded):  # loading can starve the loop for 2 s
                    pass
                time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"sidecar not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
