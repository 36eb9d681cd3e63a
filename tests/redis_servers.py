"""Real ``redis-server`` processes on loopback for the cluster-tier tests: one node, or a cluster.

The server is Debian's ``redis-server`` package (``make test`` installs it when missing,
see the Makefile's ``redis-server`` target); without it the tests that need one are
skipped with that reason. Nothing here mocks Redis: the tier talks to real servers,
and "the tier goes down" is a SIGKILL.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["PortTaken", "RedisCluster", "RedisServer", "cluster", "free_port", "need_redis", "server"]

SKIP_REASON = ("redis-server is not installed (Debian package redis-server: `make test` installs it with "
               "apt-get; or apt-get install -y redis-server)")


def need_redis() -> tuple[str, str]:
    """Paths of redis-server and redis-cli, or skip the test saying how to get them."""
    srv, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if srv is None or cli is None:
        pytest.skip(SKIP_REASON)
    return srv, cli


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port (and port + 10000 free too, for a cluster node's bus)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster_bus:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


# Starts of a node whose port (or, in a cluster, port + 10000) was taken between free_port and
# redis-server's bind: an outgoing connection's ephemeral port can land on it meanwhile
# (`make test`, Python 3.10: "bind: Address already in use" for a cluster bus port).
PORT_TRIES = 5


class PortTaken(RuntimeError):
    """redis-server could not bind its port (or its cluster bus port)."""


class RedisServer:
    """One ``redis-server`` on 127.0.0.1:``port``, no persistence, its files in ``workdir``.

    Without ``port`` it picks a free one (``bus``: with port + 10000 free too, for a cluster
    node) and picks another when the first start finds it taken; a given port, and a node that
    started once (it comes back on its port, which its cluster knows), are kept."""

    def __init__(self, workdir: Path, port: int | None = None, *extra: str, bus: bool = False) -> None:
        self.srv, self.cli = need_redis()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self._bus = bus
        self._pick = port is None
        self._started = False
        self.port = port or free_port(bus)
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        """Start it and wait for PING (RuntimeError when it exits or does not answer in time)."""
        tries = 1
        while True:
            try:
                self._start(timeout)
                self._started = True
                return self
            except PortTaken:
                if not self._pick or self._started or tries >= PORT_TRIES:
                    raise
                tries += 1
                self.port = free_port(self._bus)

    def _start(self, timeout: float) -> None:
        log = (self.workdir / f"redis-{self.port}.log").open("ab")
        self.proc = subprocess.Popen(
            [self.srv, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--daemonize", "no", "--protected-mode", "no", *self.extra],
            stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = self.log()
                error = PortTaken if "Address already in use" in text else RuntimeError
                raise error(f"redis-server exited {self.proc.returncode}: {text}")
            if self.cmd("PING").strip() == "PONG":
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server on {self.port} not up in {timeout}s: {self.log()}")

    def log(self) -> str:
        path = self.workdir / f"redis-{self.port}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def cmd(self, *args: str) -> str:
        """``redis-cli -p PORT ARGS`` (stdout; empty when the server does not answer)."""
        proc = subprocess.run([self.cli, "-h", "127.0.0.1", "-p", str(self.port), *args], capture_output=True,
                              text=True, timeout=20, check=False)
        return proc.stdout

    def kill(self) -> None:
        """SIGKILL: the tier disappears mid-run, connections reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class RedisCluster:
    """Three ``redis-server --cluster-enabled yes`` masters (no replicas), joined with
    ``redis-cli --cluster create``; a killed node comes back on its port with its nodes.conf."""

    def __init__(self, workdir: Path, nodes: int = 3) -> None:
        self.workdir = workdir
        self.nodes = [RedisServer(workdir / f"n{i}", None, "--cluster-enabled", "yes",
                                  "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000", bus=True)
                      for i in range(nodes)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 60.0) -> RedisCluster:
        for node in self.nodes:
            node.start()
        cli = self.nodes[0].cli
        proc = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                               "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True,
                              timeout=120, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {proc.stdout}\n{proc.stderr}")
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every node says cluster_state:ok."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cmd("CLUSTER", "INFO") for n in self.nodes):
                return
            time.sleep(0.1)
        raise RuntimeError("cluster not ok in time: " + " | ".join(n.cmd("CLUSTER", "INFO")[:80] for n in self.nodes))

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextmanager
def server(workdir: Path) -> Iterator[RedisServer]:
    """A started single node, stopped after."""
    node = RedisServer(workdir).start()
    try:
        yield node
    finally:
        node.stop()


@contextmanager
def cluster(workdir: Path) -> Iterator[RedisCluster]:
    """A started three-node cluster, stopped after."""
    c = RedisCluster(workdir)
    try:
        yield c.start()
    finally:
        c.stop()
