#!/usr/bin/env python3
"""Add up the timers of ``bench/phases/sitecustomize.py``: µs of thread CPU per read (``read:``
parts) or per record (``record:`` parts), and calls per read or record, over every process.

    .venv/bin/python bench/phases/summary.py /tmp/phases
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: summary.py DIR (the TOKCACHE_PHASES_DIR of a run)", file=sys.stderr)
        return 2
    spent: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    files = sorted(Path(argv[0]).glob("phases.*.json"))
    for f in files:
        got = json.loads(f.read_text())
        spent.update(got["spent_ns"])
        calls.update(got["calls"])
    per = {"read": calls["read: the client's call, all of it"],
           "record": calls["record: the client's call, all of it"]}
    if not per["read"]:
        print(f"no timed reads in {argv[0]} ({len(files)} files)", file=sys.stderr)
        return 1
    print(f"{len(files)} processes, {per['read']} reads, {per['record']} records "
          "(parts nest: a part includes those under it)")
    print(f"{'part':58s} {'µs each':>8s} {'calls each':>10s}")
    for label in sorted(spent, key=lambda k: (k.split(':')[0], 'all of it' not in k, -spent[k])):
        n = per[label.split(":")[0]] or 1
        print(f"{label:58s} {spent[label] / n / 1000:8.1f} {calls[label] / n:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
