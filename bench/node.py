#!/usr/bin/env python3
"""A node as vLLM runs one: P API-server processes, agent conversations moving between them,
paced turns, every output recorded. Contenders side by side; ratios against fastokens with its
segment cache.

The workload. C agent conversations (``conversations.py``: Qwen3 chat template, tool loops,
~``--target-bytes`` at the last of ``--turns`` turns). Turn ``t`` of conversation ``c`` is served
by process ``(c + t) % P`` (``--placement move``: a conversation's turns move between the API
servers, as behind a load balancer) or ``c % P`` (``stay``). A turn is a request: its prompt text is
tokenized; ``--gen-s`` later (the model generates) the same process records the output, the
answer the model gave, as vLLM's plugin does; the conversation's next turn comes ``--gap`` seconds
(uniform in the range) after that. The outputs carry model-like ids (``ar_emulator.py``: the
canonical ids with ``--rate`` of the tokens re-segmented, then the end-of-turn id), so a
re-encoding of the answer mostly differs from what the model generated. While one conversation
waits, the others' turns run: every process serves many conversations at once.

What is charged. Each contender runs in P fresh processes (and its own fresh server, if it has
one). CPU per request is every thread of every client process, from the start to the end of the
run (a final flush of anything a client keeps for later included), plus the server's (the
tokcache sidecar, SMG), over all requests. Nothing a contender does is left out of its time or
done for it outside. What the benchmark itself does in the client processes (receiving the work,
checking the ids) is measured per thread and taken out, for every contender alike.

What is reported, per contender: CPU per request; p50/p99 of the tokenize call; p50/p99 of the
record call (contenders that can record: tokcache, over shared memory or gRPC); exact extension:
of the turns whose text continues the previous turn's prompt + output (a template that rewrites
history makes the rest), how many got ids that start with the previous turn's prompt ids + output
ids, which is what vLLM's prefix cache needs to reuse the KV it holds; and ids that do not decode
to their text (every ``--check``-th request; must be 0).

Contenders:

- ``tokcache``        the default client (``SidecarClient``): reads and records in the process,
                      from and into the sidecar's shared memory
- ``tokcache-rpc``    the client with ``zero_rpc=False``: ``Tokenize`` and ``RecordOutput`` over gRPC
- ``fastokens+seg``   fastokens in every process with its segment cache (64 MiB): what
                      ``VLLM_USE_FASTOKENS=1`` gives vLLM; nothing shared, nothing recorded
- ``fastokens``       the same without the segment cache
- ``tokenizers``      HF ``tokenizers``: what vLLM does by default
- ``smg``             SMG 1.13's ``/v1/tokenize`` (HTTP keep-alive per process), its L0 + L1 cache

Run: ``python bench/node.py`` (P = 4, 32 conversations of 16 turns, 57 KB, all contenders).
``--procs 4,16 --target-bytes 57000,400000`` runs every combination. Writes
``bench/out/node.json``. Exit status 1 if ids failed a check.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import heapq
import json
import multiprocessing as mp
import os
import pickle
import platform
import random
import resource
import statistics
import sys
import time
from array import array
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

import conversations  # noqa: E402
from _contenders import TOKCACHE_MODEL, ContenderUnavailable, SmgContender, TokcacheContender  # noqa: E402
from _stats import percentile, proc_cpu_s  # noqa: E402

CONTENDERS = ("tokcache", "fastokens+seg", "fastokens", "tokenizers", "smg", "tokcache-rpc")
RECORDING = ("tokcache", "tokcache-rpc")
REFERENCE = "fastokens+seg"
SEGMENT_CACHE_BYTES = 64 << 20
BARRIER_TIMEOUT_S = 600


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: its prompt, and the output the model generated for it."""

    text: str
    output: str | None  # None: the last turn (nothing generated after it is used)
    output_ids: list[int] | None
    # The next turn's text continues text + output: its ids can extend this turn's prompt + output.
    continued: bool


def make_workload(args: argparse.Namespace, tok_dir: Path, target_bytes: int) -> list[list[Turn]]:
    """The conversations (each its turns), made once per size and kept under ``--out-dir``."""
    key = hashlib.sha256(repr((args.conversations, args.turns, target_bytes, args.seed, args.rate,
                               str(tok_dir), 1)).encode()).hexdigest()[:16]
    cache = args.out_dir / "node-workloads" / f"{key}.pkl"
    if cache.exists():
        with open(cache, "rb") as f:
            got: list[list[Turn]] = pickle.load(f)
        return got
    from ar_emulator import AREmulator

    print(f"making {args.conversations} conversations of {args.turns} turns to ~{target_bytes // 1000} KB ...",
          file=sys.stderr, flush=True)
    render = conversations.load_renderer(tok_dir)
    emu = AREmulator.from_file(tok_dir)
    emu.eos_id = emu.tok.token_to_id(conversations.END_OF_TURN)
    convs: list[list[Turn]] = []
    for c in range(args.conversations):
        conv = conversations.generate(args.seed + 1000 * c, render, args.turns, target_bytes)
        turns = []
        for t in range(1, len(conv.texts) + 1):
            out = conv.output_of(t, render)
            ids = emu.emulate(out, args.rate, seed=(c, t)).ids if out else None
            nxt = conv.texts[t] if t < len(conv.texts) else None
            turns.append(Turn(conv.texts[t - 1], out, ids,
                              nxt is not None and out is not None and nxt.startswith(conv.texts[t - 1] + out)))
        convs.append(turns)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache, "wb") as f:
        pickle.dump(convs, f)
    return convs


def server_of(c: int, t: int, procs: int, placement: str) -> int:
    """The process that serves turn ``t`` (0-based) of conversation ``c``."""
    return (c + t) % procs if placement == "move" else c % procs


# -- the client processes ---------------------------------------------------------------------


class _Client:
    """A contender inside one client process: ``tokenize`` (text -> ids) and, for those that can,
    ``record`` (what vLLM's plugin calls once the output is complete)."""

    def __init__(self, name: str, tok_dir: Path, target: str, smg_port: int) -> None:
        self.name = name
        self.client: Any = None
        self.can_record = name in RECORDING
        tj = str(tok_dir / "tokenizer.json")
        if name.startswith("fastokens"):
            import fastokens

            tok = fastokens.Tokenizer.from_file(tj)
            tok.enable_segment_cache(SEGMENT_CACHE_BYTES if name == "fastokens+seg" else 0)
            self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
        elif name == "tokenizers":
            import tokenizers

            ref = tokenizers.Tokenizer.from_file(tj)
            self._encode = lambda text: ref.encode(text, add_special_tokens=False).ids
        elif name == "smg":
            import http.client
            import socket

            conn = http.client.HTTPConnection("127.0.0.1", smg_port, timeout=120)
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

            self._encode = smg
        else:
            from sidecar_client import SidecarClient

            self.client = SidecarClient(target, zero_rpc=name != "tokcache-rpc", timeout=60)

    def tokenize(self, text: str) -> list[int]:
        if self.client is not None:
            ids: list[int] = self.client.tokenize(TOKCACHE_MODEL, text=text, add_special_tokens=False).token_ids
            return ids
        return self._encode(text)  # type: ignore[no-any-return]

    def record(self, text: str, ids: list[int], output: str, output_ids: list[int]) -> None:
        self.client.record_output(TOKCACHE_MODEL, prompt_text=text, prompt_token_ids=ids, output_text=output,
                                  output_token_ids=output_ids, finish_reason="stop")

    def finish(self) -> dict[str, Any]:
        """Anything the client keeps for later, done now (its CPU is the run's); its counters."""
        if self.client is None:
            return {}
        self.client.flush(30)
        return dict(self.client.stats())

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def _digest(ids: list[int], n: int) -> bytes:
    return hashlib.blake2b(array("I", ids[:n]).tobytes(), digest_size=16).digest()


def _child(name: str, index: int, cfg: dict[str, Any], items_path: str, conn: Connection, barrier: Any) -> None:
    """One API-server process: set up the contender, then serve what the dispatcher sends."""
    try:
        import tokenizers

        with open(items_path, "rb") as f:
            items: dict[tuple[int, int], Turn] = pickle.load(f)
        tok_dir = Path(cfg["tok_dir"])
        ref = tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        client = _Client(name, tok_dir, cfg["target"], cfg["smg_port"])
        client.tokenize("warm-up: hello")  # connect / map / load before the clock starts
        if cfg["gc_freeze"]:
            gc.collect()
            gc.freeze()  # as vLLM's API server does once it has started
        served: dict[tuple[int, int], list[int]] = {}
        tok_us: list[float] = []
        rec_us: list[float] = []
        bench_cpu = 0.0  # the benchmark's own work in this process (receiving, checking): not charged
        bad = 0
        barrier.wait(timeout=BARRIER_TIMEOUT_S)
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        c0 = time.process_time()
        while True:
            b0 = time.thread_time()
            msg = conn.recv()
            bench_cpu += time.thread_time() - b0
            if msg[0] == "stop":
                break
            op, c, t = msg[0], msg[1], msg[2]
            turn = items[(c, t)]
            if op == "tok":
                s = time.perf_counter_ns()
                ids = client.tokenize(turn.text)
                tok_us.append((time.perf_counter_ns() - s) / 1000)
                b0 = time.thread_time()
                prev_n = msg[3]
                reply: list[Any] = ["tok", c, t, index, _digest(ids, prev_n) if prev_n else None]
                if turn.continued and turn.output_ids is not None:
                    ext = ids + turn.output_ids
                    reply += [len(ext), _digest(ext, len(ext))]
                else:
                    reply += [0, None]
                if cfg["check"] and len(tok_us) % cfg["check"] == 1 and \
                        ref.decode(list(ids), skip_special_tokens=False) != turn.text:
                    bad += 1
                if client.can_record and turn.output is not None:
                    served[(c, t)] = ids
                conn.send(reply)
                bench_cpu += time.thread_time() - b0
            else:  # "rec": the model finished the answer to that prompt
                ids = served.pop((c, t), None)
                if ids is not None and turn.output is not None and turn.output_ids is not None:
                    s = time.perf_counter_ns()
                    client.record(turn.text, ids, turn.output, turn.output_ids)
                    rec_us.append((time.perf_counter_ns() - s) / 1000)
                b0 = time.thread_time()
                conn.send(["rec", c, t, index])
                bench_cpu += time.thread_time() - b0
        stats = client.finish()
        cpu = time.process_time() - c0 - bench_cpu
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        client.close()
        # Where a process's CPU goes besides its own instructions: page faults (a page first
        # touched), kernel time, and waits (each a cold cache when processes outnumber cores).
        conn.send(["done", {"index": index, "tok_us": tok_us, "rec_us": rec_us, "cpu_s": cpu, "bad": bad,
                            "stats": stats, "minflt": ru1.ru_minflt - ru0.ru_minflt,
                            "sys_s": ru1.ru_stime - ru0.ru_stime, "vol_csw": ru1.ru_nvcsw - ru0.ru_nvcsw}])
    except BaseException as exc:  # report, never hang the dispatcher
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass
        try:
            conn.send(["error", f"{type(exc).__name__}: {exc}"])
        except Exception:  # noqa: BLE001
            pass


# -- the dispatcher ---------------------------------------------------------------------------


def run_one(name: str, procs: int, convs: list[list[Turn]], args: argparse.Namespace, tok_dir: Path,
            run_seed: int) -> dict[str, Any]:
    """One contender on one node shape: start its server, P clients, dispatch every turn, stop."""
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
            server.close_client()  # the dispatcher is no API server: only the children's clients count
    except ContenderUnavailable as exc:
        if server is not None:
            server.close()
        return {"status": "unavailable", "reason": str(exc)}
    work = args.out_dir / "node-work"
    work.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(procs):
        mine = {(c, t): turn for c, turns in enumerate(convs) for t, turn in enumerate(turns)
                if server_of(c, t, procs, args.placement) == i}
        path = work / f"{os.getpid()}-{i}.pkl"
        with open(path, "wb") as f:
            pickle.dump(mine, f)
        paths.append(path)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs + 1)
    cfg = {"tok_dir": str(tok_dir), "target": target, "smg_port": smg_port, "gc_freeze": args.gc_freeze,
           "check": args.check}
    pipes = [ctx.Pipe() for _ in range(procs)]
    children = [ctx.Process(target=_child, args=(name, i, cfg, str(paths[i]), pipes[i][1], barrier), daemon=True)
                for i in range(procs)]
    conns = [p[0] for p in pipes]
    results: list[dict[str, Any]] = []
    error = ""
    try:
        for ch in children:
            ch.start()
        barrier.wait(timeout=BARRIER_TIMEOUT_S)
        server_cpu0 = proc_cpu_s(server)
        wall0 = time.monotonic()
        ext = _dispatch(convs, procs, conns, args, random.Random(run_seed))
        for cn in conns:
            cn.send(["stop"])
        for cn in conns:
            msg = cn.recv()
            if msg[0] == "error":
                raise RuntimeError(msg[1])
            results.append(msg[1])
        wall = time.monotonic() - wall0
        server_cpu = proc_cpu_s(server) - server_cpu0
    except Exception as exc:  # noqa: BLE001 - a broken barrier or a dead child: report it
        error = f"{type(exc).__name__}: {exc}"
        for cn in conns:
            while cn.poll():
                msg = cn.recv()
                if msg[0] == "error":
                    error = msg[1]
    finally:
        for ch in children:
            ch.join(timeout=30)
            if ch.is_alive():
                ch.kill()
        if server is not None:
            server.close()
        for path in paths:
            path.unlink(missing_ok=True)
    if error:
        return {"status": "failed", "reason": error}
    tok = [x for r in results for x in r["tok_us"]]
    rec = [x for r in results for x in r["rec_us"]]
    client_cpu = sum(r["cpu_s"] for r in results)
    stats: dict[str, dict[str, int]] = {}
    for r in results:
        for group, counts in r["stats"].items():
            into = stats.setdefault(group, {})
            for k, v in counts.items():
                into[k] = into.get(k, 0) + v
    return {"status": "ok", "requests": len(tok), "records": len(rec), "wall_s": wall,
            "cpu_us_per_req": (client_cpu + server_cpu) / len(tok) * 1e6,
            "client_cpu_us_per_req": client_cpu / len(tok) * 1e6, "server_cpu_us_per_req": server_cpu / len(tok) * 1e6,
            "tok_p50_us": percentile(tok, 50), "tok_p99_us": percentile(tok, 99),
            "rec_p50_us": percentile(rec, 50), "rec_p99_us": percentile(rec, 99),
            "extended": ext[0], "extendable": ext[1], "bad_ids": sum(r["bad"] for r in results), "client_stats": stats,
            "minflt_per_req": sum(r["minflt"] for r in results) / len(tok),
            "client_sys_us_per_req": sum(r["sys_s"] for r in results) / len(tok) * 1e6,
            "vol_csw_per_req": sum(r["vol_csw"] for r in results) / len(tok)}


def _dispatch(convs: list[list[Turn]], procs: int, conns: list[Connection], args: argparse.Namespace,
              rng: random.Random) -> tuple[int, int]:
    """Send every turn to its process when it is due; (turns that extended the previous prompt +
    output exactly, turns that could)."""
    now = time.monotonic()
    due: list[tuple[float, int, str, int, int]] = []  # (when, seq, op, conversation, turn)
    seq = 0
    spread = args.gap[1]
    for c in range(len(convs)):
        heapq.heappush(due, (now + rng.uniform(0, spread), seq, "tok", c, 0))
        seq += 1
    prev: dict[int, tuple[int, bytes]] = {}  # conversation -> (len, digest) of its last prompt + output ids
    extended = extendable = 0
    busy = 0
    while due or busy:
        timeout = max(0.0, due[0][0] - time.monotonic()) if due else None
        for cn in wait(conns, timeout):
            assert isinstance(cn, Connection)
            msg = cn.recv()
            if msg[0] == "error":
                raise RuntimeError(msg[1])
            busy -= 1
            _, c, t, _proc = msg[:4]
            if msg[0] == "tok":
                got, n, dig = msg[4], msg[5], msg[6]
                if c in prev:
                    extendable += 1
                    extended += got == prev.pop(c)[1]
                if n:
                    prev[c] = (n, dig)
                if convs[c][t].output is not None:
                    heapq.heappush(due, (time.monotonic() + args.gen_s, seq, "rec", c, t))
                    seq += 1
            elif t + 1 < len(convs[c]):
                heapq.heappush(due, (time.monotonic() + rng.uniform(*args.gap), seq, "tok", c, t + 1))
                seq += 1
        while due and due[0][0] <= time.monotonic():
            _, _, op, c, t = heapq.heappop(due)
            msg: list[Any] = [op, c, t]
            if op == "tok":
                msg.append(prev[c][0] if c in prev else 0)
            conns[server_of(c, t, procs, args.placement)].send(msg)
            busy += 1
    return extended, extendable


# -- the report -------------------------------------------------------------------------------


def ratios(runs: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per contender: its CPU per request and tokenize p50 over the reference's."""
    ref = runs.get(REFERENCE, {})
    if ref.get("status") != "ok":
        return {}
    return {n: {"cpu": r["cpu_us_per_req"] / ref["cpu_us_per_req"], "tok_p50": r["tok_p50_us"] / ref["tok_p50_us"]}
            for n, r in runs.items() if r.get("status") == "ok"}


def print_report(res: dict[str, Any]) -> None:
    cfg = res["config"]
    for shape, rounds in res["shapes"].items():
        print(f"\n== node: {shape}, {cfg['conversations']} conversations x {cfg['turns']} turns, turns "
              f"{cfg['gap'][0]}-{cfg['gap'][1]} s apart ({cfg['placement']}), outputs recorded {cfg['gen_s']} s "
              f"after their prompt; {res['environment']['cpus']} CPUs, Python {res['environment']['python']} ==")
        for k, runs in enumerate(rounds):
            if len(rounds) > 1:
                print(f"-- round {k + 1}")
            rs = ratios(runs)
            print(f"{'contender':<15}{'CPU/req µs':>12}{'(client+server)':>18}{'tok p50':>9}{'p99':>9}"
                  f"{'rec p50':>9}{'p99':>9}{'extends':>10}{'CPU x':>7}{'p50 x':>7}{'faults':>8}{'sys':>7}{'csw':>6}")
            for n, r in runs.items():
                if r.get("status") != "ok":
                    print(f"{n:<15}{r.get('status')}: {str(r.get('reason'))[:100]}")
                    continue
                rec = (f"{r['rec_p50_us']:>9.0f}{r['rec_p99_us']:>9.0f}" if r["records"] else f"{'-':>9}{'-':>9}")
                x = rs.get(n, {})
                print(f"{n:<15}{r['cpu_us_per_req']:>12.0f}{r['client_cpu_us_per_req']:>10.0f}+"
                      f"{r['server_cpu_us_per_req']:<7.0f}{r['tok_p50_us']:>9.0f}{r['tok_p99_us']:>9.0f}{rec}"
                      f"{r['extended']:>5}/{r['extendable']:<4}{x.get('cpu', 0):>7.2f}{x.get('tok_p50', 0):>7.2f}"
                      f"{r['minflt_per_req']:>8.1f}{r['client_sys_us_per_req']:>7.0f}{r['vol_csw_per_req']:>6.1f}"
                      + (f"  BAD IDS {r['bad_ids']}" if r["bad_ids"] else ""))
        if len(rounds) > 1:
            med = {n: statistics.median(ratios(runs).get(n, {}).get("cpu", float("nan")) for runs in rounds)
                   for n in rounds[0]}
            print("median CPU ratio over rounds: " + ", ".join(f"{n} {v:.2f}" for n, v in med.items()))
    print(f"\n(CPU x, p50 x: over {REFERENCE}; µs; 'extends': turns whose ids start with the previous turn's "
          "prompt + output ids, of those whose text continues them; per request in the client processes: minor "
          "page faults, kernel CPU µs (part of the CPU), voluntary context switches)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default="4", help="API-server process counts, e.g. 4,16 (default 4)")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--target-bytes", default="57000", help="conversation sizes at the last turn, e.g. 57000,400000")
    ap.add_argument("--gap", default="0.25,0.75", help="seconds between a turn's record and the next turn (range)")
    ap.add_argument("--gen-s", type=float, default=0.1, help="seconds between a prompt and its output's record")
    ap.add_argument("--placement", choices=("move", "stay"), default="move")
    ap.add_argument("--rate", type=float, default=0.05, help="share of an output's tokens generated non-canonically")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--rounds", type=int, default=1, help="runs of every contender, in alternating order")
    ap.add_argument("--check", type=int, default=4, help="check every N-th request's ids decode to its text (0: no)")
    ap.add_argument("--seed", type=int, default=300)
    ap.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false")
    ap.add_argument("--tokenizer-dir", type=Path, default=None)
    ap.add_argument("--out-dir", type=Path, default=HERE / "out")
    args = ap.parse_args(argv)
    args.proc_list = [int(x) for x in args.procs.split(",")]
    args.size_list = [int(x) for x in args.target_bytes.split(",")]
    lo, hi = (float(x) for x in args.gap.split(","))
    args.gap = (lo, hi)
    args.contender_list = [c for c in args.contenders.split(",") if c]
    unknown = set(args.contender_list) - set(CONTENDERS)
    if unknown:
        ap.error(f"unknown contenders {sorted(unknown)}")
    if not 0 <= lo <= hi or args.gen_s < 0 or args.rounds < 1 or args.conversations < 1 or args.turns < 2:
        ap.error("--gap lo,hi with 0 <= lo <= hi, --gen-s >= 0, --rounds >= 1, --conversations >= 1, --turns >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tokcache.sidecar.bundled import qwen3_dir

    tok_dir = (args.tokenizer_dir or qwen3_dir()).resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "benchmark": "node",
        "config": {"procs": args.proc_list, "sizes": args.size_list, "conversations": args.conversations,
                   "turns": args.turns, "gap": list(args.gap), "gen_s": args.gen_s, "placement": args.placement,
                   "rate": args.rate, "rounds": args.rounds, "seed": args.seed, "gc_freeze": args.gc_freeze,
                   "tokenizer_dir": str(tok_dir), "command": " ".join(["bench/node.py", *(argv or sys.argv[1:])])},
        "environment": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "loadavg_at_start": list(os.getloadavg())},
        "shapes": {},
    }
    code = 0
    for size in args.size_list:
        convs = make_workload(args, tok_dir, size)
        for procs in args.proc_list:
            shape = f"P={procs}, {size // 1000} KB"
            rounds = []
            for rnd in range(args.rounds):
                order = args.contender_list if rnd % 2 == 0 else args.contender_list[::-1]
                got: dict[str, Any] = {}
                for name in order:
                    print(f"{shape} {name} (round {rnd + 1}/{args.rounds}) ...", file=sys.stderr, flush=True)
                    r = run_one(name, procs, convs, args, tok_dir, args.seed + rnd)
                    got[name] = r
                    if r["status"] == "ok":
                        print(f"   CPU/req {r['cpu_us_per_req']:.0f} µs, tok p50 {r['tok_p50_us']:.0f} µs, extends "
                              f"{r['extended']}/{r['extendable']}", file=sys.stderr, flush=True)
                        code |= bool(r["bad_ids"])
                    else:
                        print(f"   {r['status']}: {r['reason']}", file=sys.stderr, flush=True)
                        code |= r["status"] == "failed"
                rounds.append({n: got[n] for n in args.contender_list})
            res["shapes"][shape] = rounds
    path = args.out_dir / "node.json"
    path.write_text(json.dumps(res, indent=1))
    print_report(res)
    print(f"\nwrote {path}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
