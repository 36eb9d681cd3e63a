"""``tokcache-sidecar``: the command line.

    tokcache-sidecar serve --listen unix:///run/tokcache/tokcache.sock --model qwen3=/models/qwen3
    tokcache-sidecar stats [--shm-prefix tokcache]
    tokcache-sidecar health [--address unix:///run/tokcache/tokcache.sock]

Flags map 1:1 to :class:`tokcache.sidecar.config.Config` fields; each also comes from
the config file (``--config``, TOML) and ``TOKCACHE_*`` variables.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from tokcache.sidecar.config import ENV, ConfigError, load_config

__all__ = ["main"]


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the sidecar server")
    p.add_argument("--config", help=f"TOML config file (env {ENV['config']})")
    p.add_argument("--listen", help=f"unix:///path.sock or HOST:PORT (env {ENV['listen']})")
    p.add_argument("--model", dest="models", action="append", metavar="NAME=DIR",
                   help=f"a model to serve; repeat for several (env {ENV['models']}=N=D,N=D)")
    p.add_argument("--shm-size", help=f"shared-memory cache bytes per tokenizer, e.g. 256MiB (env {ENV['shm_size']})")
    p.add_argument("--shm-prefix", help=f"shm segment name prefix (env {ENV['shm_prefix']})")
    p.add_argument("--mode", dest="default_mode", choices=("kv-stable", "exact"),
                   help=f"default tokenize mode (env {ENV['default_mode']})")
    p.add_argument("--max-text-bytes", help=f"largest prompt accepted (env {ENV['max_text_bytes']})")
    p.add_argument("--max-messages", help=f"most chat messages accepted (env {ENV['max_messages']})")
    p.add_argument("--max-request-bytes", help=f"largest gRPC message (env {ENV['max_request_bytes']})")
    p.add_argument("--ttl-l0", help=f"L0 entry lifetime, seconds, 0 = none (env {ENV['ttl_l0']})")
    p.add_argument("--ttl-l1", help=f"L1 entry lifetime, seconds (env {ENV['ttl_l1']})")
    p.add_argument("--ttl-ar", help=f"AR entry lifetime, seconds (env {ENV['ttl_ar']})")
    p.add_argument("--backends", help=f"encoders allowed, in order, e.g. fastokens,tokenizers (env {ENV['backends']})")
    p.add_argument("--log-level", help=f"debug|info|warning|error (env {ENV['log_level']})")
    p.add_argument("--grace-seconds", help=f"drain time on SIGTERM (env {ENV['grace_seconds']})")
    p.add_argument("--metrics-port", help=f"Prometheus /metrics port, 0 = off (env {ENV['metrics_port']})")
    p.add_argument("--metrics-addr", help=f"address the metrics port binds (env {ENV['metrics_addr']})")
    p.add_argument("--log-format", choices=("json", "text"), help=f"log lines (env {ENV['log_format']})")
    p.add_argument("--workers", help=f"server processes sharing the segment and a HOST:PORT (env {ENV['workers']})")
    p.add_argument("--pressure-interval", help=f"seconds between memory-pressure checks, 0 = off "
                                               f"(env {ENV['pressure_interval']})")
    p.add_argument("--pressure-low-watermark", help=f"share of the cache kept under memory pressure, e.g. 0.25 "
                                                    f"(env {ENV['pressure_low_watermark']})")
    p.add_argument("--pressure-cgroup-ratio", help=f"cgroup working set / memory.max that means pressure "
                                                   f"(env {ENV['pressure_cgroup_ratio']})")
    p.add_argument("--pressure-psi-avg10", help=f"memory PSI 'some avg10' %% that means pressure "
                                                f"(env {ENV['pressure_psi_avg10']})")
    p.add_argument("--pressure-min-available", help=f"MemAvailable / MemTotal below which is pressure "
                                                    f"(env {ENV['pressure_min_available']})")


def _health_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("health", help="exit 0 if the sidecar's gRPC health service says SERVING (a probe)")
    p.add_argument("--address", help="unix:///path.sock or HOST:PORT (default: $TOKCACHE_ADDRESS, else --listen)")
    p.add_argument("--service", default="", help="health service name ('' = overall)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")


def _stats_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stats", help="print the live shared-memory segments' counters as JSON")
    p.add_argument("--shm-prefix", help=f"shm segment name prefix (env {ENV['shm_prefix']})")


def _serve(ns: argparse.Namespace) -> int:
    cli = {k: v for k, v in vars(ns).items() if k != "command"}
    try:
        config = load_config(cli)
    except ConfigError as exc:
        print(f"tokcache-sidecar: {exc}", file=sys.stderr)
        return 2
    if not config.models:
        print("tokcache-sidecar: no models: give --model NAME=DIR (or TOKCACHE_MODELS)", file=sys.stderr)
        return 2
    from tokcache.sidecar.telemetry.logs import setup_logging

    setup_logging(config.log_level, config.log_format)
    if config.workers > 1:
        from tokcache.sidecar.workers import supervise

        return supervise(config)
    from tokcache.sidecar.server import run  # grpc import only when serving

    run(config)
    return 0


def _stats(ns: argparse.Namespace) -> int:
    from tokcache.store import read_stats

    try:
        config = load_config({"shm_prefix": ns.shm_prefix})
    except ConfigError as exc:
        print(f"tokcache-sidecar: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(read_stats(config.shm_prefix), indent=2, sort_keys=True))
    return 0


def _health(ns: argparse.Namespace) -> int:
    import os

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = ns.address or os.environ.get("TOKCACHE_ADDRESS")
    if not address:
        try:
            address = load_config({}).listen
        except ConfigError as exc:
            print(f"tokcache-sidecar: {exc}", file=sys.stderr)
            return 2
    try:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=ns.service), timeout=ns.timeout)
    except grpc.RpcError as exc:
        print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(status)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokcache-sidecar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _stats_parser(sub)
    _health_parser(sub)
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        return _serve(ns)
    if ns.command == "health":
        return _health(ns)
    return _stats(ns)


if __name__ == "__main__":
    sys.exit(main())
