"""Thread-CPU timers around the parts of a tokcache read and record, in every process.

Loaded by Python at start-up when this directory is on ``PYTHONPATH`` (so in every process a
benchmark spawns), and inert unless ``TOKCACHE_PHASES_DIR`` names a directory: then each
process wraps the functions listed in ``_PARTS`` with ``time.thread_time_ns`` timers and
writes its totals to ``<dir>/phases.<pid>.json`` every 20 reads. A process's first call of
each part (mapping the segment, loading the encoder) is left out. ``bench/phases/summary.py``
adds them up per request. A wrapper costs ~1 µs a call, and the parts nest (a part's time
includes the parts it calls), so the figures say where the time goes, not what a bare read
costs: ``bench/node.py`` without the timers says that.

    PYTHONPATH=bench/phases TOKCACHE_PHASES_DIR=/tmp/phases \\
        .venv/bin/python bench/node.py --contenders tokcache --out-dir /tmp/phases
    .venv/bin/python bench/phases/summary.py /tmp/phases
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

# (module, attribute path, label). The label's first word groups it: read, record, store.
_PARTS = [
    ("sidecar_client._local", "LocalPaths.tokenize", "read: the client's call, all of it"),
    ("tokcache.engine.lookup", "Lookup._extend", "read: the lookup (native fast path or Python)"),
    ("tokcache.engine.lookup", "Lookup._read", "read: a chain read from the segment"),
    ("tokcache.engine.lookup", "Lookup._ar_hit", "read: a recorded output spliced"),
    ("tokcache.engine.lookup", "Lookup._encode_tail", "read: the new tail encoded"),
    ("tokcache.engine.lookup", "Lookup.settle", "read: bookkeeping for the next turn"),
    ("tokcache.engine.ids", "ListFormat.from_stored", "read: ids unpacked from the segment"),
    ("tokcache.engine.ids", "ListFormat.result", "read: the caller's list built"),
    ("sidecar_client._local", "LocalPaths.record", "record: the client's call, all of it"),
    ("tokcache.engine.record", "Recorder.record", "record: the recorder"),
    ("tokcache.engine.record", "verify_output", "record: decode(ids) == text, vocabulary"),
    ("tokcache.engine.record", "Served.matches", "record: prompt ids against what was served"),
    ("tokcache.engine.record", "Recorder._segments", "record: segment keys of the output"),
    ("tokcache.engine.record", "Recorder._put_many", "record: the chain written (lock, records, index)"),
]
_FLUSH_EVERY = 20


def _install(out_dir: str) -> None:
    import importlib

    spent: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    first: set[str] = set()
    path = os.path.join(out_dir, f"phases.{os.getpid()}.json")

    def timed(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        flush = label.startswith("read: the client's")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                if label in first:
                    spent[label] += time.thread_time_ns() - t0
                    calls[label] += 1
                else:  # a process's first call maps the segment and loads the encoder
                    first.add(label)
                if flush and calls[label] % _FLUSH_EVERY == 0:
                    with open(path, "w") as f:
                        json.dump({"spent_ns": spent, "calls": calls}, f)
        return wrapper

    for module, attr, label in _PARTS:
        owner: Any = importlib.import_module(module)
        *outer, name = attr.split(".")
        for part in outer:
            owner = getattr(owner, part)
        setattr(owner, name, timed(getattr(owner, name), label))


if os.environ.get("TOKCACHE_PHASES_DIR"):
    os.makedirs(os.environ["TOKCACHE_PHASES_DIR"], exist_ok=True)
    _install(os.environ["TOKCACHE_PHASES_DIR"])
