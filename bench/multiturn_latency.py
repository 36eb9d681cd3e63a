#!/usr/bin/env python3
"""Per-turn tokenization latency of growing agent conversations, contenders side by side.

Replays deterministic 40-turn agent conversations (``conversations.py``; ~57 KB of Qwen3 chat
text at the last turn) and, turn by turn, has every contender tokenize the same prompt text:

- ``tokenizers``      in-process ``tokenizers.Tokenizer.encode`` (what vLLM does by default)
- ``fastokens``       in-process ``fastokens`` (no cache)
- ``fastokens+seg``   in-process ``fastokens`` with its segment cache
- ``smg``             SMG 1.13's ``/v1/tokenize`` with its L0+L1 cache, HTTP keep-alive
- ``tokcache``        tokcache's default client (``SidecarClient``): reads the sidecar's shared
                      memory in this process, no RPC; what a read learned is stored within
                      the call (in the latency)
- ``tokcache-ar``     the default client as vLLM's plugin uses it: each turn's output is
                      recorded (``RecordOutput``, untimed) before the next turn, so reads
                      splice recorded outputs (kv-stable with AR entries: the Python path, as
                      the native fast path steps aside once the segment holds any);
                      ``--ar`` adds it (off by default: its sidecar's work and its records'
                      verification in this process move the other contenders' figures)
- ``tokcache-rpc``    the same over gRPC on a unix socket (``zero_rpc=False``: its
                      ``TokenizeStream``); ``--rpc-devices`` adds ``tokcache-rpc-unary``, the
                      same with the stream switched off (unary ``Tokenize`` calls)
- ``*-floor``         a trivial request to each server: what the transport alone costs

Every tokcache contender has its own sidecar and segment: one's entries never serve another.

``--long``: one 100-turn conversation growing to ~800 KB (~270k tokens); the summary is over
its last 10 turns. Otherwise the summary is over turns >= 2.

The contenders run in a new order every turn (a shuffle seeded by the turn's number), so each
follows every other about equally often, and each gets its own copy of the text (a fresh
``str``, as vLLM's renderer makes one per request). A contender pays for what ran before it:
right after the ``tokenizers`` contender's 57 KB encode, the next native call's caches and the
allocator's free lists are cold (measured here: a 1.5 KB fastokens encode went from 17 µs to
340 µs), while right after another fastokens instance on the same text its code is warm. A
fixed rotation would always run fastokens+seg right after fastokens and tokcache after the SMG
floor call. Every contender's ids are compared with
``tokenizers.Tokenizer.from_file(tokenizer.json).encode(text).ids``; a mismatch is reported on
stderr at once and makes the script exit 1.

Latency is client-observed: from the call until the caller holds a ``list[int]``.

Run: ``python bench/multiturn_latency.py`` (add ``--quick`` for 1 conversation x 10 turns,
``--no-smg`` to skip SMG). Writes ``bench/out/multiturn_latency.{json,png}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

import conversations  # noqa: E402
from _contenders import (  # noqa: E402
    Contender,
    ContenderUnavailable,
    FastokensContender,
    SmgContender,
    SmgFloor,
    TokcacheContender,
    TokcacheFloor,
    TokenizersContender,
)
from _plot import pyplot  # noqa: E402
from _stats import percentile  # noqa: E402

from tokcache.ids import common_prefix  # noqa: E402

SHM_TARGET_BYTES = 128 * 1024
SEGMENT_CACHE_BYTES = 64 << 20
# No special tokens: warming up must not seed the caches with a boundary the runs then hit.
WARMUP_TEXTS = ["warm-up: hello world", "warm-up 你好 🌍\n    indented  line\n\tand a tab"]


@dataclass
class Sample:
    conv: int
    turn: int
    ns: int
    position: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Entry:
    """One contender's run: its samples, and how its ids compared."""

    contender: Contender
    status: str = "ok"  # ok | unavailable | failed
    reason: str = ""
    samples: list[Sample] = field(default_factory=list)
    checked_calls: int = 0
    mismatches: int = 0


def loud(msg: str) -> None:
    bar = "!" * 78
    print(f"\n{bar}\n{msg}\n{bar}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--conversations", type=int, default=3, help="conversations to replay (default 3)")
    ap.add_argument(
        "--turns", type=int, default=conversations.DEFAULT_TURNS, help="turns per conversation (default 40)"
    )
    ap.add_argument(
        "--target-bytes",
        type=int,
        default=conversations.DEFAULT_TARGET_BYTES,
        help="UTF-8 size of the last turn of a full conversation (default 57000)",
    )
    ap.add_argument("--seed", type=int, default=0, help="conversation i uses seed+i (default 0)")
    ap.add_argument("--tokenizer-dir", type=Path, default=None, help="default: tokcache.sidecar.bundled.qwen3_dir()")
    ap.add_argument(
        "--add-special-tokens",
        action="store_true",
        help="encode with add_special_tokens=True (default False, as vLLM does for chat)",
    )
    ap.add_argument("--quick", action="store_true", help="1 conversation, first 10 turns (for tests)")
    ap.add_argument("--no-smg", action="store_true", help="skip SMG")
    ap.add_argument("--no-tokcache", action="store_true", help="skip the tokcache sidecar (harness debugging)")
    ap.add_argument("--unary", action="store_true",
                    help="tokcache-rpc over the unary Tokenize RPC instead of the client's TokenizeStream")
    ap.add_argument("--rpc-devices", action="store_true",
                    help="also run tokcache-rpc over the unary Tokenize (what the TokenizeStream saves)")
    ap.add_argument("--no-rpc", action="store_true", help="skip the tokcache RPC contenders")
    ap.add_argument("--ar", action="store_true",
                    help="also run tokcache-ar: each turn's output recorded before the next (vLLM's plugin path)")
    ap.add_argument("--long", action="store_true",
                    help="1 conversation of 100 turns to ~800 KB; summary over the last 10 turns")
    ap.add_argument("--out-dir", type=Path, default=HERE / "out")
    args = ap.parse_args(argv)
    if args.long:
        args.conversations, args.turns, args.target_bytes = 1, 100, 800_000
    if args.quick:
        args.conversations, args.turns_used = 1, min(10, args.turns)
    else:
        args.turns_used = args.turns
    args.summary_from = max(2, args.turns_used - 9) if args.long else 2
    if args.conversations < 1 or args.turns < 1:
        ap.error("--conversations and --turns must be >= 1")
    return args


def build_contenders(
    args: argparse.Namespace, tok_dir: Path
) -> tuple[list[Entry], TokcacheContender | None, SmgContender | None]:
    tj = tok_dir / "tokenizer.json"
    add = args.add_special_tokens
    entries = [
        Entry(TokenizersContender(tj, add)),
        Entry(FastokensContender(tj, add)),
        Entry(FastokensContender(tj, add, SEGMENT_CACHE_BYTES)),
    ]
    smg = tc = None
    if not args.no_smg:
        smg = SmgContender(tok_dir, args.out_dir)
        entries += [Entry(smg), Entry(SmgFloor(smg))]
    if not args.no_tokcache:
        tc = TokcacheContender(tok_dir, args.out_dir, add)
        entries.append(Entry(tc))
        if args.ar:
            entries.append(Entry(TokcacheContender(tok_dir, args.out_dir, add, record_outputs=True)))
        if not args.no_rpc:
            rpc = TokcacheContender(tok_dir, args.out_dir, add, zero_rpc=False, stream=not args.unary)
            entries += [Entry(rpc), Entry(TokcacheFloor(rpc))]
            if args.rpc_devices:
                entries.append(Entry(TokcacheContender(tok_dir, args.out_dir, add, zero_rpc=False, stream=False,
                                                       name="tokcache-rpc-unary")))
    return entries, tc, smg


def start_all(entries: list[Entry]) -> None:
    for e in entries:
        c = e.contender
        print(f"starting {c.name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            # A floor rides on its server: if that did not start, neither does the floor.
            parent = getattr(c, "_smg", None) or getattr(c, "_tc", None)
            if parent is not None:
                pe = next(x for x in entries if x.contender is parent)
                if pe.status != "ok":
                    raise ContenderUnavailable(f"{parent.name} is unavailable")
            c.start()
            for w in WARMUP_TEXTS:
                c.encode(w)
                c.encode(w)
        except ContenderUnavailable as exc:
            e.status, e.reason = "unavailable", str(exc)
            print(f"  {c.name}: UNAVAILABLE, continuing without it: {exc}", file=sys.stderr, flush=True)
            c.close()
        except Exception as exc:  # noqa: BLE001 - any start failure is reported, not fatal here
            e.status, e.reason = "unavailable", f"{type(exc).__name__}: {exc}"
            print(f"  {c.name}: FAILED TO START: {e.reason}", file=sys.stderr, flush=True)
            c.close()
        else:
            print(f"  {c.name}: ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from tokcache.sidecar.bundled import qwen3_dir

    default_dir = qwen3_dir()
    tok_dir = (args.tokenizer_dir or default_dir).resolve()
    args.tokenizer_name = "Qwen3" if tok_dir == default_dir.resolve() else tok_dir.name
    args.out_dir.mkdir(parents=True, exist_ok=True)

    print("rendering conversations ...", file=sys.stderr, flush=True)
    render = conversations.load_renderer(tok_dir, fallback_dir=default_dir)
    convs = [
        conversations.generate(args.seed + i, render, args.turns, args.target_bytes) for i in range(args.conversations)
    ]
    texts = [c.texts[: args.turns_used] for c in convs]

    import tokenizers

    ref_tok = tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    add = args.add_special_tokens
    # SMG's /v1/tokenize has no add_special_tokens (the field is ignored); which way it encodes
    # is probed below on a plain text, which seeds no boundary in its cache.
    probe = "probe: Hello world"
    probe_refs = {flag: ref_tok.encode(probe, add_special_tokens=flag).ids for flag in (False, True)}
    specials_differ = probe_refs[False] != probe_refs[True]
    smg_add: bool | None = None

    entries, tc, smg = build_contenders(args, tok_dir)
    started_at = time.time()
    exit_code = 0
    shm: list[dict[str, Any]] = []
    smg_metrics: list[dict[str, float]] = []
    ref_tokens: list[list[int]] = []
    mismatch_log: list[dict[str, Any]] = []
    try:
        start_all(entries)
        if tc is not None and entries[[e.contender for e in entries].index(tc)].status != "ok":
            loud(f"tokcache sidecar unavailable: {entries[[e.contender for e in entries].index(tc)].reason}")
            exit_code = 1
        active = [e for e in entries if e.status == "ok"]
        if smg is not None and smg in [e.contender for e in active] and specials_differ:
            got = smg.encode(probe)
            smg_add = next((flag for flag, ids in probe_refs.items() if ids == got), None)
            if smg_add is None:
                loud(f"smg encodes the probe as neither add_special_tokens value: {got} vs {probe_refs}")
        if tc is not None and tc in [e.contender for e in active]:
            shm.append({"conv": -1, **tc.shm_usage()})
        if smg is not None and smg in [e.contender for e in active]:
            smg_metrics.append(smg.metrics())
        step = 0
        tty = sys.stderr.isatty()
        cr, nl = ("\r", "") if tty else ("", "\n")
        for ci, conv_texts in enumerate(texts):
            refs = [ref_tok.encode(t, add_special_tokens=add).ids for t in conv_texts]
            smg_refs = (
                [ref_tok.encode(t, add_special_tokens=smg_add).ids for t in conv_texts]
                if smg_add is not None and smg_add != add
                else refs
            )
            ref_tokens.append([len(r) for r in refs])
            for ti, text in enumerate(conv_texts):
                turn = ti + 1
                if tty or turn % 10 == 0 or turn == len(conv_texts):
                    print(
                        f"{cr}[conv {ci + 1}/{len(texts)}] turn {turn:>2}/{len(conv_texts)}  "
                        f"{len(text.encode()) / 1000:5.1f} KB",
                        end=nl,
                        file=sys.stderr,
                        flush=True,
                    )
                live = [e for e in active if e.status == "ok"]
                order = random.Random(step).sample(live, len(live))
                step += 1
                gc.collect()
                for pos, e in enumerate(order):
                    c = e.contender
                    # A str of its own for each contender, as vLLM's renderer makes one per request:
                    # CPython caches a str's UTF-8 form the first time a native library asks for it
                    # (PyO3 &str), so sharing one object would hand that work to whoever ran first.
                    own = text.encode("utf-8").decode("utf-8")
                    prepare = getattr(c, "prepare", None)
                    if prepare is not None:  # tokcache-ar: the previous turn's output is recorded first
                        prepare(own)
                    # The previous call's ids are dropped before the clock starts: assigning over
                    # them inside the timed call would charge this contender for freeing whichever
                    # contender's list came before (~15k ints each; fresh ones cost a free apiece).
                    ids = None
                    gc.disable()
                    try:
                        t0 = time.perf_counter_ns()
                        ids = c.encode(own)
                        ns = time.perf_counter_ns() - t0
                    except Exception as exc:  # noqa: BLE001 - a failing contender is reported, others go on
                        e.status, e.reason = "failed", f"conv {ci} turn {turn}: {type(exc).__name__}: {exc}"
                        loud(f"{c.name} FAILED mid-run at {e.reason}")
                        exit_code = 1
                        continue
                    finally:
                        gc.enable()
                    info = dict(c.last_info())
                    e.samples.append(Sample(ci, turn, ns, pos, info))
                    if c.checked:
                        e.checked_calls += 1
                        want = smg_refs[ti] if c is smg else refs[ti]
                        if ids != want:
                            e.mismatches += 1
                            exit_code = 1
                            i = common_prefix(ids, want)
                            info = {
                                "contender": c.name,
                                "conv": ci,
                                "turn": turn,
                                "first_diff": i,
                                "got_len": len(ids),
                                "want_len": len(want),
                                "got": ids[max(0, i - 3) : i + 5],
                                "want": want[max(0, i - 3) : i + 5],
                            }
                            mismatch_log.append(info)
                            loud(
                                f"ID MISMATCH: {c.name} conv {ci} turn {turn}: first difference at index {i} "
                                f"(got {len(ids)} ids, reference {len(want)})\n  got  ...{info['got']}\n"
                                f"  want ...{info['want']}"
                            )
            if tty:
                print(file=sys.stderr)
            if tc is not None and any(e.contender is tc and e.status == "ok" for e in entries):
                shm.append({"conv": ci, **tc.shm_usage()})
            if smg is not None and any(e.contender is smg and e.status == "ok" for e in entries):
                smg_metrics.append(smg.metrics())
    finally:
        for e in reversed(entries):
            try:
                e.contender.close()
            except Exception as exc:  # noqa: BLE001 - keep closing the others
                print(f"closing {e.contender.name}: {exc}", file=sys.stderr)
    if tc is not None and tc.exit_code not in (None, 0, -15):
        print(f"note: tokcache sidecar exited with {tc.exit_code} on SIGTERM", file=sys.stderr)

    result = summarise(
        args,
        tok_dir,
        convs,
        texts,
        ref_tokens,
        entries,
        tc,
        smg,
        shm,
        smg_metrics,
        specials_differ,
        smg_add,
        mismatch_log,
        time.time() - started_at,
    )
    result["exit_code"] = exit_code
    out_json = args.out_dir / "multiturn_latency.json"
    out_json.write_text(json.dumps(result, indent=1))
    png = plot(result, args.out_dir / "multiturn_latency.png")
    print_report(result)
    print(f"\nwrote {out_json}" + (f" and {png}" if png else ""))
    if exit_code:
        print(
            "EXIT 1: "
            + (
                "; ".join(f"{m['contender']} mismatch conv {m['conv']} turn {m['turn']}" for m in mismatch_log[:5])
                or "a contender failed (see above)"
            ),
            file=sys.stderr,
        )
    return exit_code


def buckets(turns: int) -> list[tuple[int, int]]:
    out = [(1, 1)]
    lo = 2
    for hi in (10, 20, 30, 40):
        if lo > turns:
            break
        out.append((lo, min(hi, turns)))
        lo = hi + 1
    if lo <= turns:
        out.append((lo, turns))
    return out


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def summarise(
    args: argparse.Namespace,
    tok_dir: Path,
    convs: list[conversations.Conversation],
    texts: list[list[str]],
    ref_tokens: list[list[int]],
    entries: list[Entry],
    tc: TokcacheContender | None,
    smg: SmgContender | None,
    shm: list[dict[str, Any]],
    smg_metrics: list[dict[str, float]],
    specials_differ: bool,
    smg_add: bool | None,
    mismatch_log: list[dict[str, Any]],
    wall_s: float,
) -> dict[str, Any]:
    turns = max(len(t) for t in texts)
    res: dict[str, Any] = {
        "benchmark": "multiturn_latency",
        "config": {
            "conversations": len(texts),
            "turns": turns,
            "seed": args.seed,
            "target_bytes": args.target_bytes,
            "tokenizer_dir": str(tok_dir),
            "tokenizer_name": args.tokenizer_name,
            "add_special_tokens": args.add_special_tokens,
            "quick": args.quick,
            "order": "shuffled: turn step s runs random.Random(s).sample(contenders, n)",
            "latency": "client-observed, from the call until a list[int] is held; one call per contender per turn",
            "summary_turns": f">= {args.summary_from}",
            "long": args.long,
        },
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "tokenizers": _version("tokenizers"),
            "fastokens": _version("fastokens"),
            "grpcio": _version("grpcio"),
            "smg": "1.13.0" if smg is not None else None,
            "loadavg_at_start": list(os.getloadavg()),
        },
        "wall_seconds": round(wall_s, 1),
        "conversation_sizes": [
            {
                "seed": c.seed,
                "chars": [len(t) for t in ts],
                "bytes": [len(t.encode()) for t in ts],
                "tokens": toks,
                "kinds": c.kinds[: len(ts)],
                "rewritten_turns": [r for r in c.rewritten_turns() if r <= len(ts)],
            }
            for c, ts, toks in zip(convs, texts, ref_tokens, strict=True)
        ],
        "smg_add_special_tokens": smg_add,
        "smg_add_special_tokens_note": "SMG did not run"
        if smg is None or not any(e.contender is smg and e.samples for e in entries)
        else (
            "SMG's /v1/tokenize takes no add_special_tokens (the field is ignored); "
            + (
                f"probed, it encodes as add_special_tokens={smg_add} and is checked against that reference"
                + ("" if smg_add in (None, args.add_special_tokens) else f", not this run's {args.add_special_tokens}")
                if specials_differ
                else "this tokenizer adds no BOS/EOS, so True and False give identical ids "
                "and SMG is checked against the same reference as the others"
            )
        ),
        "mismatches": mismatch_log,
        "contenders": {},
    }
    for e in entries:
        c = e.contender
        late = [s.ns / 1000 for s in e.samples if s.turn >= args.summary_from]
        per_turn = []
        for t in range(1, turns + 1):
            vals = [s.ns / 1000 for s in e.samples if s.turn == t]
            per_turn.append(percentile(vals, 50))
        res["contenders"][c.name] = {
            "label": c.label,
            "status": e.status,
            "reason": e.reason,
            "ids_checked": c.checked,
            "checked_calls": e.checked_calls,
            "mismatches": e.mismatches,
            "per_turn_p50_us": per_turn,
            "buckets": {
                f"{lo}-{hi}": percentile([s.ns / 1000 for s in e.samples if lo <= s.turn <= hi], 50)
                for lo, hi in buckets(turns)
            },
            "summary_turns_ge2": {
                "n": len(late),
                "p50_us": percentile(late, 50),
                "p90_us": percentile(late, 90),
                "mean_us": sum(late) / len(late) if late else None,
            },
            "samples": [
                {"conv": s.conv, "turn": s.turn, "us": round(s.ns / 1000, 2), "position": s.position, **s.info}
                for s in e.samples
            ],
        }
        if isinstance(c, FastokensContender) and e.status == "ok":
            try:
                res["contenders"][c.name]["segment_cache_stats"] = c.stats()
            except Exception:  # noqa: BLE001 - closed tokenizers may not report
                pass
    summ = {k: v["summary_turns_ge2"] for k, v in res["contenders"].items() if v["summary_turns_ge2"]["n"]}
    ratios: dict[str, dict[str, float]] = {}
    nums = ("tokcache", "tokcache-ar", "tokcache-rpc", "tokcache-rpc-unary", "smg")
    for num in nums:
        if num not in summ:
            continue
        for den in ("smg", "fastokens", "fastokens+seg", "tokenizers", "tokcache", "tokcache-rpc"):
            if den != num and den in summ:
                ratios[f"{num}/{den}"] = {q: summ[num][q] / summ[den][q] for q in ("p50_us", "p90_us")}
    for srv in ("tokcache-rpc", "smg"):
        if srv in summ and f"{srv}-floor" in summ:
            ratios[f"{srv}-floor/{srv}"] = {q: summ[f"{srv}-floor"][q] / summ[srv][q] for q in ("p50_us", "p90_us")}
    res["ratios"] = ratios

    if tc is not None and "tokcache" in res["contenders"]:
        late = [s for s in res["contenders"]["tokcache"]["samples"] if s["turn"] >= args.summary_from]
        srcs = Counter(_source_name(s.get("source")) for s in late)
        hits = srcs.get("l1", 0) + srcs.get("l0", 0)
        enc = [
            s["encoded_chars"] / len(texts[s["conv"]][s["turn"] - 1])
            for s in late
            if s.get("encoded_chars") is not None
        ]
        deltas = []
        for before, after in zip(shm, shm[1:], strict=False):
            d: dict[str, Any] = {"conv": after["conv"]}
            for k in ("used_bytes", "resident_bytes"):
                if before.get(k) is not None and after.get(k) is not None:
                    d[k] = after[k] - before[k]
            deltas.append(d)
        res["tokcache"] = {
            "l1_hit_share_turns_ge2": hits / len(late) if late else None,
            "sources_turns_ge2": dict(srcs),
            "encoded_char_share_turns_ge2": (sum(enc) / len(enc)) if enc else None,
            "shm_snapshots": shm,
            "shm_per_conversation": deltas,
            "shm_target_bytes": SHM_TARGET_BYTES,
            "shm_prefix": tc.shm_prefix,
        }
    if smg is not None and len(smg_metrics) >= 2:
        first, last = smg_metrics[0], smg_metrics[-1]

        def delta(key: str) -> float:
            return last.get(key, 0.0) - first.get(key, 0.0)

        l1h = delta('smg_tokenizer_cache_lookups_total{layer="l1",result="hit"}')
        l1m = delta('smg_tokenizer_cache_lookups_total{layer="l1",result="miss"}')
        rss = [
            b.get("vm_rss_bytes", 0.0) - a.get("vm_rss_bytes", 0.0)
            for a, b in zip(smg_metrics, smg_metrics[1:], strict=False)
        ]
        res["smg"] = {
            "l1_lookups": {"hit": l1h, "miss": l1m},
            "l0_lookups": {
                "hit": delta('smg_tokenizer_cache_lookups_total{layer="l0",result="hit"}'),
                "miss": delta('smg_tokenizer_cache_lookups_total{layer="l0",result="miss"}'),
            },
            "l1_reused_bytes": delta('smg_tokenizer_cache_reused_bytes_total{layer="l1"}'),
            "rss_growth_per_conversation": rss,
            # Kept-alive connections SMG had closed while idle, opened again (in a timed call).
            "reconnects": smg.reconnects,
            "metrics_first": first,
            "metrics_last": last,
        }
    return res


def _source_name(src: Any) -> str:
    """ "l1" for "l1", "L1", CacheSource.L1 or CACHE_SOURCE_L1 alike."""
    s = str(getattr(src, "name", src)).lower()
    for name in ("miss", "l0", "l1", "ar"):
        if s == name or s.endswith("_" + name) or s.endswith("." + name):
            return name
    return s


def _us(v: float | None) -> str:
    if v is None or v != v:
        return "—"
    return f"{v / 1000:.2f} ms" if v >= 10_000 else f"{v:.0f} µs"


def print_report(r: dict[str, Any]) -> None:
    cs = r["contenders"]
    names = [n for n, c in cs.items() if c["samples"]]
    cfg = r["config"]
    sizes = r["conversation_sizes"]
    print(
        f"\n== multiturn_latency: {cfg['conversations']} conversation(s) x {cfg['turns']} turns, "
        f"{cfg['tokenizer_name']} tokenizer, add_special_tokens={cfg['add_special_tokens']} =="
    )
    last = ", ".join(f"{s['bytes'][-1] / 1000:.1f} KB / {s['tokens'][-1]} tokens" for s in sizes)
    print(f"last turn: {last}; template rewrites history at turns {[s['rewritten_turns'] for s in sizes]}")
    env = r["environment"]
    print(
        f"{env['cpus']} CPUs, load average at start {env['loadavg_at_start'][0]:.2f}; "
        f"tokenizers {env['tokenizers']}, fastokens {env['fastokens']}, grpcio {env['grpcio']}"
    )
    print(f"contender order: {cfg['order']}")
    for n, c in cs.items():
        if c["status"] != "ok":
            print(f"!! {n}: {c['status'].upper()}: {c['reason'].splitlines()[0] if c['reason'] else ''}")
    print("\np50 latency per turn bucket (across conversations):")
    w = max(14, *(len(n) + 2 for n in names))
    print(f"{'turns':<8}{'~KB':>7}" + "".join(f"{n:>{w}}" for n in names))
    for key in cs[names[0]]["buckets"] if names else []:
        lo, hi = (int(x) for x in key.split("-"))
        kb = [b / 1000 for s in sizes for b in s["bytes"][lo - 1 : hi]]
        print(
            f"{key:<8}{sum(kb) / max(1, len(kb)):>7.1f}" + "".join(f"{_us(cs[n]['buckets'][key]):>{w}}" for n in names)
        )
    print(f"\nsummary, turns {cfg.get('summary_turns', '>= 2')}:")
    wn = max(16, *(len(n) + 2 for n in names))
    print(f"{'contender':<{wn}}{'p50':>11}{'p90':>11}{'mean':>11}{'n':>5}  ids")
    for n in names:
        s = cs[n]["summary_turns_ge2"]
        ids = (
            f"checked {cs[n]['checked_calls']}, {cs[n]['mismatches']} mismatches"
            if cs[n]["ids_checked"]
            else "(floor: not checked)"
        )
        print(f"{n:<{wn}}{_us(s['p50_us']):>11}{_us(s['p90_us']):>11}{_us(s['mean_us']):>11}{s['n']:>5}  {ids}")
    if r["ratios"]:
        print("\nratios (p50, p90; < 1 means the first is faster):")
        for k, v in r["ratios"].items():
            print(f"  {k:<44}{v['p50_us']:>7.3f}{v['p90_us']:>8.3f}")
    if "tokcache" in r:
        t = r["tokcache"]
        share = t["l1_hit_share_turns_ge2"]
        print(
            f"\ntokcache: L1/L0 hit share (turns >= 2): {share:.1%}" if share is not None else "\ntokcache: no samples"
        )
        print(
            f"  sources: {t['sources_turns_ge2']}; mean share of chars encoded: "
            + (f"{t['encoded_char_share_turns_ge2']:.1%}" if t["encoded_char_share_turns_ge2"] is not None else "—")
        )
        served = Counter(s.get("served_by") for s in cs["tokcache"]["samples"])
        print(f"  served by: {dict(served)}")
        for d in t["shm_per_conversation"]:
            used, res_ = d.get("used_bytes"), d.get("resident_bytes")
            print(
                f"  shm for conversation {d['conv']}: used "
                + (
                    f"{used / 1024:.1f} KiB ({used / t['shm_target_bytes']:.2f}x the 128 KiB target)"
                    if used is not None
                    else "n/a"
                )
                + (f"; resident pages grew {res_ / 1024:.0f} KiB" if res_ is not None else "")
            )
        snap = t["shm_snapshots"][-1]
        if isinstance(snap.get("stats"), list) and snap["stats"]:
            st = snap["stats"][0]
            print(
                f"  segment after the run: used {st.get('used_bytes')} B, resident {st.get('resident_bytes')} B, "
                f"live entries {st.get('live_entries')}, index slots {st.get('index_slots')}"
            )
        errs = {s.get("stats_error") for s in t["shm_snapshots"] if s.get("stats_error")}
        if errs:
            print(f"  (tokcache-sidecar stats unavailable: {sorted(errs)[0][:200]}; resident = /dev/shm st_blocks)")
    if "smg" in r:
        s = r["smg"]
        l1 = s["l1_lookups"]
        tot = l1["hit"] + l1["miss"]
        print(
            f"\nsmg: L1 lookups hit {l1['hit']:.0f} / miss {l1['miss']:.0f}"
            + (f" ({l1['hit'] / tot:.1%} hit)" if tot else "")
            + f"; L0 hit {s['l0_lookups']['hit']:.0f} (its metrics, whole run incl. floor calls)"
            + (f"; {s['reconnects']} idle connection(s) it closed opened again, inside a timed call"
               if s.get("reconnects") else "")
        )
        print(
            "  RSS growth per conversation (VmRSS, page-granular, includes allocator slack): "
            + ", ".join(f"{h / 1024:.0f} KiB" for h in s["rss_growth_per_conversation"])
        )
    print(f"\n{r['smg_add_special_tokens_note']}.")
    bad = [n for n in names if cs[n]["mismatches"]]
    print(
        "ids: "
        + ("MISMATCHES in " + ", ".join(bad) if bad else "every checked call matched the tokenizers reference")
        + f"; wall {r['wall_seconds']} s"
    )


def plot(r: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(10, 6))
    turns = list(range(1, r["config"]["turns"] + 1))
    for name, c in r["contenders"].items():
        ys = c["per_turn_p50_us"]
        if not any(y is not None for y in ys):
            continue
        xs = [t for t, y in zip(turns, ys, strict=True) if y is not None]
        ys = [y / 1000 for y in ys if y is not None]
        ax.plot(xs, ys, marker="o", markersize=3, label=c["label"], linestyle="--" if name.endswith("floor") else "-")
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("p50 latency across conversations (ms, log)")
    ax.grid(True, which="both", alpha=0.3)
    kb = [
        sum(s["bytes"][t - 1] for s in r["conversation_sizes"] if len(s["bytes"]) >= t)
        / 1000
        / sum(1 for s in r["conversation_sizes"] if len(s["bytes"]) >= t)
        for t in turns
    ]
    ax2 = ax.twinx()
    ax2.plot(turns, kb, color="grey", alpha=0.35, linewidth=4, label="prompt size (KB, right axis)")
    ax2.set_ylabel("prompt size (KB)", color="grey")
    lines = ax.get_legend_handles_labels()
    extra = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + extra[0], lines[1] + extra[1], fontsize=8, loc="upper left")
    cfg = r["config"]
    ax.set_title(
        f"Per-turn tokenization latency, {cfg['conversations']} agent conversation(s), "
        f"{cfg['tokenizer_name']} tokenizer"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
