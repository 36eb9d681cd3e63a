"""``tokcache-sidecar``: the command line.

    tokcache-sidecar serve --listen unix:///run/tokcache/tokcache.sock --model qwen3=/models/qwen3
    tokcache-sidecar stats [--shm-prefix tokcache]

Flags map 1:1 to :class:`sidecar.config.Config` fields; each also comes from
the config file (``--config``, TOML) and ``TOKCACHE_*`` variables.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from sidecar.config import ENV, ConfigError, load_config

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
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from sidecar.server import run  # grpc import only when serving

    run(config)
    return 0


def _stats(ns: argparse.Namespace) -> int:
    from sidecar.store import read_stats

    try:
        config = load_config({"shm_prefix": ns.shm_prefix})
    except ConfigError as exc:
        print(f"tokcache-sidecar: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(read_stats(config.shm_prefix), indent=2, sort_keys=True))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokcache-sidecar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _stats_parser(sub)
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        return _serve(ns)
    return _stats(ns)


if __name__ == "__main__":
    sys.exit(main())
