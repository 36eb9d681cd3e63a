"""Memory pressure, end to end: a real sidecar in a real memory cgroup whose limit is lowered, then lifted.

    python bench/pressure_demo.py [--shm-size 64MiB] [--out bench/out]

1. Create a memory cgroup (v2 if its memory controller is available to children, else
   v1) and start ``tokcache-sidecar serve --pressure-interval 0.5`` inside it (the shell
   joins the cgroup before exec, so the sidecar and the tmpfs pages it touches are
   charged there).
2. Fill the cache with Tokenize load (loopback unix socket) until the segment is full.
3. Lower the limit so the cgroup's working set is at 93 % of it (threshold 90 %): the
   monitor shrinks the cache to 25 % of its arena and gives the pages back; load goes on.
4. Lift the limit: after 30 s of calm the soft cap grows back in steps and the load
   refills the cache.

Samples every 0.5 s (cgroup usage and limit, segment used/allocated/soft cap, RSS) go to
``pressure_demo.json`` and ``pressure_demo.png``. Where no memory cgroup can be created,
the same phases run on a store in this process with simulated signals (said in the
output). Bounded (~2 minutes); removes the cgroup and the segment at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import signal
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

from tests.stress import cgroup  # noqa: E402
from tests.stress.harness import SidecarProc, channel, rss, stub, unlink_prefix  # noqa: E402
from tokcache.sidecar.config import parse_size  # noqa: E402
from tokcache.store import read_stats  # noqa: E402
from tokcache.v1 import tokenizer_pb2 as pb  # noqa: E402

WORDS = "alpha beta gamma delta token cache page kernel 你好 émigré 42 3.14 def return ( ) \n".split(" ")


def _loader(address: str, stop: threading.Event, seed: int, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    i = 0
    with channel(address) as ch:
        s = stub(ch)
        while not stop.is_set():
            text = f"doc {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(1500))
            i += 1
            try:
                s.Tokenize(pb.TokenizeRequest(model="qwen3", text=text), timeout=30)
                counts["ok"] += 1
            except grpc.RpcError:
                counts["errors"] += 1
                time.sleep(0.05)


def run_cgroup(args: argparse.Namespace) -> dict[str, Any]:
    cap = parse_size(args.shm_size)
    cg = cgroup.MemoryCgroup.create()
    prefix = f"tkpressure-{uuid.uuid4().hex[:8]}"
    samples: list[dict[str, Any]] = []
    events: list[tuple[float, str]] = []
    stop = threading.Event()
    counts = {"ok": 0, "errors": 0}
    with tempfile.TemporaryDirectory(prefix="tokcache-pressure-") as tmp:
        proc = SidecarProc(Path(tmp), prefix, "--pressure-interval", "0.5", shm_size=args.shm_size)
        inner = " ".join(shlex.quote(c) for c in proc.cmd)
        proc.cmd = ["sh", "-c", f"echo $$ > {shlex.quote(str(cg.procs_file))} && exec {inner}"]
        t0 = time.monotonic()

        def sample(phase: str) -> dict[str, Any]:
            seg = (read_stats(prefix) or [{}])[0]
            row = {
                "t": round(time.monotonic() - t0, 2), "phase": phase, "cgroup_usage": cg.usage,
                "cgroup_limit": cg.limit, "used": seg.get("used_bytes", 0), "soft_cap": seg.get("soft_cap", 0),
                "segment_allocated": seg.get("resident_bytes", 0),
                "pressure_evictions": seg.get("pressure_evictions", 0),
                "rss": rss(proc.pid) if proc.proc else 0, "requests": counts["ok"], "errors": counts["errors"],
            }
            samples.append(row)
            return row

        def watch(phase: str, seconds: float, until: Any = None) -> dict[str, Any]:
            end = time.monotonic() + seconds
            row = sample(phase)
            while time.monotonic() < end and not (until is not None and until(row)):
                time.sleep(0.5)
                row = sample(phase)
            return row

        loaders: list[threading.Thread] = []
        try:
            proc.start(timeout=180)
            events.append((time.monotonic() - t0, "sidecar ready (in the cgroup)"))
            loaders = [threading.Thread(target=_loader, args=(proc.address, stop, k, counts), daemon=True)
                       for k in range(args.clients)]
            for t in loaders:
                t.start()
            arena = (read_stats(prefix) or [{}])[0].get("arena_bytes", cap)
            full = watch("fill", 120, lambda r: r["used"] >= 0.9 * arena)
            baseline = watch("full", 5)
            working = cg.usage - cg.stat("total_inactive_file" if cg.version == 1 else "inactive_file")
            limit = int(working / 0.93)
            cg.set_limit(limit)
            events.append((time.monotonic() - t0, f"limit lowered to {limit / 2**20:.0f} MiB"))
            lowered_at = time.monotonic()
            shrunk = watch("pressure", 20, lambda r: r["segment_allocated"] < cap / 2)
            shrink_seconds = time.monotonic() - lowered_at
            held = watch("pressure", 15)
            cg.set_limit(None)
            events.append((time.monotonic() - t0, "limit lifted"))
            lifted_at = time.monotonic()
            grown = watch("recovery", 90, lambda r: r["soft_cap"] >= arena and r["used"] >= 0.9 * arena)
            recover_seconds = time.monotonic() - lifted_at
            stop.set()
            for t in loaders:
                t.join(40)
            code = proc.stop()
        finally:
            stop.set()
            proc.kill()
            cg.remove()
            unlink_prefix(prefix)
    return {
        "mode": f"real cgroup v{cg.version} ({cg.path})",
        "cap": cap,
        "arena": arena,
        "full": full, "baseline": baseline, "shrunk": shrunk, "held": held, "grown": grown,
        "limit": limit,
        "seconds_to_shrink": shrink_seconds,
        "seconds_to_recover_after_lift": recover_seconds,
        "cgroup_usage_drop": baseline["cgroup_usage"] - shrunk["cgroup_usage"],
        "max_ratio_under_lowered_limit": max(
            (s["cgroup_usage"] / s["cgroup_limit"] for s in samples if s["phase"] == "pressure" and s["cgroup_limit"]),
            default=0.0),
        "requests": counts["ok"], "errors": counts["errors"], "exit_code": code,
        "events": events, "samples": samples,
    }


def run_simulated(args: argparse.Namespace) -> dict[str, Any]:
    """The same phases on an in-process store, signals simulated (no cgroup available)."""
    from tokcache.sidecar.pressure import PressureMonitor, PressurePolicy, Signals
    from tokcache.store import Kind, Store

    cap = parse_size(args.shm_size)
    prefix = f"tkpressure-{uuid.uuid4().hex[:8]}"
    store = Store.open(prefix=prefix, fingerprint=uuid.uuid4().hex, size=cap)
    limit = {"usage": 0.5}
    monitor = PressureMonitor(lambda: [store], PressurePolicy(calm_seconds=5.0),
                              read=lambda: Signals(cgroup_usage=int(limit["usage"] * (1 << 30)),
                                                   cgroup_limit=1 << 30))
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    i = 0
    try:
        for phase, seconds, usage in (("fill", 5, 0.5), ("pressure", 10, 0.95), ("pressure", 5, 0.85),
                                      ("recovery", 20, 0.5)):
            limit["usage"] = usage
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                for _ in range(200):
                    i += 1
                    store.put(None, 0, i.to_bytes(4, "little") * 256, [(i.to_bytes(16, "little"), 256)], Kind.L1)
                monitor.step()
                st = store.stats()
                samples.append({"t": round(time.monotonic() - t0, 2), "phase": phase, "signal_ratio": usage,
                                "used": st.used_bytes, "soft_cap": st.soft_cap,
                                "segment_allocated": st.resident_bytes, "state": monitor.state.value})
                time.sleep(0.25)
    finally:
        store.unlink()
        store.close()
    return {"mode": "SIMULATED signals (no memory cgroup could be created here)", "cap": cap, "samples": samples}


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = [r["t"] for r in s]
    mib = 2**20
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.plot(t, [r["used"] / mib for r in s], label="segment live log (used)")
    ax.plot(t, [r["segment_allocated"] / mib for r in s], label="segment pages in tmpfs")
    ax.plot(t, [r["soft_cap"] / mib for r in s], linestyle=":", label="soft cap")
    if "cgroup_usage" in s[0]:
        ax2 = ax.twinx()
        ax2.plot(t, [r["cgroup_usage"] / mib for r in s], color="black", linewidth=1, label="cgroup usage")
        ax2.plot(t, [(r["cgroup_limit"] or float("nan")) / mib for r in s], color="red", linestyle="--",
                 label="cgroup limit")
        ax2.set_ylabel("cgroup MiB")
        ax2.legend(loc="lower right", fontsize=8)
        for when, what in result.get("events", []):
            ax.axvline(when, color="grey", linewidth=0.5)
            ax.text(when, ax.get_ylim()[1] * 0.95, what, rotation=90, fontsize=7, va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("segment MiB")
    ax.set_title(f"memory pressure: {result['mode']}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _exit_on_sigterm(*_: object) -> None:
    raise SystemExit(143)  # unwinds through the finally blocks that stop the sidecar


def main() -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shm-size", default="64MiB")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--simulate", action="store_true", help="force simulated signals")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = ap.parse_args()
    real = not args.simulate and cgroup.available()
    if not real:
        print("no memory cgroup can be created here: SIMULATING the signals", flush=True)
    result = run_cgroup(args) if real else run_simulated(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pressure_demo.json").write_text(json.dumps(result, indent=2))
    _plot(result, args.out / "pressure_demo.png")
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
