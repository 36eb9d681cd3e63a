"""Soak: a real sidecar under 32 concurrent clients for >= 10 minutes, working set 10x the cap.

    python bench/soak.py [--minutes 10] [--clients 32] [--shm-size 8MiB] [--working-set-factor 10]
                         [--workers 1] [--ttl-l0 120] [--out bench/out]

Load (loopback only: a unix socket, or 127.0.0.1 with ``--workers``): distinct texts
totalling ``--working-set-factor`` x the segment size, requested with a skewed
distribution (a hot head that hits, a long tail that misses and evicts), mixed with the
stress workload (chat rendered by the sidecar, growing conversations, RecordOutput and
AR follow-ups). Every answer is checked against HF tokenizers / transformers. Every
``--sample`` seconds: the segment's used bytes, soft cap and allocated (tmpfs) bytes,
the sidecar's RSS, requests and errors. Writes ``soak.json`` and ``soak.png`` (used
bytes vs cap and RSS over time, latency percentiles per window).
Bounded by ``--minutes``; stops the sidecar and removes its segment at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench._stats import percentile  # noqa: E402
from tests.stress.harness import (  # noqa: E402
    Item,
    SidecarProc,
    Workload,
    channel,
    free_port,
    shm_usage,
    stub,
    unlink_prefix,
)
from tokcache.sidecar.config import parse_size  # noqa: E402
from tokcache.store import read_stats  # noqa: E402
from tokcache.v1 import tokenizer_pb2 as pb  # noqa: E402

_VOCAB_WORDS = (
    "alpha beta gamma delta request response token cache segment prefix eviction kernel page worker "
    "lock record checksum latency throughput memory pressure cgroup tmpfs shared process thread "
    "def class return import yield async await None True False 0 1 2 3 7 42 100 1024 3.14159 "
    "你好 世界 数据 模型 日本語 テスト 한국어 émigré naïve Zürich façade 🎉 🚀 ✅ — … « » "
    "( ) [ ] { } : ; , . ! ? = + - * / < > == != <= >= && || \n \n\n \t"
).split(" ")


def distinct_texts(total_bytes: int, seed: int, mean: int = 8192) -> list[str]:
    """Unique texts of ~``mean`` bytes (1-16 KiB) until ``total_bytes`` (UTF-8) are reached."""
    rng = random.Random(seed)
    phrases = [" ".join(rng.choice(_VOCAB_WORDS) for _ in range(rng.randint(3, 12))) for _ in range(4000)]
    out: list[str] = []
    size = 0
    i = 0
    while size < total_bytes:
        target = rng.randint(mean // 8, 2 * mean - mean // 8)
        parts = [f"document {i} ({seed}):"]
        n = len(parts[0])
        while n < target:
            p = phrases[rng.randrange(len(phrases))]
            parts.append(p)
            n += len(p.encode()) + 1
        text = " ".join(parts)
        out.append(text)
        size += len(text.encode())
        i += 1
    return out


class Soak:
    def __init__(self, args: argparse.Namespace, workload: Workload, items: list[Item]) -> None:
        self.args = args
        self.workload = workload
        self.items = items  # the big distinct texts
        self.mixed = workload.items
        self.stop = threading.Event()
        # Guards the counters and latency lists below (client threads + sampler).
        self.lock = threading.Lock()
        self.ok = 0
        self.wrong = 0
        self.errors = 0
        self.error_examples: list[str] = []
        self.latencies: list[float] = []  # seconds, every request
        self.window: list[float] = []  # since the last sample
        self.sources: dict[str, int] = {}

    def client(self, address: str, seed: int) -> None:
        rng = random.Random(seed)
        n_big, n_mixed = len(self.items), len(self.mixed)
        with channel(address) as ch:
            s = stub(ch)
            while not self.stop.is_set():
                if rng.random() < 0.9:
                    item = self.items[int(n_big * rng.random() ** 3)]  # skewed: hot head, long tail
                else:
                    item = self.mixed[rng.randrange(n_mixed)]
                t0 = time.perf_counter()
                try:
                    response = self.workload.call(s, item, 60.0)
                except grpc.RpcError as exc:
                    with self.lock:
                        self.errors += 1
                        if len(self.error_examples) < 10:
                            self.error_examples.append(f"{exc.code()}: {exc.details()}")
                    continue
                dt = time.perf_counter() - t0
                good = item.check(response)
                source = pb.CacheSource.Name(response.decision.source) if item.kind != "record" else "record"
                with self.lock:
                    self.latencies.append(dt)
                    self.window.append(dt)
                    self.sources[source] = self.sources.get(source, 0) + 1
                    if good:
                        self.ok += 1
                    else:
                        self.wrong += 1


def _ms(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (seconds) in ms; 0 for none (a window in which no
    request finished plots at 0, where the requests-per-second line shows it too)."""
    p = percentile(values, q)
    return 1e3 * p if p is not None else 0.0


def server_latency(port: int) -> dict[str, Any]:
    """Server-side Tokenize latency (handler time, no queueing) from the sidecar's
    Prometheus histogram ``tokcache_rpc_duration_seconds``: quantiles interpolated in buckets."""
    import re
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError as exc:
        return {"error": str(exc)}
    buckets: dict[float, float] = {}
    for m in re.finditer(r'^tokcache_rpc_duration_seconds_bucket\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("method") == "Tokenize" and labels.get("code") == "OK":
            le = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + float(m.group(2))
    if not buckets:
        return {"error": "no Tokenize histogram"}
    edges = sorted(buckets)
    total = buckets[edges[-1]]
    out: dict[str, Any] = {"count": int(total), "buckets_s": [e for e in edges if e != float("inf")]}
    for name, q in (("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99)):
        rank, lo, below = q * total, 0.0, 0.0
        for e in edges:
            if buckets[e] >= rank:
                hi = e if e != float("inf") else lo
                frac = (rank - below) / max(1e-9, buckets[e] - below)
                out[name] = 1e3 * (lo + frac * (hi - lo))
                break
            lo, below = e, buckets[e]
    return out


def _segment(prefix: str) -> dict[str, Any]:
    stats = read_stats(prefix)
    return stats[0] if stats else {}


def _exit_on_sigterm(*_: object) -> None:
    raise SystemExit(143)  # unwinds through the finally blocks that stop the sidecar


def main() -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--shm-size", default="8MiB")
    ap.add_argument("--working-set-factor", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--ttl-l0", default="120")
    ap.add_argument("--sample", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    ap.add_argument("--name", default="soak")
    args = ap.parse_args()
    cap = parse_size(args.shm_size)

    import tokenizers

    t0 = time.time()
    workload = Workload(conversations=30, turns=6, ar_pairs=20).build()
    texts = distinct_texts(int(cap * args.working_set_factor), args.seed)
    tok = tokenizers.Tokenizer.from_file(str(workload.path / "tokenizer.json"))
    refs = tok.encode_batch(texts, add_special_tokens=False)
    items = [
        Item("text", pb.TokenizeRequest(model="qwen3", text=t, add_special_tokens=False, cache_salt="soak",
                                        mode=pb.TOKENIZE_MODE_EXACT if i % 3 == 0 else pb.TOKENIZE_MODE_KV_STABLE),
             (tuple(r.ids),), len(t.encode()))
        for i, (t, r) in enumerate(zip(texts, refs, strict=True))
    ]
    del refs
    working_set = sum(it.size for it in items)
    print(f"working set: {len(items)} distinct texts, {working_set / 2**20:.1f} MiB "
          f"({working_set / cap:.1f}x the {cap / 2**20:.0f} MiB cap) + {len(workload.items)} mixed items; "
          f"built in {time.time() - t0:.0f}s", flush=True)

    prefix = f"tksoak-{uuid.uuid4().hex[:8]}"
    soak = Soak(args, workload, items)
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tokcache-soak-") as tmp:
        metrics_port = free_port()
        proc = SidecarProc(Path(tmp), prefix, "--ttl-l0", args.ttl_l0, "--metrics-port", str(metrics_port),
                           "--metrics-addr", "127.0.0.1", shm_size=args.shm_size, workers=args.workers)
        signal.signal(signal.SIGTERM, lambda *_: soak.stop.set())
        try:
            proc.start(timeout=300)
            rss_start = proc.total_rss()
            threads = [threading.Thread(target=soak.client, args=(proc.address, args.seed * 100 + i), daemon=True)
                       for i in range(args.clients)]
            started = time.monotonic()
            for t in threads:
                t.start()
            deadline = started + args.minutes * 60
            while time.monotonic() < deadline and not soak.stop.is_set():
                time.sleep(min(args.sample, max(0.0, deadline - time.monotonic())))
                seg = _segment(prefix)
                usage = shm_usage(prefix)
                with soak.lock:
                    window, soak.window = soak.window, []
                    sample = {
                        "t": round(time.monotonic() - started, 2),
                        "requests": soak.ok + soak.wrong,
                        "errors": soak.errors,
                        "wrong": soak.wrong,
                        "window_p50_ms": _ms(window, 50),
                        "window_p99_ms": _ms(window, 99),
                        "window_rps": len(window) / args.sample,
                    }
                sample.update({
                    "used_bytes": seg.get("used_bytes", 0),
                    "soft_cap": seg.get("soft_cap", 0),
                    "segment_resident": seg.get("resident_bytes", 0),
                    "segment_size": seg.get("capacity", 0),
                    "shm_objects": usage.count,
                    "shm_allocated": usage.allocated,
                    "rss": proc.total_rss(),
                    "alive": proc.alive(),
                })
                samples.append(sample)
                print(f"t={sample['t']:7.1f}s req={sample['requests']:8d} err={sample['errors']} "
                      f"wrong={sample['wrong']} rps={sample['window_rps']:6.0f} "
                      f"p50={sample['window_p50_ms']:.2f}ms p99={sample['window_p99_ms']:.2f}ms "
                      f"used={sample['used_bytes'] / 2**20:.2f}MiB "
                      f"resident={sample['segment_resident'] / 2**20:.2f}MiB "
                      f"rss={sample['rss'] / 2**20:.1f}MiB", flush=True)
                if not sample["alive"]:
                    break
            soak.stop.set()
            for t in threads:
                t.join(70)
            elapsed = time.monotonic() - started
            server_side = server_latency(metrics_port)  # worker 0's share with --workers
            final_segment = _segment(prefix)
            rss_end = proc.total_rss()
            code = proc.stop()
        finally:
            soak.stop.set()
            proc.kill()
            unlink_prefix(prefix)

    lat = soak.latencies
    rss_series = [s["rss"] for s in samples]
    result = {
        "minutes": elapsed / 60,
        "clients": args.clients,
        "workers": args.workers,
        "cap_bytes": cap,
        "working_set_bytes": working_set,
        "working_set_factor": working_set / cap,
        "requests": soak.ok + soak.wrong,
        "requests_per_s": (soak.ok + soak.wrong) / elapsed,
        "errors": soak.errors,
        "wrong_answers": soak.wrong,
        "error_examples": soak.error_examples,
        "latency_ms": {"p50": _ms(lat, 50), "p90": _ms(lat, 90), "p99": _ms(lat, 99), "p999": _ms(lat, 99.9),
                       "max": 1e3 * max(lat, default=0.0),
                       "mean": 1e3 * statistics.fmean(lat) if lat else 0.0},
        "server_side_tokenize": server_side,
        "sources": soak.sources,
        "max_used_bytes": max((s["used_bytes"] for s in samples), default=0),
        "max_segment_resident": max((s["segment_resident"] for s in samples), default=0),
        "max_shm_objects": max((s["shm_objects"] for s in samples), default=0),
        "used_le_cap_every_sample": all(s["used_bytes"] <= s["segment_size"] <= cap for s in samples),
        "resident_le_cap_every_sample": all(s["segment_resident"] <= cap for s in samples),
        "rss_start": rss_start,
        "rss_first_sample": rss_series[0] if rss_series else 0,
        "rss_end": rss_end,
        "rss_min": min(rss_series, default=0),
        "rss_max": max(rss_series, default=0),
        "rss_first_minute_max": max((s["rss"] for s in samples if s["t"] <= 60), default=0),
        "rss_last_minute_max": max((s["rss"] for s in samples if s["t"] >= samples[-1]["t"] - 60), default=0),
        "final_segment": {k: v for k, v in final_segment.items() if k not in ("path",)},
        "exit_code": code,
        "samples": samples,
        "host": {"cpus": os.cpu_count()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    _plot(result, args.out / f"{args.name}.png")
    summary = {k: v for k, v in result.items() if k not in ("samples", "final_segment")}
    summary["evictions_by_cause"] = final_segment.get("evictions_by_cause")
    print(json.dumps(summary, indent=2))
    ok = soak.errors == 0 and soak.wrong == 0 and result["used_le_cap_every_sample"]
    return 0 if ok else 1


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t"] / 60 for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    mib = 2**20
    ax1.plot(t, [s["used_bytes"] / mib for s in samples], label="segment: live log (used bytes)")
    ax1.plot(t, [s["segment_resident"] / mib for s in samples], linewidth=3, alpha=0.6,
             label="segment: allocated in tmpfs")
    ax1.axhline(result["cap_bytes"] / mib, color="red", linestyle="--", label="cap (--shm-size)")
    ax1.set_ylim(0, result["cap_bytes"] / mib * 1.25)
    ax1.set_ylabel("segment MiB")
    ax1b = ax1.twinx()
    ax1b.plot(t, [s["rss"] / mib for s in samples], color="black", linewidth=1, label="sidecar RSS")
    ax1b.set_ylabel("RSS MiB")
    ax1b.set_ylim(0, max(s["rss"] for s in samples) / mib * 1.3)
    lines = ax1.get_legend_handles_labels()[0] + ax1b.get_legend_handles_labels()[0]
    labels = ax1.get_legend_handles_labels()[1] + ax1b.get_legend_handles_labels()[1]
    ax1.legend(lines, labels, loc="lower left", fontsize=8)
    ax1.set_title(f"soak: {result['clients']} clients, working set {result['working_set_factor']:.0f}x cap, "
                  f"{result['requests']} requests, {result['errors']} errors, {result['wrong_answers']} wrong")
    ax2.plot(t, [s["window_p50_ms"] for s in samples], label="p50")
    ax2.plot(t, [s["window_p99_ms"] for s in samples], label="p99")
    ax2.set_ylabel("latency ms (client-side, per window)")
    ax2.set_xlabel("minutes")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
