"""Micro-benchmark of tokcache.store: get miss, get hit (1 link / 40-link chain), put; the key
pass and record checks.

Builds a 40-turn conversation (~11k ids, one record per turn with 5 boundary keys each),
as the engine would, then times each operation. Then the hashing a request and a write do:
the keys of a 57 KB and a 400 KB text (a digest at every keyed cut, ~2 KB apart, and the
whole-text key: ``TextKeys.scan_tail``, the Python driver of the pass the engine extension
makes in C), and record checks (``check_of``) of 1 KB to 400 KB. Prints microseconds per call.

    python bench/store_micro.py [--size-mb 64] [--repeat 20000] [--keys-only]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import random
import struct
import time
import uuid
from collections.abc import Callable

from tokcache.store import Kind, Store, _layout
from tokcache.store.keys import KEY_GRID, MODE_KV_STABLE, TextKeys

TURNS = 40
IDS_PER_TURN = 275  # 40 x 275 = 11,000 ids
KEYS_PER_PUT = 5


def key(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()[:16]


def ids_bytes(rng: random.Random, n: int) -> bytes:
    return struct.pack(f"<{n}I", *(rng.randrange(150_000) for _ in range(n)))


def per_call(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / repeat * 1e6


def chat_text(rng: random.Random, size: int) -> tuple[bytes, list[tuple[int, int]]]:
    """~``size`` bytes of chat-like UTF-8 and its boundary spans: a special token every
    40-400 bytes, as a rendered agent conversation has (one key per KEY_GRID bytes of them)."""
    words = ("the", "cache", "tokens", "prefix", "agent", "tool", "über", "日本語", "x = 1", "{\"k\": 2}")
    out = bytearray()
    spans = []
    while len(out) < size:
        end = len(out) + rng.randrange(40, 400)
        while len(out) < end:
            out += rng.choice(words).encode() + b" "
        spans.append((len(out), len(out) + 10))
        out += b"<|im_end|>"
    return bytes(out), spans


def _scan_keys(data: bytes, spans: list[tuple[int, int]]) -> None:
    TextKeys(data, spans, "", MODE_KV_STABLE).scan_tail(0)


def key_pass(repeat: int) -> None:
    """The keys of one text from scratch, and record checks, in µs per call."""
    rng = random.Random(11)
    for size in (57 << 10, 400 << 10):
        data, spans = chat_text(rng, size)
        n_keyed = len(TextKeys(data, spans, "", MODE_KV_STABLE).keyed)
        cost = per_call(functools.partial(_scan_keys, data, spans), max(repeat * 50 // size, 20))
        print(f"keys, {len(data) >> 10:3d} KB text  {cost:8.2f} us  ({n_keyed} keyed cuts, KEY_GRID {KEY_GRID})")
    for size in (1 << 10, 16 << 10, 64 << 10, 400 << 10):
        body = rng.randbytes(size)
        cost = per_call(functools.partial(_layout.check_of, body), max(repeat * 50 // size, 20))
        print(f"check, {size >> 10:3d} KB record {cost:8.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=20000)
    parser.add_argument("--keys-only", action="store_true", help="only the key pass and record checks")
    args = parser.parse_args()
    if args.keys_only:
        key_pass(args.repeat)
        return
    rng = random.Random(7)
    prefix = f"tkbench{os.getpid()}-{uuid.uuid4().hex[:6]}"
    store = Store.open(prefix=prefix, fingerprint=uuid.uuid4().hex, size=args.size_mb << 20)
    try:
        parent: bytes | None = None
        tokens = 0
        last = b""
        for turn in range(TURNS):
            ids = ids_bytes(rng, IDS_PER_TURN)
            step = IDS_PER_TURN // KEYS_PER_PUT
            entries = [(key(f"c0-t{turn}-b{b}"), (b + 1) * step) for b in range(KEYS_PER_PUT)]
            assert store.put(parent, tokens, ids, entries, Kind.L1)
            parent, last = entries[-1][0], entries[-1][0]
            tokens += IDS_PER_TURN
        first = key("c0-t0-b4")
        chain = store.get(last)
        assert chain is not None and len(chain) == 4 * TURNS * IDS_PER_TURN
        missing = key("absent")
        r = args.repeat
        print(f"get miss            {per_call(lambda: store.get(missing), r):8.2f} us")
        print(f"get hit, 1 link     {per_call(lambda: store.get(first), r):8.2f} us")
        print(f"get hit, {TURNS} links   {per_call(lambda: store.get(last), r // 10):8.2f} us  ({len(chain) // 4} ids)")
        # put: a new turn on top of the conversation (as the engine does), and a record
        # without a parent; each with 5 fresh boundary keys.
        counter = iter(range(10**9))
        put_ids = ids_bytes(rng, IDS_PER_TURN)
        step = IDS_PER_TURN // KEYS_PER_PUT
        refused = 0

        def one_put(parent: bytes | None, parent_tokens: int) -> None:
            nonlocal refused
            i = next(counter)
            entries = [(key(f"p{i}-b{b}"), (b + 1) * step) for b in range(KEYS_PER_PUT)]
            refused += not store.put(parent, parent_tokens, put_ids, entries, Kind.L1)

        keys_cost = per_call(lambda: [key(f"p-b{b}") for b in range(KEYS_PER_PUT)], r // 10)
        for label, parent, parent_tokens in (("chained", last, tokens), ("no parent", None, 0)):
            cost = per_call(functools.partial(one_put, parent, parent_tokens), r // 10) - keys_cost
            print(f"put {label:9s} {cost:8.2f} us  (5 keys, {IDS_PER_TURN} ids)")
            store.get(last)  # keep the conversation alive on a small segment
        print(f"(put excludes {keys_cost:.2f} us to hash the bench's keys; {refused} puts refused)")
        stats = store.stats()
        print(f"arena {stats.arena_bytes} B, used {stats.used_bytes} B, puts {stats.puts}")
    finally:
        store.unlink()
        store.close()
    key_pass(args.repeat)


if __name__ == "__main__":
    main()
