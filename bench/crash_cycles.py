"""Crash test: SIGKILL a real sidecar at random moments under concurrent load, >= 200 cycles.

    python bench/crash_cycles.py [--cycles 200] [--threads 6] [--shm-size 1MiB] [--out bench/out]

Each cycle starts ``tokcache-sidecar serve`` on the surviving segment, checks warm hits
(texts answered in the previous life come back from the cache with the same ids), puts
concurrent text/chat/RecordOutput load on it over real gRPC, and SIGKILLs it after a
random delay (10 % of cycles while it is still starting). Every answer is compared with
HF tokenizers / transformers. Writes ``crash_cycles.json``: wrong answers, errors, warm
hits, kills that caught the writer lock, lock recoveries, /dev/shm objects and bytes.
Loopback only (a unix socket); bounded by ``--cycles``; leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.stress.crash import run_crash_cycles  # noqa: E402
from tests.stress.harness import Workload, unlink_prefix  # noqa: E402


def _exit_on_sigterm(*_: object) -> None:
    raise SystemExit(143)  # unwinds through the finally blocks that stop the sidecar


def main() -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--threads", type=int, default=6)
    ap.add_argument("--shm-size", default="1MiB")
    ap.add_argument("--conversations", type=int, default=80)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = ap.parse_args()
    prefix = f"tkcrash-{uuid.uuid4().hex[:8]}"
    workload = Workload(conversations=args.conversations, turns=8, words=(30, 150)).build()
    print(f"workload: {len(workload.items)} items, {workload.text_bytes / 1e6:.1f} MB of text; "
          f"cap {args.shm_size}", flush=True)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="tokcache-crash-") as tmp:
        try:
            report = run_crash_cycles(Path(tmp), prefix, cycles=args.cycles, threads=args.threads,
                                      shm_size=args.shm_size, workload=workload, seed=args.seed,
                                      log=lambda line: print(line, flush=True))
        finally:
            unlink_prefix(prefix)
    out = report.as_dict()
    out["started"] = started
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "crash_cycles.json"
    path.write_text(json.dumps(out, indent=2))
    summary = {k: v for k, v in out.items() if k not in ("per_cycle", "final_stats")}
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    ok = (report.wrong_answers == 0 and report.shm_max_objects == 2
          and report.cycles_with_warm_hit == report.cycles_warm_checked)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
