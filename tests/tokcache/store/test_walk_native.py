"""The chain walk in C (``tokcache.store._speedups.walk``, behind ``Log.walk_known``) against
its Python reference (``Log._walk_known``), on the same segment: random chains, records
evicted under them, stray and torn bytes, what a reader holds (``known``), MAX_CHAIN."""

from __future__ import annotations

import mmap
import random
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from tokcache.native import pure_python
from tokcache.store import Kind, RecordRef, Store, Walk
from tokcache.store import _log as log_mod
from tokcache.store._layout import ID_WIDTHS, LSN_BITS, geometry_for
from tokcache.store._log import CORRUPT, EVICTED, MAX_CHAIN
from tokcache.store._segment import shm_path

pytestmark = pytest.mark.skipif(pure_python(), reason="TOKCACHE_PURE_PYTHON=1: no native walk")

Open = Callable[..., Store]
Known = Callable[[int, bytes], "tuple[Any, int, int] | None"]


def _ids(rng: random.Random, n: int) -> bytes:
    """``n`` packed u32 ids below 2**24 (both widths store them), every byte but the top random."""
    out = bytearray(rng.randbytes(4 * n))
    out[3::4] = bytes(n)
    return bytes(out)


def _lsn_kind(store: Store, key: bytes) -> int | None:
    """What the index holds for ``key`` (stale or not): the walk's start."""
    soff = store._index.find(key)
    return None if soff < 0 else store._index.read(soff)[0]


def _both(store: Store, key: bytes, lsn_kind: int, known: Known | None) -> tuple[Walk | int, Walk | int]:
    """(native walk, Python walk) of ``key`` from ``lsn_kind``; each side's calls of ``known``
    must be the same (the same records asked about, in the same order)."""
    calls: list[list[tuple[int, bytes]]] = [[], []]
    out: list[Walk | int] = []
    for side, walk in enumerate((store._log.walk_known, store._log._walk_known)):
        if known is None:
            out.append(walk(key, lsn_kind, None))
            continue

        def asked(lsn: int, check: bytes, side: int = side) -> tuple[Any, int, int] | None:
            calls[side].append((lsn, bytes(check)))
            return known(lsn, check)

        out.append(walk(key, lsn_kind, asked))
    assert calls[0] == calls[1], key.hex()
    return out[0], out[1]


def _outcome(got: Walk | int) -> str:
    if isinstance(got, int):
        return {EVICTED: "evicted", CORRUPT: "corrupt"}[got]
    return "held" if got.held is not None else "whole"


@pytest.mark.parametrize("id_bytes", ID_WIDTHS)
def test_native_walk_equals_the_python_walk_on_random_chains(open_store: Open, id_bytes: int) -> None:
    """Random chains in a small segment (the log wraps: the oldest records and the floors of
    chains built on them are evicted), each walked from its index slot by both walks, with and
    without a ``known`` that holds some records (and wrongly sized claims on others, which must
    not stop a walk), before and after bytes of live records are flipped or zeroed (a torn
    record). Same Walk or the same failure, and the same questions to ``known``; every outcome
    (whole chain, stop at a held record, evicted, corrupt) occurs."""
    outcomes: Counter[str] = Counter()
    for seed in range(12):
        rng = random.Random(f"walk-{id_bytes}-{seed}")
        store = open_store(size=64 << 10, fingerprint=uuid.uuid4().hex, id_bytes=id_bytes)
        keys: list[bytes] = []
        tokens: dict[bytes, int] = {}  # key -> its chain's tokens, as last put
        refs: list[RecordRef] = []
        for _ in range(600):
            parent = rng.choice(keys) if keys and rng.random() < 0.8 else None
            base = tokens[parent] if parent is not None else 0
            n_ids = rng.randint(1, 40)
            entries = []
            for _ in range(rng.randint(1, 3)):
                k = uuid.UUID(int=rng.getrandbits(128)).bytes if rng.random() < 0.7 or not keys else rng.choice(keys)
                entries.append((k, rng.randint(0, n_ids)))
            kind = rng.choice(list(Kind))
            ref = store.put(parent, base, _ids(rng, n_ids), entries, kind)
            if ref is None:  # the parent fell off the log: nothing written
                continue
            refs.append(ref)
            for k, n in entries:
                if k not in tokens:
                    keys.append(k)
                tokens[k] = base + n
        assert store.stats().evictions > 0  # the log wrapped: chains lost their oldest records
        # What a reader holds: some records whole (its true base and n), others with a claim
        # that must not stop a walk (another base, fewer ids than the chain uses).
        held: dict[tuple[int, bytes], tuple[object, int, int]] = {}
        for ref in rng.sample(refs, len(refs) // 3):
            wrong = rng.random() < 0.3
            held[(ref.lsn, ref.check)] = (object(), ref.base + (1 if wrong and rng.random() < 0.5 else 0),
                                          ref.n - (1 if wrong else 0))

        def known(lsn: int, check: bytes, held: dict[tuple[int, bytes], tuple[object, int, int]] = held
                  ) -> tuple[Any, int, int] | None:
            return held.get((lsn, bytes(check)))

        for damaged in (False, True):
            if damaged:
                arena = geometry_for(store.size).arena_off
                head, tail = store._log.bounds()
                with open(shm_path(store.name), "r+b") as f, mmap.mmap(f.fileno(), 0) as raw:
                    for _ in range(12):
                        at = arena + rng.randrange(tail, head) % store._log.size
                        if rng.random() < 0.5:
                            raw[at] ^= 1 << rng.randrange(8)  # a stray bit
                        else:
                            raw[at:at + 16] = bytes(len(raw[at:at + 16]))  # a torn write: zeros
            for k in keys:
                lsn_kind = _lsn_kind(store, k)
                if lsn_kind is None:
                    continue
                for kn in (None, known):
                    native, python = _both(store, k, lsn_kind, kn)
                    assert native == python, (seed, damaged, k.hex())
                    outcomes[_outcome(native)] += 1
                # A slot read under a writer that reused it: another key's record, a wrong kind.
                other = rng.choice(keys)
                for start in (_lsn_kind(store, other), lsn_kind ^ (1 << LSN_BITS)):
                    if start is not None:
                        native, python = _both(store, k, start, known)
                        assert native == python, (seed, damaged, k.hex(), other.hex())
    assert all(outcomes[o] >= 100 for o in ("whole", "held", "evicted", "corrupt")), outcomes


def test_a_chain_longer_than_max_chain_is_corrupt_to_both_walks(open_store: Open) -> None:
    """A chain of MAX_CHAIN records reads (both walks, the same ids); one more link and it is
    corrupt to both (a reader's bound on the records it follows); a reader that holds a record
    near the key's stops there, within the bound, on both."""
    store = open_store(size=2 << 20)
    rng = random.Random("max-chain")
    keys: list[bytes] = []
    refs: list[RecordRef] = []
    parent: bytes | None = None
    for depth in range(MAX_CHAIN + 1):
        k = uuid.UUID(int=rng.getrandbits(128)).bytes
        ref = store.put(parent, depth, _ids(rng, 1), [(k, 1)], Kind.L1)
        assert ref is not None, depth
        keys.append(k)
        refs.append(ref)
        parent = k
    deepest, too_deep = keys[MAX_CHAIN - 1], keys[MAX_CHAIN]
    for k, want in ((deepest, "whole"), (too_deep, "corrupt")):
        lsn_kind = _lsn_kind(store, k)
        assert lsn_kind is not None
        native, python = _both(store, k, lsn_kind, None)
        assert native == python and _outcome(native) == want
        if want == "whole":
            assert isinstance(native, Walk) and native.depth == MAX_CHAIN and len(native.rest) == 4 * MAX_CHAIN
    mark = object()
    near = refs[MAX_CHAIN - 2]

    def known(lsn: int, check: bytes) -> tuple[Any, int, int] | None:
        return (mark, near.base, near.n) if (lsn, bytes(check)) == (near.lsn, near.check) else None

    lsn_kind = _lsn_kind(store, too_deep)
    assert lsn_kind is not None
    native, python = _both(store, too_deep, lsn_kind, known)
    assert native == python and isinstance(native, Walk) and native.held is mark
    assert native.held_tokens == MAX_CHAIN - 1 and len(native.rest) == 4 * 2


def test_max_chain_is_read_at_each_call(open_store: Open, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both walks take the bound from ``_log.MAX_CHAIN`` when called (the C one as an argument):
    a lower bound makes a shorter chain corrupt to both, at the same depth."""
    store = open_store()
    rng = random.Random("bound")
    parent: bytes | None = None
    keys = []
    for depth in range(8):
        k = uuid.UUID(int=rng.getrandbits(128)).bytes
        assert store.put(parent, depth, _ids(rng, 2), [(k, 1)], Kind.L1) is not None
        keys.append(k)
        parent = k
    monkeypatch.setattr(log_mod, "MAX_CHAIN", 5)
    got = []
    for k in keys:
        lsn_kind = _lsn_kind(store, k)
        assert lsn_kind is not None
        native, python = _both(store, k, lsn_kind, None)
        assert native == python
        got.append(_outcome(native))
    assert got == ["whole"] * 5 + ["corrupt"] * 3
