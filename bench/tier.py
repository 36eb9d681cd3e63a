"""The cluster tier, measured: conversations that move between two "nodes" sharing one Redis.

Two real sidecars with separate shared memory (``--shm-prefix``: two nodes) and one real
``redis-server`` on loopback (``--ar-store``), beside a pair without a tier. Per conversation
turn k: node A tokenizes prompt k and records the model's (non-canonical) output through A;
node B tokenizes prompt k too. So at turn k:

- A holds turn k-1's output itself: a **local hit** (prefix AR);
- B holds the prompt up to turn k-1 (it tokenized it) but the output only in the tier:
  a **remote hit** (one tier read, verification, local store, the lookup again);
- "moves": B's ids for prompt k extend A's ids for prompt k-1 + its output (what node A's
  KV holds, and what a router or a KV store keyed by token-id hashes would look up).

The same on the pair without a tier gives the local hit with the tier off and the "moves"
figure without a tier. Then the tier fails mid-run — SIGKILL of the server, and of one node
of a three-node cluster — and comes back (failed Tokenize calls, moves before/during/after),
and a tampered value is put in the tier (served? counted?).

    python bench/tier.py [--conversations 20] [--turns 6] [--no-outages]

Prints a table and writes bench/out/tier.json. Needs redis-server (Debian package) and redis-py.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidecar_client import SidecarClient, TokcacheError  # noqa: E402
from tests.ar_helpers import noncanonical  # noqa: E402
from tests.integration.sidecar_proc import SidecarProcess  # noqa: E402
from tests.redis_servers import RedisCluster, RedisServer, free_port  # noqa: E402
from tokcache.sidecar.bundled import qwen3_dir  # noqa: E402
from tokcache.sidecar.engine.model import ModelEngine  # noqa: E402
from tokcache.sidecar.tier import encode_value  # noqa: E402
from tokcache.store.keys import MODE_KV_STABLE, segment_key  # noqa: E402

EOS = 151645
ANSWERS = ["Step one:\n\n    run `make`\n\n", "Result: 100 passed\n\n\n  ok", "完成了。\n\n🎉 Done.",
           "Plan:\n\n1. read\n2. write\n\n", "  indented answer\n\n\nwith blank lines  ", "Fine.\n\n"]
WRITES_OK = 'tokcache_tier_writes_total{result="ok"}'


class Node:
    def __init__(self, tmp: Path, name: str, tier: str | None) -> None:
        self.port = free_port()
        extra = ["--metrics-port", str(self.port), "--metrics-addr", "127.0.0.1", "--shm-size", "128MiB"]
        if tier:
            extra += ["--ar-store", tier]
        (tmp / name).mkdir(parents=True, exist_ok=True)
        self.prefix = f"tkbench-{name}-{uuid.uuid4().hex[:6]}"
        self.proc = SidecarProcess(tmp / name, {"qwen3": qwen3_dir()}, self.prefix, *extra)
        self.proc.cmd[self.proc.cmd.index("--shm-size") + 1] = "128MiB"

    def __enter__(self) -> Node:
        self.proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stop()
        for p in Path("/dev/shm").glob(f"*{self.prefix}*"):
            p.unlink(missing_ok=True)

    @property
    def address(self) -> str:
        return self.proc.address

    def sample(self, name: str) -> float:
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        for line in body.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_writes(self, at_least: float, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sample(WRITES_OK) >= at_least:
                return True
            time.sleep(0.005)
        return False


class Conv:
    def __init__(self, engine: ModelEngine, tag: str) -> None:
        self.engine = engine
        self.salt = uuid.uuid4().hex
        self.msgs: list[dict[str, Any]] = [{"role": "system", "content": f"Be brief. ({tag})"},
                                           {"role": "user", "content": "go " * 40}]
        self.turn = 0

    def answer(self) -> str:
        return ANSWERS[self.turn % len(ANSWERS)] + f" (turn {self.turn})"

    def advance(self, answer: str) -> None:
        self.msgs += [{"role": "assistant", "content": answer},
                      {"role": "user", "content": f"next {self.turn}: " + "word " * (5 + 3 * self.turn)}]
        self.turn += 1


def timed(c: SidecarClient, text: str, salt: str) -> tuple[list[int], float, str, str]:
    gc.collect()  # the same clean start for every timed call (the tier pair's waits allocate more)
    t0 = time.perf_counter()
    r = c.tokenize("qwen3", text=text, add_special_tokens=False, cache_salt=salt)
    return r.token_ids, time.perf_counter() - t0, r.decision.source, r.served_by


def record(c: SidecarClient, conv: Conv, text: str, ids: list[int]) -> list[int]:
    answer = conv.answer()
    gen = noncanonical(conv.engine, answer)
    c.record_output("qwen3", prompt_text=text, prompt_token_ids=ids, output_text=answer,
                    output_token_ids=gen + [EOS], finish_reason="stop", cache_salt=conv.salt)
    conv.advance(answer)
    return gen


def extends(new: list[int], old: list[int], gen: list[int]) -> bool:
    return new[:len(old) + len(gen)] == old + gen


def p50(xs: list[float]) -> float | None:
    return statistics.median(xs) * 1e6 if xs else None


def conversations(pairs: dict[str, tuple[Node, Node, bool]], engine: ModelEngine, n: int, turns: int, *,
                  zero_rpc: bool) -> dict[str, dict[str, Any]]:
    """Turns on A (local) and B (the conversation's other node), for each pair (label -> A, B,
    tier?), interleaved: conversation i runs on every pair, in an order that rotates with i,
    so the pairs share the machine's noise alike."""
    acc = {label: {"local": [], "remote": [], "first": [], "moved": [], "sources": {}} for label in pairs}
    with ExitStack() as stack:
        clients = {label: (stack.enter_context(SidecarClient(a.address, zero_rpc=zero_rpc)),
                           stack.enter_context(SidecarClient(b.address, zero_rpc=zero_rpc)),
                           stack.enter_context(SidecarClient(a.address, zero_rpc=False)))
                   for label, (a, b, _) in pairs.items()}
        labels = list(pairs)
        for i in range(n):
            for label in labels[i % len(labels):] + labels[:i % len(labels)]:
                a, _, tier = pairs[label]
                ca, cb, render = clients[label]
                r = acc[label]
                conv = Conv(engine, f"{i}-{uuid.uuid4().hex[:4]}")
                prev: tuple[list[int], list[int]] | None = None
                for k in range(turns):
                    text = render.render("qwen3", conv.msgs, add_generation_prompt=True)
                    ids, dt, _, _ = timed(ca, text, conv.salt)
                    (r["local"] if k else r["first"]).append(dt)
                    ids_b, dt_b, src_b, _ = timed(cb, text, conv.salt)
                    if k:
                        r["remote"].append(dt_b)
                        r["sources"][src_b] = r["sources"].get(src_b, 0) + 1
                        assert prev is not None
                        r["moved"].append(extends(ids_b, *prev))
                    written = a.sample(WRITES_OK)
                    gen = record(ca, conv, text, ids)
                    if tier:
                        a.wait_writes(written + 1)
                    else:
                        a.sample(WRITES_OK)  # the same scrape as the tier pair's wait
                    prev = (ids, gen)
        return {label: {"local_hit_p50_us": p50(r["local"]), "other_node_p50_us": p50(r["remote"]),
                        "first_turn_p50_us": p50(r["first"]), "samples": len(r["local"]), "moves": sum(r["moved"]),
                        "of": len(r["moved"]), "other_node_sources": r["sources"],
                        "in_process_stats": clients[label][0].stats() if zero_rpc else None}
                for label, r in acc.items()}


def alternating(a: Node, b: Node, engine: ModelEngine, n: int, turns: int) -> dict[str, Any]:
    """Ping-pong routing: turn k served and recorded by A when k is even, B when odd. Does each
    turn's prompt extend the previous turn's prompt + output (served by the other node)?"""
    ok = total = 0
    with SidecarClient(a.address, zero_rpc=False) as ca, SidecarClient(b.address, zero_rpc=False) as cb:
        for i in range(n):
            conv = Conv(engine, f"pp{i}-{uuid.uuid4().hex[:4]}")
            prev: tuple[list[int], list[int]] | None = None
            for k in range(turns):
                node, c = (a, ca) if k % 2 == 0 else (b, cb)
                text = ca.render("qwen3", conv.msgs, add_generation_prompt=True)
                ids = timed(c, text, conv.salt)[0]
                if prev is not None:
                    total += 1
                    ok += extends(ids, *prev)
                written = node.sample(WRITES_OK)
                gen = record(c, conv, text, ids)
                node.wait_writes(written + 1, timeout=1.0)
                prev = (ids, gen)
    return {"extend": ok, "of": total}


def outage(a: Node, b: Node, engine: ModelEngine, kill: Callable[[], None],
           revive: Callable[[], None]) -> dict[str, Any]:
    """Moves (1 recorded turn on A, the next on B) before, during and after an outage."""
    failures = 0
    log: list[tuple[str, bool]] = []

    def move(ca: SidecarClient, cb: SidecarClient, wait: bool) -> bool:
        nonlocal failures
        conv = Conv(engine, uuid.uuid4().hex[:6])
        try:
            text = ca.render("qwen3", conv.msgs, add_generation_prompt=True)
            ids, _, _, _ = timed(ca, text, conv.salt)
            written = a.sample(WRITES_OK)
            gen = record(ca, conv, text, ids)
            if wait:
                a.wait_writes(written + 1, timeout=1.0)
            nxt = ca.render("qwen3", conv.msgs, add_generation_prompt=True)
            return extends(timed(cb, nxt, conv.salt)[0], ids, gen)
        except TokcacheError:
            failures += 1
            return False

    with SidecarClient(a.address, zero_rpc=False, timeout=5) as ca, \
            SidecarClient(b.address, zero_rpc=False, timeout=5) as cb:
        log += [("before", move(ca, cb, True)) for _ in range(5)]
        kill()
        t_down = time.monotonic()
        log += [("down", move(ca, cb, False)) for _ in range(10)]
        revive()
        t_up = time.monotonic()
        back = None
        while time.monotonic() - t_up < 30:
            ok = move(ca, cb, True)
            log.append(("after", ok))
            if ok and back is None:
                back = time.monotonic() - t_up
            if back is not None and sum(1 for p, o in log if p == "after" and o) >= 5:
                break
            time.sleep(0.1)
    phase = {p: [o for q, o in log if q == p] for p in ("before", "down", "after")}
    return {"failed_tokenize_calls": failures, "tokenize_calls": 2 * len(log),
            "moves": {p: f"{sum(v)}/{len(v)}" for p, v in phase.items()},
            "back_on_tier_s_after_restart": back, "down_s": t_up - t_down}


def tampered(a: Node, b: Node, engine: ModelEngine, url: str) -> dict[str, Any]:
    import redis

    r = redis.Redis.from_url(url)
    served = 0
    invalid0 = b.sample('tokcache_tier_records_total{model="qwen3",result="invalid"}')
    with SidecarClient(a.address, zero_rpc=False) as ca, SidecarClient(b.address, zero_rpc=False) as cb:
        fp = cb.list_models()[0].fingerprint
        cases = 0
        for bad in ("reversed", "foreign", "truncated"):
            conv = Conv(engine, bad)
            text = ca.render("qwen3", conv.msgs, add_generation_prompt=True)
            ids, _, _, _ = timed(ca, text, conv.salt)
            written = a.sample(WRITES_OK)
            answer = conv.answer()
            gen = record(ca, conv, text, ids)
            a.wait_writes(written + 1)
            name = b"tokcache:ar:%s:%s" % (fp.encode(), segment_key(conv.salt, MODE_KV_STABLE, answer.encode()).hex()
                                            .encode())
            value = {"reversed": encode_value(fp, list(reversed(gen))), "foreign": encode_value("e" * 32, gen),
                     "truncated": encode_value(fp, gen[:-1])}[bad]
            r.set(name, value)
            got = timed(cb, ca.render("qwen3", conv.msgs, add_generation_prompt=True), conv.salt)[0]
            served += extends(got, ids, gen) or got[len(ids):len(ids) + len(gen)] == gen
            cases += 1
    r.close()
    return {"tampered_values": cases, "served": served,
            "counted_invalid": b.sample('tokcache_tier_records_total{model="qwen3",result="invalid"}') - invalid0}


@contextmanager
def nodes(tmp: Path, tier: str | None) -> Iterator[tuple[Node, Node]]:
    with ExitStack() as stack:
        a = stack.enter_context(Node(tmp, f"a{uuid.uuid4().hex[:4]}", tier))
        b = stack.enter_context(Node(tmp, f"b{uuid.uuid4().hex[:4]}", tier))
        yield a, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--no-outages", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "tier.json")
    args = ap.parse_args()
    import tempfile

    engine = ModelEngine("qwen3", qwen3_dir(), store=None)
    out: dict[str, Any] = {"conversations": args.conversations, "turns": args.turns}
    with tempfile.TemporaryDirectory(prefix="tokcache-tier-") as tmp_s:
        tmp = Path(tmp_s)
        single = RedisServer(tmp / "redis").start()
        try:
            with nodes(tmp, single.url) as (a, b), nodes(tmp, None) as (c, d):
                pairs = {"tier": (a, b, True), "no_tier": (c, d, False)}
                for zero_rpc, how in ((False, "rpc"), (True, "in_process")):
                    for label, result in conversations(pairs, engine, args.conversations, args.turns,
                                                       zero_rpc=zero_rpc).items():
                        out[f"{label}_{how}"] = result
                out["alternating"] = alternating(a, b, engine, max(2, args.conversations // 4), args.turns)
                out["tampered"] = tampered(a, b, engine, single.url)
                if not args.no_outages:
                    out["outage_single"] = outage(a, b, engine, single.kill, single.start)
        finally:
            single.stop()
        if not args.no_outages:
            three = RedisCluster(tmp / "cluster").start()
            try:
                with nodes(tmp, three.url) as (a, b):
                    out["cluster_rpc"] = conversations({"cluster": (a, b, True)}, engine,
                                                       max(2, args.conversations // 4), args.turns,
                                                       zero_rpc=False)["cluster"]
                    victim = three.nodes[1]

                    def revive() -> None:
                        victim.start()
                        three.wait_ok()

                    out["outage_cluster_node"] = outage(a, b, engine, victim.kill, revive)
            finally:
                three.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    _print(out)
    print(f"\nwrote {args.out}")
    return 0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f} µs"


def _print(out: dict[str, Any]) -> None:
    print(f"{out['conversations']} conversations x {out['turns']} turns; Tokenize latency as the client sees it, p50")
    print(f"{'':34} {'local hit (A)':>16} {'other node (B)':>16} {'first turn (A)':>16} {'moves extend':>14}")
    for key, label in (("tier_rpc", "tier on, RPC client"), ("no_tier_rpc", "tier off, RPC client"),
                       ("tier_in_process", "tier on, default client"),
                       ("no_tier_in_process", "tier off, default client"), ("cluster_rpc", "3-node cluster, RPC")):
        r = out.get(key)
        if r:
            print(f"{label:34} {_fmt(r['local_hit_p50_us']):>16} {_fmt(r['other_node_p50_us']):>16} "
                  f"{_fmt(r['first_turn_p50_us']):>16} {r['moves']:>6}/{r['of']:<7}")
    for key in ("alternating", "tampered", "outage_single", "outage_cluster_node"):
        if key in out:
            print(f"{key}: {json.dumps(out[key])}")


if __name__ == "__main__":
    sys.exit(main())
