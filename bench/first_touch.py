#!/usr/bin/env python3
"""What this machine charges for the first touch of memory: µs per 4 KiB page, GiB by GiB.

``bench/concurrency.py`` found a fresh tokcache client's kernel CPU at P = 16 (60-69 µs per
request) to be page zeroing under first-touch faults, at a cost per page far above what a
page costs to zero. This script measures that cost directly, without tokcache: it maps
``--gib`` GiB of anonymous memory in ``--step-mib`` chunks, keeps every chunk mapped until the
pass ends (so each chunk needs pages the kernel has not handed out yet in this pass), writes one
byte per page and times each chunk; then frees everything and does it again (``--passes``).

On a host that backs its guests' memory up front (bare metal, most cloud VMs) every chunk costs
about the same, ~1-2 µs a page. On a VM whose host backs guest memory lazily and takes back what
the guest frees (virtio-balloon *free page reporting*: the guest tells the host which 2 MiB
blocks are free and the host discards them) a page costs that only while it is one the guest
used a moment ago; any other costs a host fault too. The report says whether this machine's
balloon reports free pages (``/sys/bus/virtio/devices/*/features``, bit 5), and how many chunks
cost more than ``SLOW_US_PER_PAGE``.

Why it matters for the benchmarks: fastokens allocates nothing in steady state; a fresh
tokcache client grows its memo of the conversations it served by ~1 page per request, so on
such a VM it pays a host fault per request that a server which has run a while (its heap
grown, its pages reused) does not. ``bench/concurrency.py --prime-mb`` models that server.

    .venv/bin/python bench/first_touch.py              # 8 GiB x 2 passes, ~1-5 min
    .venv/bin/python bench/first_touch.py --quick      # 2 x 64 MiB (tests)

Writes ``first_touch.json`` and ``first_touch.png`` under ``--out-dir``. The memory asked for
must fit in MemAvailable with a margin (an error says so otherwise).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plot import pyplot  # noqa: E402

__all__ = ["SLOW_US_PER_PAGE", "balloon_reporting", "main", "touch_chunk"]

PAGE = mmap.PAGESIZE
# A chunk slower than this per page paid more than zeroing it (~1-2 µs here for recently used
# pages, Python's loop included): a host fault, on a lazily backed VM.
SLOW_US_PER_PAGE = 5.0
_REPORTING_BIT = 5  # VIRTIO_BALLOON_F_REPORTING (virtio spec 1.2, 5.5.3)
_BALLOON_DEVICE_ID = 5
_HEADROOM = 0.8  # of MemAvailable, at most


def balloon_reporting(root: Path = Path("/sys/bus/virtio/devices")) -> bool | None:
    """Whether a virtio balloon on this machine reports free pages to its host (True/False);
    None: no virtio balloon (bare metal, another hypervisor, or no sysfs)."""
    try:
        devices = sorted(root.iterdir())
    except OSError:
        return None
    for dev in devices:
        try:
            if int((dev / "device").read_text().strip(), 16) != _BALLOON_DEVICE_ID:
                continue
            bits = (dev / "features").read_text().strip()
        except (OSError, ValueError):
            continue
        return len(bits) > _REPORTING_BIT and bits[_REPORTING_BIT] == "1"  # bit i is character i
    return None


def _mem_available() -> int | None:
    """MemAvailable in bytes, or None where /proc/meminfo has none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def touch_chunk(nbytes: int) -> tuple[mmap.mmap, float]:
    """Map ``nbytes`` of fresh anonymous memory, write one byte per page; the mapping (still
    mapped: the caller closes it) and the µs per page the writes took."""
    m = mmap.mmap(-1, nbytes)
    t0 = time.perf_counter_ns()
    for off in range(0, nbytes, PAGE):
        m[off] = 1
    return m, (time.perf_counter_ns() - t0) / 1000 / (nbytes // PAGE)


def _baseline_us() -> float:
    """µs per page of the same loop over pages already touched (Python's share of a chunk)."""
    n = 16 << 20
    m = mmap.mmap(-1, n)
    try:
        for off in range(0, n, PAGE):
            m[off] = 1
        t0 = time.perf_counter_ns()
        for off in range(0, n, PAGE):
            m[off] = 2
        return (time.perf_counter_ns() - t0) / 1000 / (n // PAGE)
    finally:
        m.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The passes; the result JSON."""
    step = args.step_mib << 20
    chunks = max(1, (args.gib << 30) // step) if not args.quick else 1
    total = chunks * step
    avail = _mem_available()
    if avail is not None and total > avail * _HEADROOM:
        raise SystemExit(f"first_touch: {total >> 20} MiB asked, {avail >> 20} MiB available; "
                         f"at most {int(avail * _HEADROOM) >> 20} MiB (use --gib / --step-mib)")
    reporting = balloon_reporting()
    base = _baseline_us()
    passes: list[list[float]] = []
    for p in range(args.passes):
        held: list[mmap.mmap] = []
        row: list[float] = []
        try:
            for i in range(chunks):
                m, us = touch_chunk(step)
                held.append(m)
                row.append(round(us, 2))
                print(f"\rpass {p + 1}/{args.passes}: {(i + 1) * args.step_mib} MiB, last chunk {us:.2f} µs/page",
                      end="", file=sys.stderr, flush=True)
        finally:
            for m in held:
                m.close()
        print(file=sys.stderr)
        passes.append(row)
    every = [us for row in passes for us in row]
    return {
        "config": {"gib": args.gib, "step_mib": args.step_mib, "passes": args.passes, "chunks": chunks,
                   "quick": args.quick},
        "environment": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                        "mem_available_mib": None if avail is None else avail >> 20,
                        "balloon_free_page_reporting": reporting},
        "page_bytes": PAGE,
        "baseline_us_per_page": round(base, 3),
        "us_per_page": passes,
        "slow_threshold_us": SLOW_US_PER_PAGE,
        "slow_chunks": sum(us > SLOW_US_PER_PAGE for us in every),
        "median_us_per_page": round(statistics.median(every), 2),
        "max_us_per_page": max(every),
    }


def print_report(r: dict[str, Any]) -> None:
    cfg, env = r["config"], r["environment"]
    rep = env["balloon_free_page_reporting"]
    print(f"\n== first touch: {cfg['chunks']} x {cfg['step_mib']} MiB per pass, {cfg['passes']} passes, "
          f"{env['cpus']} CPUs ==")
    print("virtio balloon: " + ("none" if rep is None else "reports free pages to the host" if rep
                                else "present, does not report free pages"))
    print(f"the loop alone over touched pages: {r['baseline_us_per_page']:.2f} µs/page")
    for i, row in enumerate(r["us_per_page"]):
        print(f"pass {i + 1}: µs/page by chunk: " + " ".join(f"{us:.1f}" for us in row))
    n = sum(len(row) for row in r["us_per_page"])
    print(f"median {r['median_us_per_page']:.2f} µs/page, max {r['max_us_per_page']:.2f}; "
          f"{r['slow_chunks']}/{n} chunks above {r['slow_threshold_us']:.0f} µs/page"
          + (" (first touch costs a host fault there: memory the guest has not used lately)"
             if r["slow_chunks"] else ""))


def plot(r: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    step = r["config"]["step_mib"]
    for i, row in enumerate(r["us_per_page"]):
        ax.plot([(k + 1) * step / 1024 for k in range(len(row))], row, marker="o", label=f"pass {i + 1}")
    ax.axhline(r["slow_threshold_us"], color="grey", linestyle=":", label="slow threshold")
    ax.set_xlabel("GiB mapped in this pass")
    ax.set_ylabel("µs per first-touched 4 KiB page")
    rep = r["environment"]["balloon_free_page_reporting"]
    ax.set_title("first touch of memory" + (" (balloon reports free pages)" if rep else ""))
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gib", type=int, default=8, help="GiB touched per pass (default 8)")
    ap.add_argument("--step-mib", type=int, default=1024, help="chunk size in MiB (default 1024)")
    ap.add_argument("--passes", type=int, default=2, help="passes, each after the last freed all (default 2)")
    ap.add_argument("--quick", action="store_true", help="one 64 MiB chunk per pass (for tests)")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.step_mib = 64
    if args.gib < 1 or args.step_mib < 1 or args.passes < 1:
        ap.error("--gib, --step-mib and --passes must be at least 1")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    r = run(args)
    path = args.out_dir / "first_touch.json"
    path.write_text(json.dumps(r, indent=1))
    print_report(r)
    png = plot(r, args.out_dir / "first_touch.png")
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
