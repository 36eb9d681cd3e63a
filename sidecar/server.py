"""Server lifecycle: bind, load models, serve, drain.

Order matters for probes: the socket is bound first with health
NOT_SERVING, tokenizers load (seconds), then SERVING, and only then is the
sidecar announced as listening. On SIGTERM/SIGINT: NOT_SERVING, then
``stop(grace)`` drains in-flight RPCs and refuses new ones.

A start that cannot succeed (a model that does not load, an address or port
that cannot be bound) raises :class:`StartupError`, one line naming the flag or
file and the reason, after undoing what was started. A unix socket is claimed,
never taken: one that a live server answers on is refused, a stale one (its
server was killed) replaced, and on stop the socket is removed only if it is
still the one this process bound (see :func:`_claim_unix` for how gRPC is kept
from unlinking it by name).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import signal
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tokcache.sidecar.config import Config, ConfigError, ModelSpec, flag
from tokcache.sidecar.engine.model import Limits, ModelEngine, fingerprint_of
from tokcache.sidecar.pressure import PressureMonitor, PressurePolicy
from tokcache.sidecar.service import TokenizerService
from tokcache.sidecar.telemetry import Metrics, Tracing
from tokcache.sidecar.tier import DEFAULT_TTL_S, ArTier, TierFeed, TierUrl
from tokcache.store import Kind, Store, StoreError, id_bytes_for, segment_name, usable_size
from tokcache.v1 import tokenizer_pb2 as pb
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["Sidecar", "StartupError", "load_error", "run"]

# Drain ends once no RPC has arrived for this long (and none is in flight).
_DRAIN_QUIET_S = 0.3
# What a start that is undone (a model that fails to load) gives the RPCs in flight: they answer
# UNAVAILABLE at once, but one that arrived as the server stopped was cancelled under grace 0, and
# gRPC logs each such handler as a CancelledError traceback. server.stop returns as soon as none is
# left, so this only bounds the wait.
_UNDO_GRACE_S = 1.0

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tokenizer"].full_name

# sockaddr_un.sun_path holds 108 bytes with the terminating NUL.
_UNIX_PATH_MAX = 107


class StartupError(RuntimeError):
    """The sidecar cannot start. The message is one line naming the flag or file and the reason."""


class _DecodeGuard(grpc.aio.ServerInterceptor):
    """Answers bytes that are not a valid message of the method's request type (corrupt
    wire format, invalid UTF-8 in a string field) with INVALID_ARGUMENT. Left to grpc.aio,
    they get UNKNOWN and an ERROR traceback in the log per request."""

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, details.method

        async def parsed(raw: bytes, context: Any) -> Any:
            try:
                return parse(raw)
            except Exception as exc:  # DecodeError, and whatever else a parser may raise
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request: not a valid {method} request message ({exc})")

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def guarded_unary(raw: bytes, context: Any) -> Any:
                return await unary(await parsed(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(
                guarded_unary, response_serializer=handler.response_serializer)
        # Client-streaming and bidirectional handlers get the same parsed request iterator.
        for inner, make in ((handler.stream_unary, grpc.stream_unary_rpc_method_handler),
                            (handler.stream_stream, grpc.stream_stream_rpc_method_handler)):
            if inner is not None:
                return make(_guard_stream(inner, parsed), response_serializer=handler.response_serializer)
        return handler


def _guard_stream(inner: Any, parsed: Any) -> Any:
    """``inner`` fed requests parsed by ``parsed`` (which aborts on bytes that do not parse)."""

    async def guarded(raws: Any, context: Any) -> Any:
        async def requests() -> Any:
            async for raw in raws:
                yield await parsed(raw, context)

        return await inner(requests(), context)

    return guarded


def _one_line(exc: BaseException) -> str:
    """An exception as one line: an OSError's reason, else its message."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


def _answers(path: Path) -> bool:
    """Whether a server accepts connections on the unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False  # nothing listens: a socket left by a killed sidecar
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.ETIMEDOUT) or isinstance(exc, TimeoutError):
            return True  # a live server with a full backlog
        raise
    finally:
        probe.close()
    return True


def _refuse_taken(where: str, path: Path) -> bool:
    """Raise StartupError if ``path`` is anything but a free name or a stale socket; return
    whether a stale socket is there (its server was killed before it could remove it)."""
    try:
        mode = path.lstat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False  # nothing there (whether its directory can be made is checked when binding)
    except OSError as exc:
        raise StartupError(f"{where}: cannot inspect {path}: {_one_line(exc)}") from exc
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{where}: {path} exists and is not a socket")
    try:
        live = _answers(path)
    except OSError as exc:
        raise StartupError(f"{where}: cannot check whether a server uses {path}: {_one_line(exc)}") from exc
    if live:
        raise StartupError(f"{where}: another server is listening on {path} (a sidecar already running?); "
                           "stop it or give another socket path")
    return True


def _claim_unix(listen: str) -> tuple[Path, Path]:
    """Check the socket path of ``listen`` (``unix://…``); return it and the private path to bind.

    gRPC unlinks its bind path before binding and again, by name, when the server stops, so
    binding the public path would take over a live server's socket and could delete one that
    replaced ours. The server binds a private name in the same directory instead, and
    :func:`_publish_unix` links it to the public one. Raises StartupError with the reason
    (gRPC's bind error gives none): path too long, directory not creatable, taken.
    """
    where = f"{flag('listen')} {listen}"
    public = Path(listen[len("unix://"):])
    private = public.with_name(f".tc-{secrets.token_hex(4)}")
    for path in (public, private):
        if len(os.fsencode(path)) > _UNIX_PATH_MAX:
            raise StartupError(f"{where}: the socket path {path} is {len(os.fsencode(path))} bytes; "
                               f"the kernel takes at most {_UNIX_PATH_MAX}")
    try:
        public.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"{where}: cannot create the directory {public.parent}: {_one_line(exc)}") from exc
    _refuse_taken(where, public)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind(str(private))
    except OSError as exc:
        raise StartupError(f"{where}: cannot bind a socket in {public.parent}: {_one_line(exc)}") from exc
    else:
        private.unlink(missing_ok=True)
    finally:
        probe.close()
    return public, private


def _publish_unix(listen: str, private: Path, public: Path) -> tuple[int, int]:
    """Give the socket bound at ``private`` its public name; return its (st_dev, st_ino).

    ``link`` creates the name only if it is free, so of two sidecars starting at once one
    wins and the other is refused; a stale socket is replaced.
    """
    where = f"{flag('listen')} {listen}"
    try:
        for _ in range(3):
            try:
                os.link(private, public)
                break
            except FileExistsError:
                if _refuse_taken(where, public):
                    public.unlink(missing_ok=True)
        else:
            raise StartupError(f"{where}: {public} keeps reappearing (another sidecar starting?)")
    except OSError as exc:
        raise StartupError(f"{where}: cannot create {public}: {_one_line(exc)}") from exc
    finally:
        private.unlink(missing_ok=True)
    st = public.lstat()
    return st.st_dev, st.st_ino


def _tcp_bind_error(listen: str, *, exclusive: bool) -> str | None:
    """Why ``HOST:PORT`` cannot be bound, or None if it can (port 0 always can).

    ``exclusive``: also refuse a port that another SO_REUSEPORT listener holds (gRPC sets
    SO_REUSEPORT, so two sidecars would otherwise share a port in silence). ``--workers``
    children share theirs on purpose and do not ask for this.
    """
    host, _, port_s = listen.rpartition(":")
    host = host.strip("[]")
    if int(port_s) == 0:
        return None
    try:
        infos = socket.getaddrinfo(host or None, int(port_s), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror}"
    reasons = []
    for family, kind, proto, _, addr in infos:
        probe = socket.socket(family, kind, proto)
        try:
            # As gRPC binds: SO_REUSEADDR (a port in TIME_WAIT is free) and SO_REUSEPORT.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if not exclusive:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            probe.bind(addr)
            return None  # gRPC serves if any resolved address binds
        except OSError as exc:
            reason = _one_line(exc)
            if exc.errno == errno.EADDRINUSE:
                reason += f" (another process listens on port {port_s})"
            reasons.append(f"{host or '*'}:{port_s}: {reason}")
        finally:
            probe.close()
    return "cannot bind " + "; ".join(dict.fromkeys(reasons))  # localhost: once, not per family


def check_listen(listen: str) -> None:
    """Raise StartupError if a single sidecar could not bind ``listen`` as its own (before
    anything loads; :meth:`Sidecar.start` checks again as it binds)."""
    if listen.startswith("unix://"):
        _refuse_taken(f"{flag('listen')} {listen}", Path(listen[len("unix://"):]))
        return
    reason = _tcp_bind_error(listen, exclusive=True)
    if reason is not None:
        raise StartupError(f"{flag('listen')} {listen}: {reason}")


def check_models(models: tuple[ModelSpec, ...]) -> None:
    """Raise StartupError unless every model directory holds a readable tokenizer.json (cheap)."""
    for spec in models:
        try:
            spec.check()
        except ConfigError as exc:
            raise StartupError(str(exc)) from exc


def load_error(spec: ModelSpec | None, exc: BaseException, config: Config) -> str:
    """One line for a model that did not load, naming it as the user gave it and the file."""
    where = spec.describe() if spec is not None else "models"
    if isinstance(exc, OSError) and exc.filename:
        return f"{where}: {exc.filename}: {_one_line(exc)}"
    if isinstance(exc, StoreError):
        return (f"{where}: shared-memory segment ({flag('shm_prefix')} {config.shm_prefix}, "
                f"{flag('shm_size')} {config.shm_size}): {_one_line(exc)}")
    if type(exc) is Exception and spec is not None:
        # What the tokenizers library raises for a tokenizer.json it cannot parse.
        return f"{where}: {spec.path / 'tokenizer.json'} is not a valid tokenizer: {_one_line(exc)}"
    return f"{where}: {type(exc).__name__}: {_one_line(exc)}"


def _make_tier(config: Config, metrics: Metrics) -> ArTier | None:
    """The cluster tier of ``--ar-store`` (None without one); StartupError without redis-py."""
    if not config.ar_store:
        return None
    url = TierUrl.parse(config.ar_store)  # checked by Config already
    try:
        tier = ArTier(url, timeout_s=config.ar_store_timeout_ms / 1000, ttl_s=config.ttl_ar or DEFAULT_TTL_S,
                      observe=metrics.observe_tier)
    except ImportError as exc:
        raise StartupError(f"{flag('ar_store')} {url.display}: {exc}") from exc
    return tier


class Sidecar:
    """One server process: gRPC server + engines + stores. Use from one event loop."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.stores: dict[str, Store] = {}
        self.metrics = Metrics(stores=lambda: {s.name: s for s in self.stores.values()})
        self.tracing = Tracing.from_env()
        self.tier = _make_tier(config, self.metrics)
        self.service = TokenizerService(config.default_mode, metrics=self.metrics, tracing=self.tracing,
                                        tier=self.tier)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.pressure: PressureMonitor | None = None
        # Follows the segments' logs for the tier (one process per node: a --workers group's
        # first worker; see TierFeed).
        self.feeds_tier = True
        self._feed: TierFeed | None = None
        # The unix socket this process bound, as (path, (st_dev, st_ino)): removed on stop
        # only while the path still names that socket.
        self._socket: tuple[Path, tuple[int, int]] | None = None
        # The model being loaded (for the StartupError of one that fails).
        self._loading: ModelSpec | None = None
        self._closed = False

    async def start(self) -> None:
        """Bind and start serving (NOT_SERVING until :meth:`load` finishes).

        Raises StartupError (having undone what it started) if the listen address or the
        metrics port cannot be bound, or a live server answers on the unix socket.
        """
        cfg = self.config
        try:
            unix = _claim_unix(cfg.listen) if cfg.listen.startswith("unix://") else None
            if cfg.metrics_port:
                try:
                    self.metrics.serve(cfg.metrics_port, cfg.metrics_addr)
                except OSError as exc:
                    raise StartupError(f"{flag('metrics_port')} {cfg.metrics_port}: cannot listen on "
                                       f"{cfg.metrics_addr}:{cfg.metrics_port}: {_one_line(exc)}") from exc
            server = grpc.aio.server(interceptors=[_DecodeGuard()], options=[
                ("grpc.max_receive_message_length", cfg.max_request_bytes),
                ("grpc.max_send_message_length", cfg.max_request_bytes),
            ])
            pb_grpc.add_TokenizerServicer_to_server(self.service, server)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
            try:
                self.port = server.add_insecure_port(f"unix://{unix[1]}" if unix else cfg.listen)
            except RuntimeError as exc:  # "Failed to bind to address …", no reason given
                reason = None if unix else _tcp_bind_error(cfg.listen, exclusive=False)
                raise StartupError(f"{flag('listen')} {cfg.listen}: {reason or 'gRPC could not bind it'}") from exc
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            await server.start()
            self.server = server
            if unix:
                public, private = unix
                self._socket = (public, _publish_unix(cfg.listen, private, public))
        except BaseException:
            await self.close()
            raise
        log.debug("bound %s (NOT_SERVING until the models load)", cfg.listen)

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _load_models(self) -> dict[str, ModelEngine]:
        cfg = self.config
        limits = Limits(max_text_bytes=cfg.max_text_bytes, max_messages=cfg.max_messages)
        ttl = {Kind.L0: cfg.ttl_l0, Kind.L1: cfg.ttl_l1, Kind.AR: cfg.ttl_ar}
        engines: dict[str, ModelEngine] = {}
        for spec in self._each_model():
            fp = fingerprint_of(spec.path / "tokenizer.json")
            # The engine first: its vocabulary decides the id width of a segment we create.
            engine = ModelEngine(spec.name, spec.path, store=None, limits=limits, backends=cfg.backends)
            store = self.stores.get(fp)
            if store is None:
                # Sized to what /dev/shm can back (a page it cannot would be SIGBUS); SegmentFull
                # when not even the --shm-size minimum (1 MiB) fits.
                size, why = usable_size(segment_name(cfg.shm_prefix, fp), cfg.shm_size, minimum=1 << 20)
                if why:
                    log.warning("%s %d bytes does not fit: %s; using %d bytes", flag("shm_size"), cfg.shm_size,
                                why, size)
                store = Store.open(prefix=cfg.shm_prefix, fingerprint=fp, size=size, ttl=ttl,
                                   id_bytes=id_bytes_for(engine.vocab_size))
                self.stores[fp] = store
                log.info("shm segment %s (%d bytes, %d-byte ids): %s", store.name, store.size, store.id_bytes,
                         "re-attached warm" if store.attached_existing else "created")
            engine.store = store
            engines[spec.name] = engine
        # Publish what readers need (proved encoder, boundaries, affixes), once per segment:
        # from then on a client that maps it tokenizes in its own process.
        names: dict[str, list[str]] = {}
        for name, engine in engines.items():
            names.setdefault(engine.fingerprint, []).append(name)
        for engine in engines.values():
            if engine.fingerprint in names:
                engine.publish(names.pop(engine.fingerprint), {"l0": cfg.ttl_l0, "l1": cfg.ttl_l1, "ar": cfg.ttl_ar},
                               ar_tier=self.tier is not None)
        return engines

    def _each_model(self) -> Iterator[ModelSpec]:
        """The configured models, noting which one is loading (see :meth:`load`)."""
        for spec in self.config.models:
            self._loading = spec
            yield spec
        self._loading = None

    async def load(self) -> None:
        """Load every model (in a thread: the health service answers meanwhile), then SERVING.

        Raises StartupError naming the model (as given) and the file that failed.
        """
        check_models(self.config.models)
        try:
            engines = await asyncio.to_thread(self._load_models)
        except Exception as exc:
            raise StartupError(load_error(self._loading, exc, self.config)) from exc
        if self.config.pressure_interval > 0:  # off in --workers children: the supervisor runs it
            self.pressure = PressureMonitor(lambda: list(self.stores.values()),
                                            PressurePolicy.from_config(self.config))
            self.pressure.start()
        if self.tier is not None:
            await self.tier.start()  # a tier that is down is logged: Tokenize serves without it
            if self.feeds_tier:
                self._feed = TierFeed(self.tier, lambda: [(e.fingerprint, e.store) for e in engines.values()
                                                          if e.store is not None])
                self._feed.start()
        self.service.set_engines(engines)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %d model(s): %s", len(engines), ", ".join(engines))

    async def stop(self, grace: float | None = None) -> None:
        """Drain within ``grace`` seconds, then stop.

        NOT_SERVING first; then new RPCs are answered UNAVAILABLE (retryable)
        while in-flight ones finish, until nothing is in flight and no RPC has
        arrived for a quiet period — so clients learn to back off instead of
        having calls queued inside gRPC cancelled by ``server.stop``. Then
        ``server.stop`` with what is left of the grace period.
        """
        grace = self.config.grace_seconds if grace is None else grace
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.service.draining = True
        ended = self.service.end_streams()
        if ended:
            log.info("ended %d idle TokenizeStream(s)", ended)
        while loop.time() < deadline:
            quiet = time.monotonic() - self.service.last_rpc > _DRAIN_QUIET_S
            if self.service.inflight == 0 and quiet:
                break
            await asyncio.sleep(0.02)
        log.info("drained (%d in flight at stop)", self.service.inflight)
        await self.close(max(0.0, deadline - loop.time()))

    async def close(self, grace: float | None = _UNDO_GRACE_S) -> None:
        """Stop the server (``grace`` seconds for calls in flight) and release everything:
        metrics port, pressure monitor, stores, tracing, and the unix socket if it is still
        ours. No drain (see :meth:`stop`); also undoes a failed start. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.server is not None:
            # Streams waiting for a request end with OK first: server.stop would cancel their
            # handlers, and gRPC logs each as a CancelledError traceback (a client's stream
            # opened while the models loaded, then the load failed).
            self.service.draining = True
            if self.service.end_streams():
                await asyncio.sleep(0)
            await self.server.stop(grace)
            self.server = None
        self.metrics.close()
        if self.pressure is not None:
            self.pressure.stop()
            self.pressure = None
        if self._feed is not None:
            await self._feed.stop()
            self._feed = None
        if self.tier is not None:
            await self.tier.close()
        for store in self.stores.values():
            store.close()
        self.tracing.shutdown()
        self._remove_socket()

    def _remove_socket(self) -> None:
        """Unlink the socket this process bound, unless the path now names another one."""
        if self._socket is None:
            return
        path, ours = self._socket
        self._socket = None
        try:
            st = path.lstat()
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == ours:
            path.unlink(missing_ok=True)
        else:
            log.warning("%s is no longer the socket this sidecar bound (another server replaced it): "
                        "left in place", path)

    async def wait(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


async def _serve(config: Config) -> None:
    check_models(config.models)
    check_listen(config.listen)
    sidecar = Sidecar(config)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await sidecar.start()
    try:
        await sidecar.load()
    except BaseException:
        await sidecar.close()
        raise
    log.info("listening on %s (tracing %s)", config.listen, "on" if sidecar.tracing.enabled else "off")
    await stopping.wait()
    log.info("signal received: draining (grace %.1fs)", config.grace_seconds)
    await sidecar.stop()
    log.info("stopped (pid %d)", os.getpid())


def run(config: Config) -> None:
    """Serve until SIGTERM/SIGINT. Blocks. Raises StartupError if the sidecar cannot start."""
    asyncio.run(_serve(config))
