#!/usr/bin/env python3
"""Throughput of P client processes replaying distinct agent conversations, contenders side by side.

Each of P processes (P = 1, 4, 16 by default) replays its own deterministic 40-turn agent
conversations (``conversations.py``, ~57 KB at the last turn; every process and every pass
gets another seed, so no two requests share a conversation) as fast as it can, turn after
turn, and records every request's latency (the prompts are made once, before any client
starts). With ``--conversations N`` every P replays the same N conversations instead, dealt to
its processes in turn, so a round lasts about as long at P = 1 as at P = 16. Each client sets
its contender up, then freezes its start-up heap as vLLM's API server does before serving
(``gc.freeze``; ``--no-gc-freeze``: not), and waits at a barrier.

``--prime-mb N``: once every client waits at the barrier, this process writes N MiB and frees
them before the clock starts. This machine is a VM whose host backs guest memory lazily and
takes back what the guest frees (virtio-balloon free page reporting): a page the guest has not
used lately costs a host fault on its first touch, 31-44 µs against 1.5-1.6 µs for one used a
moment ago (``bench/first_touch.py``, which also says whether a machine does this). A fresh
tokcache client touches ~1 new heap page per request while its memo of the conversations it
served grows (fastokens: none); at P = 16 that showed as 60-69 µs of kernel CPU per request
(``clear_page_erms`` under the fault, by sample share). Measured at P = 16 with 512
conversations: tokcache's kernel CPU per request 69 -> 16-19 µs, its CPU 336 -> 277-279 µs;
fastokens+seg's kernel CPU 1-2 µs either way. A server that has run for a while (its heap
grown), or a host that backs memory up front, has no such cost. Every contender gets the same
priming, and the report says whether it ran and whether the machine reports free pages
(default: off).
Contenders run one after another on the same cores, each with its own fresh server and cache:

- ``fastokens``, ``fastokens+seg``  in-process in every client process (``+seg``: its segment cache)
- ``smg``                           SMG 1.13's ``/v1/tokenize`` (HTTP keep-alive per process)
- ``tokcache``                      the default client: reads the sidecar's shared memory in
                                    each client process and stores what it learned within
                                    the request
- ``tokcache-rpc``                  the client with ``zero_rpc=False``: every request is a
                                    gRPC round trip to one sidecar process
- ``tokcache-ar``                   (opt-in: ``--contenders ...,tokcache-ar``) the default client
                                    recording each turn's output before the next, as vLLM's
                                    plugin does (its RecordOutput: the same text-derived output as
                                    ``multiturn_latency.py --ar``). The records are in the wall time
                                    and the CPU (client and sidecar), not in the latencies

Per contender and P: requests per second over the whole run (all processes started together
at a barrier, until the last one finishes), and p50/p99 latency of every request. Every
``--check``-th request's ids are compared with ``tokenizers``. With ``--rounds N`` every
contender runs N times per P, in alternating order; each is reported by its median run and
each ratio is the median of the N rounds' ratios (a noisy 2-core machine moves one run's
req/s by +-20%; a ratio between neighbouring runs moves less).

Run: ``python bench/concurrency.py`` (``--quick``: P = 1, 4 and fewer turns). Writes
``bench/out/concurrency.{json,png}``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

import conversations  # noqa: E402
from _contenders import ContenderUnavailable, GeneratedOutput, SmgContender, TokcacheContender  # noqa: E402
from _stats import percentile  # noqa: E402
from first_touch import balloon_reporting  # noqa: E402

SEGMENT_CACHE_BYTES = 64 << 20
CONTENDERS = ("fastokens", "fastokens+seg", "smg", "tokcache", "tokcache-rpc")
OPT_IN = ("tokcache-ar",)
BARRIER_TIMEOUT_S = 600  # clients set up (and the parent waits for them) within this


def _client(name: str, tok_dir: Path, target: str, smg_port: int, texts: list[str],
            min_write_bytes: int | None = None) -> Any:
    """A callable text -> list[int] for contender ``name``, built in the child process (``texts``: the
    turns it will replay, for ``tokcache-ar``'s outputs; ``min_write_bytes``: the tokcache client's,
    None for its default)."""
    tj = tok_dir / "tokenizer.json"
    if name.startswith("fastokens"):
        import fastokens

        tok = fastokens.Tokenizer.from_file(str(tj))
        tok.enable_segment_cache(SEGMENT_CACHE_BYTES if name == "fastokens+seg" else 0)
        return lambda text: tok.encode(text, add_special_tokens=False).ids
    if name == "smg":
        import http.client
        import socket

        conn = http.client.HTTPConnection("127.0.0.1", smg_port, timeout=60)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def smg(text: str) -> list[int]:
            conn.request("POST", "/v1/tokenize", body=json.dumps({"model": str(tok_dir), "prompt": text}),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"smg HTTP {resp.status}: {data[:200]!r}")
            return list(json.loads(data)["tokens"])

        return smg
    from sidecar_client import SidecarClient

    more = {} if min_write_bytes is None else {"min_write_bytes": min_write_bytes}
    client = SidecarClient(target, zero_rpc=name != "tokcache-rpc", timeout=60, **more)

    def tc(text: str) -> list[int]:
        return client.tokenize("bench", text=text, add_special_tokens=False).token_ids

    tc.client = client  # type: ignore[attr-defined]
    if name == "tokcache-ar":
        tc.record = _recorder(client, tok_dir, texts)  # type: ignore[attr-defined]
    return tc


def _recorder(client: Any, tok_dir: Path, texts: list[str]) -> Any:
    """record(i, prompt_ids): record the output that took ``texts[i]`` to ``texts[i + 1]``
    (``_contenders.GeneratedOutput``); nothing when that text does not extend it (a rewritten
    history, another conversation). The outputs are derived here, before the clock starts: a
    serving engine has them for free, so their derivation (an encode per turn) is not the
    contender's CPU."""
    outputs = GeneratedOutput(tok_dir).load()
    got = [outputs.between(a, b) for a, b in zip(texts, texts[1:], strict=False)]

    def record(i: int, prompt_ids: list[int]) -> None:
        out = got[i] if i < len(got) else None
        if out is not None:
            client.record_output("bench", prompt_text=texts[i], prompt_token_ids=prompt_ids, output_text=out[0],
                                 output_token_ids=out[1], stop_reason=None)

    return record


def texts_of(index: int, args: argparse.Namespace, render: conversations.Renderer) -> list[str]:
    """The prompts client process ``index`` replays: its ``--passes`` conversations (a seed of
    their own), ``--in-flight`` at a time. The same for every contender and round."""
    seeds = [args.seed + 1000 * index + k for k in range(args.passes)]
    return interleave([conversations.generate(s, render, args.turns, args.target_bytes).texts for s in seeds],
                      args.in_flight)


def interleave(convs: list[list[str]], in_flight: int) -> list[str]:
    """The prompts of ``convs`` (each its prompts, turn after turn) as one process serving
    ``in_flight`` of them at a time sees them: the first ``in_flight`` conversations' first
    turns, then their second turns, ..., then the next ``in_flight``. 1: one conversation
    after another (a client that is one agent); more: an API server behind which that many
    agents run at once, each turn of one coming between two of another's."""
    out: list[str] = []
    for g in range(0, len(convs), in_flight):
        group = convs[g:g + in_flight]
        for t in range(max(len(c) for c in group)):
            out += [c[t] for c in group if t < len(c)]
    return out


def deal(convs: list[list[str]], procs: int, in_flight: int = 1) -> list[list[str]]:
    """``--conversations``: the conversations (each its prompts, turn after turn) dealt to ``procs``
    processes in turn: process ``i`` replays conversations ``i``, ``i + procs``, ...
    (``in_flight`` at a time: :func:`interleave`). So every P replays the same requests, and a
    round lasts about as long at P = 1 as at P = 16."""
    return [interleave(convs[i::procs], in_flight) for i in range(procs)]


def _child(name: str, index: int, args: dict[str, Any], texts: list[str], barrier: Any, out: Any) -> None:
    """One client process: set up its contender, wait at the barrier, replay ``texts``, report."""
    try:
        import tokenizers

        tok_dir = Path(args["tok_dir"])
        ref = tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        fn = _client(name, tok_dir, args["target_addr"], args["smg_port"], texts, args["min_write_bytes"])
        fn("warm-up: hello")  # connect / map / load before the clock starts
        record = getattr(fn, "record", None)
        if args["gc_freeze"]:
            # What vLLM's API server does once it has started (freeze_gc_heap in
            # vllm/entrypoints/launchers/utils/server_utils.py): the start-up heap is moved out
            # of the collector's reach, so its collections traverse only what serving made.
            gc.collect()
            gc.freeze()
        barrier.wait(timeout=BARRIER_TIMEOUT_S)
        lat: list[float] = []
        kept: list[tuple[int, list[int]]] = []
        c0 = time.process_time()  # this process's CPU, every thread's
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t_start = time.time()
        t0 = time.perf_counter()
        for i, text in enumerate(texts):
            s = time.perf_counter_ns()
            ids = fn(text)
            lat.append((time.perf_counter_ns() - s) / 1000)
            if record is not None:
                record(i, ids)
            if args["check"] and i % args["check"] == 0:
                kept.append((i, ids))  # checked after the clock stops
        wall = time.perf_counter() - t0
        t_end = time.time()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        c1 = time.process_time()
        bad = sum(ids != ref.encode(texts[i], add_special_tokens=False).ids for i, ids in kept)
        check_cpu = time.process_time() - c1  # not the contender's
        client = getattr(fn, "client", None)
        stats: dict[str, Any] = {}
        if client is not None:
            client.flush(30)  # the writes these requests left: their CPU is the requests'
            stats = client.stats()
        cpu = time.process_time() - c0 - check_cpu
        if client is not None:
            client.close()
        out.put({"index": index, "lat_us": lat, "wall": wall, "t_start": t_start, "t_end": t_end, "mismatches": bad,
                 "stats": stats, "pid": os.getpid(), "cpu_s": cpu,
                 # The loop's voluntary context switches (every thread of the process): each is a
                 # wait (a lock, the GIL handed to another thread) and, with more processes than
                 # cores, a cold cache when the process runs again.
                 "vol_csw": ru1.ru_nvcsw - ru0.ru_nvcsw,
                 # Minor page faults (a page of the segment, or of the heap, first touched by this
                 # process) and the kernel's share of the CPU: what a shared mapping costs.
                 "minflt": ru1.ru_minflt - ru0.ru_minflt, "sys_s": ru1.ru_stime - ru0.ru_stime,
                 "frozen": gc.get_freeze_count()})
    except BaseException as exc:  # report, never hang the parent
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass
        out.put({"index": index, "error": f"{type(exc).__name__}: {exc}"})


def _proc_cpu_s(server: Any) -> float:
    """CPU seconds (user + system) the server process has used so far; 0 without one.

    Read from the process's CPU-time clock (Linux: ``clock_getcpuclockid``'s id for a pid,
    nanoseconds); ``/proc/<pid>/stat`` counts whole clock ticks (10 ms), which rounds a short
    run's server CPU (``--quick``: a few ms) to 0."""
    proc = getattr(server, "_proc", None)
    if proc is None:
        return 0.0
    try:
        return time.clock_gettime(((~proc.pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:
        pass
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _prime(barrier: Any, procs: int, children: list[Any], mib: int) -> None:
    """``--prime-mb``: once all ``procs`` clients wait at the barrier (or one died), write ``mib``
    MiB and free them, so the pages the clients touch first are ones the machine used a moment
    ago (see the module docstring)."""
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while barrier.n_waiting < procs and all(c.is_alive() for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    block = b"\x01" * (mib << 20)  # written: every page touched
    del block


def run_one(name: str, procs: int, args: argparse.Namespace, tok_dir: Path,
            texts: list[list[str]]) -> dict[str, Any]:
    """Start the contender's server (if any), run ``procs`` clients (client ``i`` replays
    ``texts[i]``), stop the server."""
    server: Any = None
    target, smg_port = "", 0
    try:
        if name == "smg":
            server = SmgContender(tok_dir, args.out_dir)
            server.start()
            smg_port = server.port
        elif name.startswith("tokcache"):
            server = TokcacheContender(tok_dir, args.out_dir, False, zero_rpc=name != "tokcache-rpc", name=name)
            server.start()
            target = server.target
    except ContenderUnavailable as exc:
        if server is not None:
            server.close()
        return {"status": "unavailable", "reason": str(exc)}
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs + 1)
    out = ctx.Queue()
    child_args = {"tok_dir": str(tok_dir), "target_addr": target, "smg_port": smg_port, "check": args.check,
                  "gc_freeze": args.gc_freeze, "min_write_bytes": args.min_write_bytes}
    children = [ctx.Process(target=_child, args=(name, i, child_args, texts[i], barrier, out), daemon=True)
                for i in range(procs)]
    try:
        for c in children:
            c.start()
        if args.prime_mb:
            _prime(barrier, procs, children, args.prime_mb)
        barrier.wait(timeout=BARRIER_TIMEOUT_S)
        server_cpu0 = _proc_cpu_s(server)
        results = [out.get(timeout=1800) for _ in children]
        server_cpu = _proc_cpu_s(server) - server_cpu0
    except Exception as exc:  # noqa: BLE001 - a broken barrier or a dead child: report it
        results = [{"error": f"{type(exc).__name__}: {exc}"}]
        server_cpu = 0.0
    finally:
        for c in children:
            c.join(timeout=30)
            if c.is_alive():
                c.kill()
        if server is not None:
            server.close()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"status": "failed", "reason": errors[0]}
    lat = [x for r in results for x in r["lat_us"]]
    # The run's span as the clients saw it: the parent leaves the barrier with them but may be
    # scheduled after a short run has ended (2 cores, P clients), so its own clock would not do.
    wall = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
    writes, paths = _summed(results, "writes"), _summed(results, "paths")
    client_cpu = sum(r["cpu_s"] for r in results)
    return {"status": "ok", "requests": len(lat), "wall_s": wall, "req_per_s": len(lat) / wall,
            # CPU per request: every client process's (over its loop and the flush of its
            # writes) and the server's (sidecar / SMG) over the run; a node pays both.
            "client_cpu_us_per_req": client_cpu / len(lat) * 1e6,
            "server_cpu_us_per_req": server_cpu / len(lat) * 1e6,
            "p50_us": percentile(lat, 50), "p99_us": percentile(lat, 99),
            "vol_csw_per_req": sum(r["vol_csw"] for r in results) / len(lat),
            "minflt_per_req": sum(r["minflt"] for r in results) / len(lat),
            "client_sys_us_per_req": sum(r["sys_s"] for r in results) / len(lat) * 1e6,
            "mismatches": sum(r["mismatches"] for r in results), "writes": writes,
            # tokcache: reads served by the native fast path and by the Python one.
            "paths": paths,
            # Objects each client's start-up left frozen (the fewest of any client; 0: not frozen).
            "gc_frozen_objects": min(r["frozen"] for r in results),
            "max_us": max(lat), "slowest": sorted(((x, r["index"], i) for r in results
                                                   for i, x in enumerate(r["lat_us"])), reverse=True)[:5],
            "served_by_local": sum((r["stats"].get("tokenize") or {}).get(k, 0)
                                   for r in results for k in ("miss", "l0", "l1", "ar"))}


def _summed(results: list[dict[str, Any]], name: str) -> dict[str, int]:
    """The clients' ``stats()[name]`` counters, summed over every client process."""
    total: collections.Counter[str] = collections.Counter()
    for r in results:
        total.update(r["stats"].get(name) or {})
    return dict(total)


RATIOS = (("tokcache", "fastokens+seg"), ("tokcache", "fastokens"), ("tokcache", "smg"), ("tokcache-rpc", "smg"),
          ("tokcache", "tokcache-rpc"), ("tokcache-ar", "fastokens+seg"), ("tokcache-ar", "smg"),
          ("tokcache-ar", "tokcache"))


def ratios_of(runs: dict[str, Any]) -> dict[str, float]:
    """req/s and CPU-per-request ratios between contenders of one round (RATIOS; those that ran)."""
    def ok(n: str) -> dict[str, Any] | None:
        r = runs.get(n)
        return r if r and r["status"] == "ok" else None

    out: dict[str, float] = {}
    for num, den in RATIOS:
        a, b = ok(num), ok(den)
        if a and b:
            out[f"{num}/{den} req/s"] = a["req_per_s"] / b["req_per_s"]
            ca = a["client_cpu_us_per_req"] + a["server_cpu_us_per_req"]
            cb = b["client_cpu_us_per_req"] + b["server_cpu_us_per_req"]
            if ca and cb:
                out[f"{num}/{den} CPU/req"] = ca / cb
    return out


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run a contender is reported by across rounds: a failed one if any (never hidden),
    else the one with the median req/s (the lower middle of an even count)."""
    for r in runs:
        if r["status"] != "ok":
            return r
    return sorted(runs, key=lambda r: r["req_per_s"])[(len(runs) - 1) // 2]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from sidecar_client._local import MIN_FIRST_WRITE_BYTES, MIN_WRITE_BYTES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default=None, help="client process counts (default 1,4,16; --quick: 1,4)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"subset of {','.join(CONTENDERS + OPT_IN)} (default: all but {','.join(OPT_IN)})")
    ap.add_argument("--passes", type=int, default=2, help="conversations each process replays (default 2)")
    ap.add_argument("--conversations", type=int, default=0,
                    help="instead of --passes: this many conversations at every P, dealt to its processes in "
                         "turn (the same requests at every P; at P = 1 a --passes run's round lasts a tenth of "
                         "a second, which one hiccup of a shared machine moves by tens of percent)")
    ap.add_argument("--in-flight", type=int, default=1,
                    help="conversations each process serves at a time, taking turns (default 1: one after "
                         "another; an API server serves many at once, each turn between others')")
    ap.add_argument("--turns", type=int, default=conversations.DEFAULT_TURNS)
    ap.add_argument("--target-bytes", type=int, default=conversations.DEFAULT_TARGET_BYTES)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--check", type=int, default=10, help="compare every N-th request's ids (0: never)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of every contender per P, in alternating order; each contender is reported by its "
                         "median run and each ratio is the median of the rounds' ratios (default 1)")
    ap.add_argument("--quick", action="store_true", help="P = 1, 4; 1 pass of 12 turns")
    ap.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                    help="leave each client's start-up heap to the garbage collector (default: frozen once the "
                         "client is set up, as vLLM's API server freezes its own before serving)")
    ap.add_argument("--prime-mb", type=int, default=0,
                    help="MiB this process writes and frees once the clients wait at the barrier, before each "
                         "run's clock (default 0: none; see the module docstring)")
    ap.add_argument("--min-write-bytes", type=int, default=None,
                    help=f"the tokcache clients' min_write_bytes (default: the client's, {MIN_WRITE_BYTES}): "
                         "a read whose uncached tail is shorter stores nothing (one that found nothing cached: "
                         f"shorter than this or {MIN_FIRST_WRITE_BYTES}, whichever is less); higher stores less "
                         "often, for processes whose conversations never move to another process")
    ap.add_argument("--tokenizer-dir", type=Path, default=None)
    ap.add_argument("--out-dir", type=Path, default=HERE / "out")
    args = ap.parse_args(argv)
    args.procs = args.procs or ("1,4" if args.quick else "1,4,16")  # an explicit --procs stays
    if args.quick:
        args.passes, args.turns = 1, 12
    args.proc_list = [int(x) for x in args.procs.split(",")]
    args.contender_list = [c for c in args.contenders.split(",") if c]
    unknown = set(args.contender_list) - set(CONTENDERS + OPT_IN)
    if unknown:
        ap.error(f"unknown contenders {sorted(unknown)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.in_flight < 1:
        ap.error("--in-flight must be at least 1")
    if args.prime_mb < 0:
        ap.error("--prime-mb must be 0 or more")
    if args.min_write_bytes is not None and args.min_write_bytes < 0:
        ap.error("--min-write-bytes must be 0 or more")
    if args.conversations < 0 or 0 < args.conversations < max(args.proc_list):
        ap.error("--conversations must be 0 (use --passes) or at least the largest P")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tokcache.sidecar.bundled import qwen3_dir

    tok_dir = (args.tokenizer_dir or qwen3_dir()).resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "benchmark": "concurrency",
        "config": {"procs": args.proc_list, "rounds": args.rounds, "passes": args.passes,
                   "conversations": args.conversations, "turns": args.turns,
                   "target_bytes": args.target_bytes, "tokenizer_dir": str(tok_dir), "seed": args.seed,
                   "gc_freeze": args.gc_freeze, "prime_mb": args.prime_mb, "in_flight": args.in_flight,
                   "min_write_bytes": args.min_write_bytes},
        "environment": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "loadavg_at_start": list(os.getloadavg()),
                        "balloon_free_page_reporting": balloon_reporting()},
        "runs": {}, "ratios": {}, "rounds": {},
    }
    code = 0
    # Every client's prompts, made here once (a client process would spend seconds of the
    # machine's 2 cores loading the chat template for them, per contender and round).
    render = conversations.load_renderer(tok_dir)
    convs = [conversations.generate(args.seed + 1000 * c, render, args.turns, args.target_bytes).texts
             for c in range(args.conversations)]  # --conversations (none: --passes)
    shared = [] if convs else [texts_of(i, args, render) for i in range(max(args.proc_list))]
    for procs in args.proc_list:
        texts = deal(convs, procs, args.in_flight) if convs else shared
        rounds: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            # Alternate the order: a machine that slows down (or warms up) during a round then
            # favours no contender across the rounds.
            order = args.contender_list if rnd % 2 == 0 else args.contender_list[::-1]
            got: dict[str, Any] = {}
            for name in order:
                label = f" (round {rnd + 1}/{args.rounds})" if args.rounds > 1 else ""
                print(f"P={procs:>2} {name}{label} ...", file=sys.stderr, flush=True)
                r = run_one(name, procs, args, tok_dir, texts)
                got[name] = r
                if r["status"] == "ok":
                    print(f"   {r['req_per_s']:8.1f} req/s  p50 {r['p50_us']:8.0f} µs  p99 {r['p99_us']:8.0f} µs"
                          f"  ({r['requests']} requests, {r['mismatches']} mismatches)", file=sys.stderr, flush=True)
                    code |= bool(r["mismatches"])
                else:
                    print(f"   {r['status']}: {r['reason']}", file=sys.stderr, flush=True)
                    code |= r["status"] == "failed"
            rounds.append(got)
        res["runs"][str(procs)] = {name: median_run([g[name] for g in rounds]) for name in args.contender_list}
        per_round = [ratios_of(g) for g in rounds]
        res["ratios"][str(procs)] = {k: statistics.median(r[k] for r in per_round)
                                     for k in per_round[0] if all(k in r for r in per_round)}
        if args.rounds > 1:
            res["rounds"][str(procs)] = {
                "req_per_s": {n: [g[n].get("req_per_s") for g in rounds] for n in args.contender_list},
                "ratios": {k: [r.get(k) for r in per_round] for k in res["ratios"][str(procs)]}}
    path = args.out_dir / "concurrency.json"
    path.write_text(json.dumps(res, indent=1))
    print_report(res)
    png = plot(res, args.out_dir / "concurrency.png")
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    return int(code)


def print_report(res: dict[str, Any]) -> None:
    cfg = res["config"]
    each = (f"{cfg['conversations']} conversations in all" if cfg.get("conversations")
            else f"{cfg['passes']} conversations")
    if cfg.get("in_flight", 1) > 1:
        each += f", {cfg['in_flight']} at a time per process"
    print(f"\n== concurrency: P client processes x {each} x {cfg['turns']} turns "
          f"(~{cfg['target_bytes'] / 1000:.0f} KB at the last turn), {res['environment']['cpus']} CPUs"
          + (f", {cfg['prime_mb']} MiB primed before each run" if cfg.get("prime_mb") else "")
          + (f", tokcache min_write_bytes {cfg['min_write_bytes']}" if cfg.get("min_write_bytes") is not None else "")
          + " ==")
    if res["environment"].get("balloon_free_page_reporting") and not cfg.get("prime_mb"):
        print("(this VM's balloon reports free pages to its host: a page a process touches first costs a host "
              "fault unless the guest used it lately; bench/first_touch.py measures it, --prime-mb models a "
              "node that has run a while)")
    names = sorted({n for runs in res["runs"].values() for n in runs}, key=(CONTENDERS + OPT_IN).index)
    print(f"{'P':>3}  " + "".join(f"{n:>30}" for n in names))
    for procs, runs in res["runs"].items():
        cells = []
        for n in names:
            r = runs.get(n)
            if not r or r["status"] != "ok":
                cells.append(f"{(r or {}).get('status', '-'):>30}")
            else:
                cells.append(f"{r['req_per_s']:>9.0f}/s {r['p50_us']:>7.0f}/{r['p99_us']:>7.0f}µs")
        print(f"{procs:>3}  " + "".join(cells))
    print("  (req/s over the run; p50/p99 latency per request)")
    print("\nCPU per request, client + server (µs; steadier than req/s on a noisy machine)")
    print(f"{'P':>3}  " + "".join(f"{n:>30}" for n in names))
    for procs, runs in res["runs"].items():
        cells = []
        for n in names:
            r = runs.get(n)
            if not r or r["status"] != "ok" or "client_cpu_us_per_req" not in r:
                cells.append(f"{'-':>30}")
            else:
                c, v = r["client_cpu_us_per_req"], r["server_cpu_us_per_req"]
                cells.append(f"{c + v:>12.0f} = {c:>6.0f} + {v:>6.0f}")
        print(f"{procs:>3}  " + "".join(cells))
    print("\nPer request, client processes: voluntary context switches (waits; each a cold cache when P > "
          "cores), minor page faults, kernel CPU (µs, part of the client CPU above)")
    print(f"{'P':>3}  " + "".join(f"{n:>30}" for n in names))
    for procs, runs in res["runs"].items():
        cells = [f"{r['vol_csw_per_req']:>9.2f} csw {r['minflt_per_req']:>6.1f} flt "
                 f"{r['client_sys_us_per_req']:>4.0f} sys"
                 if r and r.get("status") == "ok" and "vol_csw_per_req" in r
                 else f"{'-':>30}" for r in (runs.get(n) for n in names)]
        print(f"{procs:>3}  " + "".join(cells))
    native = [(procs, n, r["paths"]) for procs, runs in res["runs"].items() for n, r in runs.items()
              if r.get("status") == "ok" and r.get("paths")]
    if native:
        print("\nIn-process reads served by the native fast path (the rest: the Python path, same ids, more CPU)")
        for procs, n, paths in native:
            print(f"P={procs} {n}: {paths.get('native', 0)} of {sum(paths.values())}")
    for procs, rs in res["ratios"].items():
        print(f"P={procs}: " + ", ".join(f"{k} {v:.2f}" for k, v in rs.items()))
    if res.get("rounds"):
        print(f"\nEach round's ratios ({res['config']['rounds']} rounds, alternating order; the ones above are "
              "their medians, the runs above each contender's median run)")
        for procs, rd in res["rounds"].items():
            # req/s first (the target's measure), then CPU per request (steadier: see above)
            for k, vs in sorted(rd["ratios"].items(), key=lambda kv: not kv[0].endswith("req/s")):
                print(f"P={procs}: {k} " + " ".join("-" if v is None else f"{v:.2f}" for v in vs))


def plot(res: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    procs = [int(p) for p in res["runs"]]
    names = sorted({n for runs in res["runs"].values() for n in runs}, key=(CONTENDERS + OPT_IN).index)
    for n in names:
        ys = [res["runs"][str(p)].get(n, {}).get("req_per_s") for p in procs]
        xs = [p for p, y in zip(procs, ys, strict=True) if y]
        ax.plot(xs, [y for y in ys if y], marker="o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_xticks(procs, [str(p) for p in procs])
    ax.set_xlabel("client processes")
    ax.set_ylabel("requests per second (all processes)")
    ax.set_title(f"agent chats to ~{res['config']['target_bytes'] / 1000:.0f} KB, {res['environment']['cpus']} CPUs")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
