"""Child process for the real-cgroup pressure test and demo.

    python -m tests.stress.pressure_child CGROUP_PROCS PREFIX SIZE [WRITE_MIB_PER_S]

Moves itself into the cgroup (before touching any segment page, so the tmpfs pages are
charged there), opens a segment, fills it, then keeps writing records while a
PressureMonitor with the real SignalReader (interval 0.1 s, calm 1 s) watches its own
cgroup. Prints one JSON line per 0.1 s: time, state, used bytes, soft cap, resident
bytes, pressure evictions. Exits when stdin closes (or after 300 s).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid


def main() -> int:
    procs, prefix, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rate = float(sys.argv[4]) if len(sys.argv) > 4 else 8.0
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
    from tokcache.sidecar.pressure import PressureMonitor, PressurePolicy, SignalReader
    from tokcache.store import Kind, Store

    store = Store.open(prefix=prefix, fingerprint=uuid.uuid4().hex, size=size)
    reader = SignalReader()
    monitor = PressureMonitor(lambda: [store], PressurePolicy(interval=0.1, calm_seconds=1.0, grow_step=0.25),
                              read=reader)
    done = threading.Event()

    def wait_stdin() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=wait_stdin, daemon=True).start()
    ids = os.urandom(2048)
    i = 0
    # Fill the arena once, then start watching.
    while store.used_bytes < store.arena_bytes * 0.95:
        store.put(None, 0, ids, [((i + 1).to_bytes(16, "little"), 512)], Kind.L1)
        i += 1
    print(json.dumps({"filled": True, "sources": reader.sources}), flush=True)
    monitor.start()
    started = time.monotonic()
    next_print = started
    per_tick = max(1, int(rate * (1 << 20) / 2048 / 100))  # records per 10 ms
    try:
        while not done.is_set() and time.monotonic() - started < 300:
            for _ in range(per_tick):
                store.put(None, 0, ids, [((i + 1).to_bytes(16, "little"), 512)], Kind.L1)
                i += 1
            now = time.monotonic()
            if now >= next_print:
                stats = store.stats()
                sig = monitor.last
                print(json.dumps({
                    "t": round(now - started, 3), "state": monitor.state.value, "used": stats.used_bytes,
                    "soft_cap": stats.soft_cap, "resident": stats.resident_bytes,
                    "pressure_evictions": stats.pressure_evictions, "cgroup_ratio": sig.cgroup_ratio,
                }), flush=True)
                next_print = now + 0.1
            time.sleep(0.01)
    finally:
        monitor.stop()
        store.unlink()
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
