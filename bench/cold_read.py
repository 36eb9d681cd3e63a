#!/usr/bin/env python3
"""What a cold in-process read pays for: the same read after different warm-ups.

``bench/multiturn_latency.py`` runs every call after the other contenders ran, so each starts
with cold CPU caches, as a request in a busy API server does. This script asks where that cold
cost sits. It replays agent conversations through tokcache's default client (reads in this
process) and, before each read, writes ``--thrash-mib`` of other memory (the caches go cold),
then runs one warm-up that is not timed, rotating over:

- ``cold``: none;
- ``encoder``: the client's tail encoder on a 50-character text (its code, not this text's data);
- ``python``: unrelated Python work (dict and list operations: the interpreter's own code);
- ``lookup``: a 50-character read through the same lookup (``Lookup.tokenize``: the read's
  code path: the hasher, the store, the lookup, the encoder);
- ``client``: the same through the client (``SidecarClient.tokenize``);
- ``direct``: no warm-up, and the timed read calls the lookup directly, skipping the client's
  layers (what the client does with the read's entries, ``LocalModel._keep``, is done after
  the clock stops).

What a warm-up saves is what that part costs a cold read. Alongside, per read: fastokens with
its segment cache on the whole text, and the tail encoder alone on the part the turn appended,
cold and then warm. Ids are checked against ``tokenizers`` every ``--check`` reads.

    .venv/bin/python bench/cold_read.py                   # 9 conversations x 40 turns, ~2 min
    .venv/bin/python bench/cold_read.py --quick           # 1 conversation, 10 turns (tests)

Writes ``cold_read.json`` and ``cold_read.png`` under ``--out-dir``. Numbers are p50 over
turns >= 2 per variant (each variant takes every ``len(VARIANTS)``-th read). One process, so
the machine's noise moves all variants together; compare them within one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _contenders import TOKCACHE_MODEL, ContenderUnavailable, TokcacheContender  # noqa: E402
from _plot import pyplot  # noqa: E402

VARIANTS = ("cold", "encoder", "python", "lookup", "client", "direct")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=9)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--target-bytes", type=int, default=57000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--thrash-mib", type=int, default=16, help="memory written before each read (default 16)")
    ap.add_argument("--check", type=int, default=8, help="compare every N-th read's ids (default 8)")
    ap.add_argument("--tokenizer-dir", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="1 conversation, 10 turns (for tests)")
    ap.add_argument("--out-dir", type=Path, default=HERE / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations, args.turns = 1, 10
    if args.conversations < 1 or args.turns < 2 or args.thrash_mib < 0 or args.check < 1:
        ap.error("--conversations >= 1, --turns >= 2, --thrash-mib >= 0 and --check >= 1")
    return args


def _python_work() -> None:
    """Unrelated Python: dict, list and sort operations (the interpreter's common paths)."""
    d: dict[str, list[Any]] = {}
    for i in range(300):
        d[str(i)] = [i, (i, i)]
    sorted(d.items())


def run(args: argparse.Namespace) -> dict[str, Any]:
    import conversations
    import fastokens
    import tokenizers

    from tokcache.sidecar.bundled import qwen3_dir

    tok_dir = (args.tokenizer_dir or qwen3_dir()).resolve()
    render = conversations.load_renderer(tok_dir)
    print(f"rendering {args.conversations} conversations ...", file=sys.stderr)
    convs = [conversations.generate(args.seed + 1000 * c, render, args.turns, args.target_bytes).texts
             for c in range(args.conversations)]
    tj = str(tok_dir / "tokenizer.json")
    ref = tokenizers.Tokenizer.from_file(tj)
    seg = fastokens.Tokenizer.from_file(tj)
    seg.enable_segment_cache(64 << 20)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    server = TokcacheContender(tok_dir, args.out_dir, False)
    server.start()
    try:
        from sidecar_client import SidecarClient

        client = SidecarClient(server.target, timeout=60)
        with client:
            client.tokenize(TOKCACHE_MODEL, text="warm-up", add_special_tokens=False)
            local = client._local.get(TOKCACHE_MODEL) if client._local is not None else None
            if local is None:
                raise ContenderUnavailable("the client's in-process read did not open")
            lookup, encoder = local.lookup, local.lookup.model.encoder
            mode = client._local.default_mode(TOKCACHE_MODEL)  # what the client's reads use
            junk = bytearray(args.thrash_mib << 20)

            def thrash() -> None:
                for i in range(0, len(junk), 64):
                    junk[i] = (junk[i] + 1) & 255

            lat: dict[str, list[float]] = {v: [] for v in VARIANTS}
            extra: dict[str, list[float]] = {"fastokens+seg": [], "tail encoder, cold": [], "tail encoder, warm": []}
            served: dict[str, int] = {}
            mismatches = reads = rpc = 0  # rpc: reads the sidecar answered (the in-process path fell back)
            gc.collect()
            for turn in range(args.turns):
                for ci, conv in enumerate(convs):
                    text = conv[turn]
                    variant = VARIANTS[(turn * len(convs) + ci) % len(VARIANTS)]
                    thrash()
                    if variant == "encoder":
                        encoder.encode("x" * 50)
                    elif variant == "python":
                        _python_work()
                    elif variant == "lookup":
                        lookup.tokenize("y" * 50, add_special_tokens=False, mode=mode)
                    elif variant == "client":
                        client.tokenize(TOKCACHE_MODEL, text="z" * 50, add_special_tokens=False)
                    client.flush()
                    gc.disable()
                    t0 = time.perf_counter_ns()
                    if variant == "direct":
                        result = lookup.tokenize(text, add_special_tokens=False, mode=mode)
                        t1 = time.perf_counter_ns()
                        ids, source = result.ids, result.decision.source
                    else:
                        got = client.tokenize(TOKCACHE_MODEL, text=text, add_special_tokens=False)
                        t1 = time.perf_counter_ns()
                        ids, source = got.token_ids, got.decision.source
                        if got.served_by != "local":
                            rpc += 1
                    gc.enable()
                    if variant == "direct":  # the entries stored or kept, as the client's read does
                        local._keep(text, "", mode, False, result)
                    client.flush()
                    reads += 1
                    if reads % args.check == 0 and list(ids) != ref.encode(text, add_special_tokens=False).ids:
                        mismatches += 1
                    if turn >= 1:
                        lat[variant].append((t1 - t0) / 1000)
                        served[source] = served.get(source, 0) + 1
                    # The contenders alongside, each after its own thrash.
                    appended = text[len(conv[turn - 1]):] if turn else text
                    for name in ("fastokens+seg", "tail encoder, cold"):
                        thrash()
                        s = time.perf_counter_ns()
                        if name == "fastokens+seg":
                            _ = seg.encode(text, add_special_tokens=False).ids  # the list, as its contender makes
                        else:
                            encoder.encode(appended)
                        e = time.perf_counter_ns()
                        if turn >= 1:
                            extra[name].append((e - s) / 1000)
                    s = time.perf_counter_ns()
                    encoder.encode(appended)
                    if turn >= 1:
                        extra["tail encoder, warm"].append((time.perf_counter_ns() - s) / 1000)
                print(f"  turn {turn + 1}/{args.turns}", file=sys.stderr, end="\r")
            print(file=sys.stderr)
    finally:
        server.close()
    p50 = {k: statistics.median(v) for k, v in lat.items() if v}
    base = p50.get("cold")
    return {
        "config": {"conversations": args.conversations, "turns": args.turns, "target_bytes": args.target_bytes,
                   "thrash_mib": args.thrash_mib, "tokenizer": str(tok_dir)},
        "variants": {k: {"p50_us": p50.get(k), "n": len(v), "saved_us": (base - p50[k]) if base and k in p50 else None,
                         "samples_us": v} for k, v in lat.items()},
        "alongside": {k: {"p50_us": statistics.median(v) if v else None, "n": len(v)} for k, v in extra.items()},
        "sources": served, "rpc_reads": rpc, "checked": reads // args.check, "mismatches": mismatches,
    }


def report(r: dict[str, Any]) -> None:
    cfg = r["config"]
    print(f"\n== a cold read, {cfg['conversations']} conversations x {cfg['turns']} turns "
          f"(~{cfg['target_bytes'] // 1000} KB at the last), {cfg['thrash_mib']} MiB written before each read; "
          "p50 over turns >= 2 ==")
    print(f"{'warm-up before the read':32s} {'p50':>9s} {'saved':>9s}   n")
    for name, v in r["variants"].items():
        saved = "" if v["saved_us"] is None or name == "cold" else f"{v['saved_us']:7.0f} µs"
        p50 = "-" if v["p50_us"] is None else f"{v['p50_us']:6.0f} µs"
        print(f"{name:32s} {p50:>9s} {saved:>9s}   {v['n']}")
    print("alongside, each after its own thrash:")
    for name, v in r["alongside"].items():
        p50 = "-" if v["p50_us"] is None else f"{v['p50_us']:6.0f} µs"
        print(f"  {name:30s} {p50:>9s}")
    print(f"decisions: {r['sources']}; answered over RPC: {r['rpc_reads']}; ids checked on {r['checked']} reads, "
          f"{r['mismatches']} mismatches")


def plot(r: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    names = [k for k, v in r["variants"].items() if v["p50_us"] is not None]
    names += [k for k, v in r["alongside"].items() if v["p50_us"] is not None]
    values = [r["variants"][k]["p50_us"] if k in r["variants"] else r["alongside"][k]["p50_us"] for k in names]
    colors = ["tab:blue" if k in r["variants"] else "tab:gray" for k in names]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(names[::-1], values[::-1], color=colors[::-1])
    ax.set_xlabel("p50 µs (turns >= 2)")
    ax.set_title("tokcache's in-process read after each warm-up (blue); contenders alongside (gray)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        r = run(args)
    except ContenderUnavailable as exc:
        print(f"tokcache unavailable: {exc}", file=sys.stderr)
        return 2
    report(r)
    out = args.out_dir / "cold_read.json"
    out.write_text(json.dumps(r, indent=1))
    png = plot(r, args.out_dir / "cold_read.png")
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return 1 if r["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
