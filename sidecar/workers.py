"""``--workers N``: N sidecar server processes on one segment and one listening address.

How N processes share one address: ``SO_REUSEPORT`` on a TCP port. Every worker's gRPC
server binds the same ``HOST:PORT`` (gRPC sets ``SO_REUSEPORT`` on TCP listeners by
default) and the kernel spreads incoming *connections* across the listeners by a hash of
the 4-tuple. Clients see one address. A unix socket cannot do this (a path binds once,
and grpcio cannot adopt a listening fd passed from a parent), so ``--workers`` > 1 needs
``--listen HOST:PORT`` — in a pod, vLLM reaches the sidecar container on 127.0.0.1.

Load spreads per connection, not per call: one gRPC channel sticks to one worker. Each
vLLM API-server process holds its own channel, so ``--api-server-count`` K spreads over
min(K, N) workers; a single process that wants more must open several channels with
``grpc.use_local_subchannel_pool`` (channels to one target otherwise share a connection).

The supervisor (this module, the parent process):

* holds the port with a bound, non-listening ``SO_REUSEPORT`` socket, so ``:0`` picks a
  port once and a restarted worker always gets the same one back;
* opens the segments itself (creating them before the workers race to) and runs the
  memory-pressure monitor and TTL sweep for all of them (one monitor per segment);
* starts the workers (``multiprocessing`` spawn; each dies with the supervisor through
  ``PR_SET_PDEATHSIG``), restarts one that exits, with a backoff of 0.5 s doubling to
  10 s for workers that keep dying young; a worker loads its models *before* joining the
  port, so the kernel never hands a connection to a worker that cannot answer yet;
* on SIGTERM/SIGINT, forwards SIGTERM (each worker drains as a single server does) and
  SIGKILLs what is left after the grace period.

Worker i serves metrics on ``metrics_port + i`` when metrics are on.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Final

from tokcache.sidecar.config import Config

if TYPE_CHECKING:
    from tokcache.sidecar.pressure import PressureMonitor
    from tokcache.store import Store

log = logging.getLogger(__name__)

__all__ = ["Supervisor", "reserve_port", "split_host_port", "supervise"]

_SPAWN = multiprocessing.get_context("spawn")
_PR_SET_PDEATHSIG: Final = 1
BACKOFF_FIRST: Final = 0.5
BACKOFF_MAX: Final = 10.0
HEALTHY_AFTER: Final = 30.0  # a worker up this long resets its backoff
KILL_AFTER_GRACE: Final = 5.0


def split_host_port(listen: str) -> tuple[str, int]:
    """``"127.0.0.1:50051"`` / ``"[::1]:0"`` -> (host, port). Raises ValueError otherwise."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, non-listening SO_REUSEPORT socket on (host, port): the workers' listeners
    join its port; it takes no connections itself. Port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass
class _Slot:
    """One worker position: its current process and restart bookkeeping."""

    index: int
    process: BaseProcess | None = None
    started: float = 0.0
    failures: int = 0  # consecutive early exits
    restart_at: float = 0.0
    restarts: int = 0


class Supervisor:
    """Runs ``config.workers`` server processes; see the module docstring. One per process."""

    def __init__(self, config: Config) -> None:
        host, port = split_host_port(config.listen)
        self.config = config
        self._reservation = reserve_port(host, port)
        self.host = host
        self.port = int(self._reservation.getsockname()[1])
        self.listen = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self.slots = [_Slot(i) for i in range(config.workers)]
        # Set from the signal handler; the supervise loop wakes on it.
        self._stopping = threading.Event()

    def worker_config(self, index: int) -> Config:
        """The config worker ``index`` runs with: the resolved port, one process, no monitor."""
        cfg = self.config
        return replace(
            cfg,
            listen=self.listen,
            workers=1,
            pressure_interval=0.0,
            metrics_port=cfg.metrics_port + index if cfg.metrics_port else 0,
        )

    def stop(self) -> None:
        """Ask the supervise loop to stop (safe from a signal handler)."""
        self._stopping.set()

    def run(self) -> int:
        """Start the workers and keep them running until :meth:`stop`; then drain. Returns 0."""
        monitor, stores = self._start_monitor()
        try:
            for slot in self.slots:
                self._start(slot)
            log.info("supervising %d workers on %s (pid %d)", len(self.slots), self.listen, os.getpid())
            while not self._stopping.is_set():
                sentinels = [s.process.sentinel for s in self.slots if s.process is not None]
                wait(sentinels, timeout=0.25)
                self._reap_and_restart()
        finally:
            self._shutdown()
            if monitor is not None:
                monitor.stop()
            for store in stores:
                store.close()
            self._reservation.close()
        return 0

    def pids(self) -> list[int]:
        """Pids of the running workers."""
        return [s.process.pid for s in self.slots if s.process is not None and s.process.pid is not None]

    def _start(self, slot: _Slot) -> None:
        process = _SPAWN.Process(
            target=_worker_main,
            args=(self.worker_config(slot.index), slot.index, os.getpid()),
            name=f"tokcache-worker-{slot.index}",
        )
        process.start()
        slot.process, slot.started = process, time.monotonic()
        log.info("worker %d started (pid %s)", slot.index, process.pid)

    def _reap_and_restart(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            process = slot.process
            if process is not None and not process.is_alive():
                process.join()
                code = process.exitcode
                lived = now - slot.started
                slot.failures = 0 if lived >= HEALTHY_AFTER else slot.failures + 1
                delay = 0.0 if not slot.failures else min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (slot.failures - 1))
                log.warning("worker %d (pid %s) exited with %s after %.1f s; restarting in %.1f s",
                            slot.index, process.pid, code, lived, delay)
                process.close()
                slot.process, slot.restart_at = None, now + delay
            if slot.process is None and now >= slot.restart_at and not self._stopping.is_set():
                slot.restarts += 1
                self._start(slot)

    def _shutdown(self) -> None:
        running = [s.process for s in self.slots if s.process is not None and s.process.is_alive()]
        for process in running:
            if process.pid is not None:
                _signal(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_seconds + KILL_AFTER_GRACE
        for process in running:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("worker pid %s did not drain in time: SIGKILL", process.pid)
                process.kill()
                process.join()
        for slot in self.slots:
            slot.process = None

    def _start_monitor(self) -> tuple[PressureMonitor | None, list[Store]]:
        """Open the segments and, if configured, run the pressure monitor on them."""
        from tokenizers import Tokenizer

        from tokcache.sidecar.engine.model import fingerprint_of
        from tokcache.sidecar.pressure import PressureMonitor, PressurePolicy
        from tokcache.sidecar.server import StartupError, load_error
        from tokcache.store import Kind, Store, id_bytes_for, segment_name, usable_size

        cfg = self.config
        ttl = {Kind.L0: cfg.ttl_l0, Kind.L1: cfg.ttl_l1, Kind.AR: cfg.ttl_ar}
        stores: dict[str, Store] = {}
        for spec in cfg.models:
            tokenizer_json = spec.path / "tokenizer.json"
            try:
                fp = fingerprint_of(tokenizer_json)
                if fp in stores:
                    continue
                # We create the segments before any worker starts, so the id width is ours to pick:
                # the same vocabulary size the workers' engines compute (ModelEngine.vocab_size).
                vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
                # Sized to what /dev/shm can back, as one server does (the workers then attach
                # to this segment: usable_size keeps an existing segment's size when it fits).
                size, why = usable_size(segment_name(cfg.shm_prefix, fp), cfg.shm_size, minimum=1 << 20)
                if why:
                    log.warning("--shm-size %d bytes does not fit: %s; using %d bytes", cfg.shm_size, why, size)
                stores[fp] = Store.open(prefix=cfg.shm_prefix, fingerprint=fp, size=size, ttl=ttl,
                                        id_bytes=id_bytes_for(vocab))
            except Exception as exc:  # one line naming the model and file, like one server's start
                for store in stores.values():
                    store.close()
                raise StartupError(load_error(spec, exc, cfg)) from exc
        if cfg.pressure_interval <= 0:
            return None, list(stores.values())
        monitor = PressureMonitor(lambda: list(stores.values()), PressurePolicy.from_config(cfg))
        monitor.start()
        return monitor, list(stores.values())


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _die_with_parent(parent: int) -> None:
    """SIGTERM this process when the supervisor dies (Linux prctl); exit if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if os.getppid() != parent:  # it died before the prctl: nobody would tell us
        os._exit(0)


def _worker_main(config: Config, index: int, parent: int) -> None:
    """Body of worker ``index`` (spawned): one server process that loads before it binds."""
    _die_with_parent(parent)
    from tokcache.sidecar.telemetry.logs import setup_logging

    setup_logging(config.log_level, config.log_format)
    asyncio.run(_serve_worker(config, index))


async def _serve_worker(config: Config, index: int) -> None:
    """Like ``tokcache.sidecar.server.run`` but models load *before* the port is joined: the kernel
    routes connections to every listener in the group, so a worker that bound first would
    answer UNAVAILABLE while loading (a single server binds first so probes can see it;
    here the other workers serve meanwhile). SIGTERM drains as in a single server."""
    from grpc_health.v1 import health_pb2

    from tokcache.sidecar.server import SERVICE_NAME, Sidecar

    sidecar = Sidecar(config)
    sidecar.feeds_tier = index == 0  # one follower of the segments' logs per node
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await sidecar.load()
    await sidecar.start()
    for name in ("", SERVICE_NAME):
        await sidecar.health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("worker %d serving on %s (pid %d)", index, config.listen, os.getpid())
    await stopping.wait()
    await sidecar.stop()


def supervise(config: Config) -> int:
    """Entry point of ``tokcache-sidecar serve --workers N``. Blocks until SIGTERM/SIGINT."""
    supervisor = Supervisor(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: supervisor.stop())
    return supervisor.run()
