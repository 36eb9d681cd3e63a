"""Server lifecycle: bind, load models, serve, drain.

Order matters for probes: the socket is bound first with health
NOT_SERVING, tokenizers load (seconds), then SERVING. On SIGTERM/SIGINT:
NOT_SERVING, then ``stop(grace)`` drains in-flight RPCs and refuses new ones.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tokcache.sidecar.config import Config
from tokcache.sidecar.engine.model import Limits, ModelEngine, fingerprint_of
from tokcache.sidecar.pressure import PressureMonitor, PressurePolicy
from tokcache.sidecar.service import TokenizerService
from tokcache.sidecar.telemetry import Metrics, Tracing
from tokcache.store import Kind, Store, id_bytes_for
from tokcache.v1 import tokenizer_pb2 as pb
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["Sidecar", "run"]

# Drain ends once no RPC has arrived for this long (and none is in flight).
_DRAIN_QUIET_S = 0.3

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tokenizer"].full_name


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


def _prepare_unix(address: str) -> None:
    path = Path(address[len("unix://"):])
    path.parent.mkdir(parents=True, exist_ok=True)
    # A socket left by a killed sidecar would make bind fail.
    if path.is_socket():
        path.unlink()


class Sidecar:
    """One server process: gRPC server + engines + stores. Use from one event loop."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.stores: dict[str, Store] = {}
        self.metrics = Metrics(stores=lambda: {s.name: s for s in self.stores.values()})
        self.tracing = Tracing.from_env()
        self.service = TokenizerService(config.default_mode, metrics=self.metrics, tracing=self.tracing)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.pressure: PressureMonitor | None = None

    async def start(self) -> None:
        """Bind and start serving (NOT_SERVING until :meth:`load` finishes)."""
        cfg = self.config
        server = grpc.aio.server(interceptors=[_DecodeGuard()], options=[
            ("grpc.max_receive_message_length", cfg.max_request_bytes),
            ("grpc.max_send_message_length", cfg.max_request_bytes),
        ])
        pb_grpc.add_TokenizerServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        if cfg.listen.startswith("unix://"):
            _prepare_unix(cfg.listen)
        self.port = server.add_insecure_port(cfg.listen)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self.server = server
        if cfg.metrics_port:
            self.metrics.serve(cfg.metrics_port, cfg.metrics_addr)
        log.info("listening on %s (tracing %s)", cfg.listen, "on" if self.tracing.enabled else "off")

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _load_models(self) -> dict[str, ModelEngine]:
        cfg = self.config
        limits = Limits(max_text_bytes=cfg.max_text_bytes, max_messages=cfg.max_messages)
        ttl = {Kind.L0: cfg.ttl_l0, Kind.L1: cfg.ttl_l1, Kind.AR: cfg.ttl_ar}
        engines: dict[str, ModelEngine] = {}
        for spec in cfg.models:
            fp = fingerprint_of(spec.path / "tokenizer.json")
            # The engine first: its vocabulary decides the id width of a segment we create.
            engine = ModelEngine(spec.name, spec.path, store=None, limits=limits, backends=cfg.backends)
            store = self.stores.get(fp)
            if store is None:
                store = Store.open(prefix=cfg.shm_prefix, fingerprint=fp, size=cfg.shm_size, ttl=ttl,
                                   id_bytes=id_bytes_for(engine.vocab_size))
                self.stores[fp] = store
                log.info("shm segment %s (%d bytes, %d-byte ids): %s", store.name, store.size, store.id_bytes,
                         "re-attached warm" if store.attached_existing else "created")
            engine.store = store
            engines[spec.name] = engine
        return engines

    async def load(self) -> None:
        """Load every model (in a thread: the health service answers meanwhile), then SERVING."""
        engines = await asyncio.to_thread(self._load_models)
        if self.config.pressure_interval > 0:  # off in --workers children: the supervisor runs it
            self.pressure = PressureMonitor(lambda: list(self.stores.values()),
                                            PressurePolicy.from_config(self.config))
            self.pressure.start()
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
        if self.server is not None:
            await self.server.stop(max(0.0, deadline - loop.time()))
        if self.pressure is not None:
            self.pressure.stop()
        for store in self.stores.values():
            store.close()
        self.tracing.shutdown()
        if self.config.listen.startswith("unix://"):
            Path(self.config.listen[len("unix://"):]).unlink(missing_ok=True)

    async def wait(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


async def _serve(config: Config) -> None:
    sidecar = Sidecar(config)
    await sidecar.start()
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await sidecar.load()
    except Exception:
        log.exception("loading models failed")
        await sidecar.stop(0)
        raise
    await stopping.wait()
    log.info("signal received: draining (grace %.1fs)", config.grace_seconds)
    await sidecar.stop()
    log.info("stopped (pid %d)", os.getpid())


def run(config: Config) -> None:
    """Serve until SIGTERM/SIGINT. Blocks."""
    asyncio.run(_serve(config))
