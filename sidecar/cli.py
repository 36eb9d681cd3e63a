"""``tokcache-sidecar``: the command line.

    tokcache-sidecar serve --listen unix:///run/tokcache/tokcache.sock --model qwen3=/models/qwen3
    tokcache-sidecar stats [--shm-prefix tokcache]
    tokcache-sidecar clean [--shm-prefix tokcache] [--force]
    tokcache-sidecar health [--address unix:///run/tokcache/tokcache.sock]
    tokcache-sidecar --version

Flags map 1:1 to :class:`tokcache.sidecar.config.Config` fields; each also comes from
the config file (``--config``, TOML) and ``TOKCACHE_*`` variables. A user error (bad
flag, model directory, address in use) is one line on stderr and a non-zero exit:
2 for configuration, 1 for a start that failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from tokcache import __version__
from tokcache.sidecar.config import ENV, ConfigError, load_config

__all__ = ["main"]

PROG = "tokcache-sidecar"
# Where POSIX shared memory lives on Linux, and the names tokcache gives there: segments
# ``<prefix>-<fingerprint>`` (tokcache.store.segment_name), their writer-lock semaphores
# ``sem.<segment>.lock``, and a creator's temporaries ``<segment>.new-…``.
SHM_DIR = Path("/dev/shm")
_SEGMENT_RE = re.compile(r"(?P<prefix>[A-Za-z0-9][A-Za-z0-9._-]*)-(?P<fingerprint>[0-9a-f]{32})")


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
    p.add_argument("--ar-store", help=f"cluster tier for recorded outputs: redis://HOST:PORT[/DB], rediss://..., "
                                      f"redis+cluster://HOST:PORT (env {ENV['ar_store']}; a URL with a password "
                                      "belongs in the environment, not on a command line)")
    p.add_argument("--ar-store-timeout-ms", help=f"deadline of a tier read on the Tokenize path, ms "
                                                 f"(env {ENV['ar_store_timeout_ms']}; default 20)")


def _health_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("health", help="exit 0 if the sidecar's gRPC health service says SERVING (a probe)")
    p.add_argument("--address", help="unix:///path.sock or HOST:PORT (default: $TOKCACHE_ADDRESS, else --listen)")
    p.add_argument("--service", default="", help="health service name ('' = overall)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")


def _stats_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stats", help="print the shared-memory segments' counters as JSON")
    p.add_argument("--shm-prefix", help=f"only segments under this name prefix (env {ENV['shm_prefix']}; "
                                        "default: every tokcache segment in /dev/shm)")


def _clean_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("clean", help="remove the shared-memory segments and semaphores under a prefix",
                       description="Remove /dev/shm/<prefix>-<fingerprint> segments, their sem.<segment>.lock "
                                   "semaphores and leftover temporaries. A segment that a live process maps "
                                   "(per /proc/*/maps: processes of this pid namespace only) is kept unless "
                                   "--force. Exit 0 when nothing was kept, 1 otherwise.")
    p.add_argument("--shm-prefix", help=f"segment name prefix (env {ENV['shm_prefix']}; default tokcache)")
    p.add_argument("--force", action="store_true",
                   help="also remove what live processes map (they keep their mapping; nothing new finds it)")


def _fail(message: object, code: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def _serve(ns: argparse.Namespace) -> int:
    cli = {k: v for k, v in vars(ns).items() if k != "command"}
    try:
        config = load_config(cli)
        if not config.models:
            return _fail("no models: give --model NAME=DIR (or TOKCACHE_MODELS)", 2)
        for spec in config.models:  # before anything binds or logs
            spec.check()
    except ConfigError as exc:
        return _fail(exc, 2)
    if config.ar_store and _missing(("redis",)):
        return _fail("ar_store (--ar-store): the cluster tier needs redis-py: pip install 'tokcache[tier]'", 2)
    from tokcache.sidecar.telemetry.logs import setup_logging

    setup_logging(config.log_level, config.log_format)
    from tokcache.sidecar.server import StartupError, run  # grpc import only when serving

    if config.workers > 1:
        from tokcache.sidecar.workers import supervise

        try:
            return int(supervise(config))
        except StartupError as exc:
            return _fail(exc, 1)
        except OSError as exc:  # the supervisor's hold on the port
            return _fail(f"--listen {config.listen}: cannot bind: {exc.strerror or exc}", 1)

    try:
        run(config)
    except StartupError as exc:
        return _fail(exc, 1)
    return 0


def _segments(prefix: str | None) -> dict[str, list[str]]:
    """Names of the segments in SHM_DIR, by prefix (only ``prefix``'s when given)."""
    try:
        names = sorted(os.listdir(SHM_DIR))
    except OSError:
        return {}
    out: dict[str, list[str]] = {}
    for name in names:
        m = _SEGMENT_RE.fullmatch(name)
        if m is not None and (prefix is None or m["prefix"] == prefix):
            out.setdefault(m["prefix"], []).append(name)
    return out


def _stats(ns: argparse.Namespace) -> int:
    from tokcache.store import read_stats

    given = ns.shm_prefix or os.environ.get(ENV["shm_prefix"])
    try:
        prefix = load_config({"shm_prefix": given}).shm_prefix if given else None
    except ConfigError as exc:
        return _fail(exc, 2)
    stats = [item for p in _segments(prefix) for item in read_stats(p)]
    print(json.dumps(stats, indent=2, sort_keys=True))
    if not stats:
        where = f"under the prefix {prefix!r}" if prefix else "of any prefix"
        print(f"{PROG}: no tokcache segments {where} in {SHM_DIR}", file=sys.stderr)
    return 0


def _mappers() -> dict[tuple[int, int], list[str]]:
    """(st_dev, st_ino) of every /dev/shm file a live process maps -> ``pid N (comm)`` for each.

    By inode, not by name: a segment (and a glibc semaphore) is created under a temporary
    name and linked to its own, so maps show the temporary one, "(deleted)". Processes whose
    maps cannot be read (gone, or another user's without privileges) are skipped; processes
    of other pid namespaces are not visible here at all.
    """
    out: dict[tuple[int, int], list[str]] = {}
    shm = f"{SHM_DIR}/"
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                lines = [line for line in maps if shm in line]
            comm = Path(f"/proc/{pid}/comm").read_text().strip() if lines else ""
        except OSError:
            continue
        seen = set()
        for line in lines:
            # address perms offset dev(major:minor, hex) inode path
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[5].startswith(shm):
                continue
            major, _, minor = fields[3].partition(":")
            key = (os.makedev(int(major, 16), int(minor, 16)), int(fields[4]))
            if key not in seen:
                seen.add(key)
                out.setdefault(key, []).append(f"pid {pid} ({comm})")
    return out


def _clean(ns: argparse.Namespace) -> int:
    try:
        prefix = load_config({"shm_prefix": ns.shm_prefix}).shm_prefix
    except ConfigError as exc:
        return _fail(exc, 2)
    mappers = _mappers()
    segments = _segments(prefix).get(prefix, [])
    # Each segment with its semaphore; then semaphores and temporaries whose segment is gone.
    groups: list[list[str]] = [[name, f"sem.{name}.lock"] for name in segments]
    strays = re.compile(rf"sem\.{re.escape(prefix)}-[0-9a-f]{{32}}\.lock|{re.escape(prefix)}-[0-9a-f]{{32}}\.new-.+")
    try:
        listed = sorted(os.listdir(SHM_DIR))
    except OSError as exc:
        return _fail(f"cannot list {SHM_DIR}: {exc.strerror or exc}", 1)
    grouped = {n for g in groups for n in g}
    groups += [[n] for n in listed if strays.fullmatch(n) and n not in grouped]
    removed = kept = 0
    for group in groups:
        paths = [SHM_DIR / n for n in group if (SHM_DIR / n).exists()]
        users = []
        for path in paths:
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            users += mappers.get((st.st_dev, st.st_ino), [])
        if users and not ns.force:
            kept += len(paths)
            for path in paths:
                print(f"kept {path}: mapped by {', '.join(sorted(set(users)))} (stop it first, or --force)")
            continue
        for path in paths:
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                kept += 1
                print(f"kept {path}: cannot remove it: {exc.strerror or exc}")
                continue
            removed += 1
            note = f" (still mapped by {', '.join(sorted(set(users)))})" if users else ""
            print(f"removed {path} ({size} bytes){note}")
    if not removed and not kept:
        print(f"nothing to clean: no segments under the prefix {prefix!r} in {SHM_DIR}")
    return 1 if kept else 0


def _health(ns: argparse.Namespace) -> int:
    import os

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = ns.address or os.environ.get("TOKCACHE_ADDRESS")
    if not address:
        try:
            address = load_config({}).listen
        except ConfigError as exc:
            return _fail(exc, 2)
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
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _stats_parser(sub)
    _clean_parser(sub)
    _health_parser(sub)
    ns = parser.parse_args(argv)
    if ns.command in ("serve", "health"):
        missing = _missing_server_modules()
        if missing:
            return _fail(f"the sidecar needs the 'server' extra (missing: {', '.join(missing)}): "
                         "pip install 'tokcache[server]'", 2)
    commands = {"serve": _serve, "stats": _stats, "clean": _clean, "health": _health}
    return commands[ns.command](ns)


# The server's own dependencies (the `server` extra); a client install does not have them.
_SERVER_MODULES = ("grpc_health", "grpc_reflection", "jinja2", "opentelemetry.sdk", "prometheus_client")


def _missing_server_modules() -> list[str]:
    return _missing(_SERVER_MODULES)


def _missing(modules: Sequence[str]) -> list[str]:
    """The modules of ``modules`` that cannot be imported here."""
    import importlib.util

    out = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                out.append(name)
        except ImportError:  # a parent package is missing
            out.append(name)
    return out


if __name__ == "__main__":
    sys.exit(main())
