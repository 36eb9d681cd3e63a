"""The native steady-state path (``tokcache.engine._speedups``: ``extend``, ``cut_tokens``)
against the Python it replaces (``lookup.py`` with ``_native`` off: the reference).

Two client lookups read the same segment, one with the native path and one without, each
with its own memo: along long chats (exact and kv-stable, with and without special tokens,
a salt, rewritten turns) they return the same ids, the same decision and the same pending
write, and the native path does serve most turns (else this would test nothing). Some turns
are read by a third lookup (another process: its own memo and scans), so the native side
also serves texts that extend none it read (hashed from the namespace's root) and chains
another process stored (read from the segment, not held). The native side hands its caller
a list the caller then mutates.
"""

from __future__ import annotations

import bisect
import gc
import hashlib
import random
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tokcache.engine import ids as ids_mod
from tokcache.engine import lookup as lookup_mod
from tokcache.engine.boundaries import Scan
from tokcache.engine.errors import InvalidRequest
from tokcache.engine.ids import BYTES, LISTS, Chunks, untrack
from tokcache.engine.lookup import Decision, Lookup, ReadModel, _cut_tokens, commit
from tokcache.engine.memo import ChainMemo
from tokcache.engine.tokenizer import Manifest, from_manifest
from tokcache.ids import pack_ids
from tokcache.native import pure_python
from tokcache.sidecar.engine.model import ModelEngine
from tokcache.store import Store, StoreReader
from tokcache.store.keys import namespace, output_key, pending_key

# The native path against the reference: nothing to compare where TOKCACHE_PURE_PYTHON=1 turns it off.
pytestmark = pytest.mark.skipif(pure_python(), reason="TOKCACHE_PURE_PYTHON=1: no native path")

WORDS = ("the", "cache", "tokens", "prefix", "agent", "tool", "call", "result", "über", "naïve", "日本語", "🎉",
         "x = 1", "def f():", "    return", "{\"k\": 2}", "- item", "**bold**")


def _para(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        out.append(rng.choice(WORDS))
        out.append(rng.choice((" ", " ", " ", "\n", "\n\n", ", ", ". ")))
    return "".join(out)


class _Counting:
    """``_native`` with ``extend``'s served calls counted (``with_ar``: those that found a live AR
    key; ``no_base``: texts that extend none this process read; ``not_held``: hits whose chain
    this process's memo does not hold)."""

    def __init__(self, native: Any) -> None:
        self._native, self.served, self.calls, self.with_ar = native, 0, 0, 0
        self.no_base = self.not_held = 0

    def extend(self, *args: Any) -> Any:
        got = self._native.extend(*args)
        self.calls += 1
        served = isinstance(got, tuple)  # (else why it declined: an int)
        self.served += served
        self.with_ar += served and got[-1] >= 0
        self.no_base += served and got[0] is None
        self.not_held += served and got[14] is None
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)


@pytest.fixture(scope="module", params=[("qwen3", 0), ("llama32", 0), ("qwen3", 256), ("llama32", 256)],
                ids=lambda p: f"{p[0]}-grid{p[1]}")
def engine(request: pytest.FixtureRequest) -> ModelEngine:
    name, grid = request.param
    kwargs = {"key_grid": grid} if grid else {}
    return ModelEngine(name, Path(request.getfixturevalue(f"{name}_path")), store=None, **kwargs)


@pytest.fixture(scope="module")
def model(engine: ModelEngine) -> Iterator[ReadModel]:
    """The client's ReadModel, from the manifest a segment publishes."""
    yield from _read_model(engine)


@pytest.fixture(scope="module")
def own_model(engine: ModelEngine) -> Iterator[ReadModel]:
    """Another, with a scan memo of its own (the texts its process read: what the next extends)."""
    yield from _read_model(engine)


@pytest.fixture(scope="module")
def other_model(engine: ModelEngine) -> Iterator[ReadModel]:
    """A third: another process's, which reads some turns of the conversations the others read."""
    yield from _read_model(engine)


def _read_model(engine: ModelEngine) -> Iterator[ReadModel]:
    store = Store.open(prefix=f"tkt-fast-{uuid.uuid4().hex[:8]}", fingerprint=engine.fingerprint, size=4 << 20,
                       id_bytes=3)
    engine.store = store
    try:
        assert engine.publish([engine.name])
        reader = StoreReader.attach_name(store.name)
        try:
            yield from_manifest(engine.tokenizer_json, Manifest.from_bytes(reader.manifest() or b""))
        finally:
            reader.close()
    finally:
        engine.store = None
        store.unlink()
        store.close()


@contextmanager
def _segment(engine: ModelEngine) -> Iterator[tuple[Store, StoreReader]]:
    """A fresh 16 MiB segment for ``engine``'s tokenizer and a read-only mapping of it (both gone after)."""
    store = Store.open(prefix=f"tkt-fast-{uuid.uuid4().hex[:8]}", fingerprint=engine.fingerprint, size=16 << 20,
                       id_bytes=3)
    reader = StoreReader.attach_name(store.name)
    try:
        yield store, reader
    finally:
        reader.close()
        store.unlink()
        store.close()


# Turns read by another process (``other``): the conversation starts there, then comes back
# every few turns. The first turn read here extends nothing this process read; each turn after
# another process's hits the chain that process stored, which this one does not hold.
_OTHER_TURNS = (0, 1, 2, 7, 12, 16, 20)


@pytest.mark.parametrize("defer", [False, True], ids=["settled", "deferred"])
@pytest.mark.parametrize("mode,add,salt,record", [("exact", False, "", False), ("exact", True, "t", False),
                                                  ("kv-stable", False, "", False), ("kv-stable", True, "tenant", False),
                                                  ("kv-stable", False, "", True), ("kv-stable", False, "tenant", True)],
                         ids=["exact", "exact-add-salt", "kv", "kv-add-salt", "kv-recorded", "kv-recorded-salt"])
def test_native_and_python_paths_agree_along_long_chats(engine: ModelEngine, model: ReadModel, own_model: ReadModel,
                                                        other_model: ReadModel, mode: str, add: bool, salt: str,
                                                        record: bool, defer: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``deferred``: the native side returns its bookkeeping (Result.later), which is settled
    after the caller got, and mutated, its list; it must make the same write as settling at
    once. ``recorded``: each answer is recorded (the sidecar's RecordOutput, into the same
    segment) before the next turn, as vLLM's outputs are, so the native path makes AR keys and
    the prefix AR hit decides. Turns in _OTHER_TURNS are read by another process's lookup
    (native too, checked against the reference the same way), which stores their entries."""
    counting = _Counting(lookup_mod._native)
    monkeypatch.setattr(lookup_mod, "_native", counting)
    with _segment(engine) as (store, reader):
        fast_memo: ChainMemo[Chunks] = ChainMemo(LISTS)
        ref_memo: ChainMemo[Chunks] = ChainMemo(LISTS)
        fast: Lookup[Chunks, list[int]] = Lookup(own_model, reader, fast_memo, defer=defer)
        ref: Lookup[Chunks, list[int]] = Lookup(model, reader, ref_memo)
        other: Lookup[Chunks, list[int]] = Lookup(other_model, reader, ChainMemo(LISTS))
        rng = random.Random(f"{engine.name}-{mode}-{add}-{salt}-{record}-{defer}")
        msgs: list[dict[str, Any]] = [{"role": "system", "content": _para(rng, 200)}]
        turns = 24
        eos = {"qwen3": "<|im_end|>", "llama32": "<|eot_id|>"}[engine.name]
        eos_id = engine.reference.encode(eos)
        assert len(eos_id) == 1
        recorded = ar_turns = spliced_turns = flat_scans = here = served_here = 0
        no_base = not_held = 0
        for turn in range(turns):
            msgs.append({"role": "user", "content": _para(rng, rng.randint(20, 400))})
            text = engine.render(msgs, add_generation_prompt=True)
            elsewhere = turn in _OTHER_TURNS
            reader_model = other_model if elsewhere else own_model
            before = (counting.served, counting.no_base, counting.not_held)
            if elsewhere:
                got = other.tokenize(text, add_special_tokens=add, salt=salt, mode=mode)
            else:
                here += 1
                got = fast.tokenize(text, add_special_tokens=add, salt=salt, mode=mode)
                served_here += counting.served - before[0]
                no_base += counting.no_base - before[1]
                not_held += counting.not_held - before[2]
            monkeypatch.setattr(lookup_mod, "_native", None)
            want = ref.tokenize(text, add_special_tokens=add, salt=salt, mode=mode)
            monkeypatch.setattr(lookup_mod, "_native", counting)
            assert got.ids == want.ids, (turn, got.decision, want.decision)
            assert want.later is None
            if defer and not elsewhere:
                assert got.write is None and got.later is not None, turn
                served = list(got.ids)
                got.ids.append(-1)  # the caller's list, changed before the bookkeeping ran
                got.ids[0] = -2
                got.write = fast.settle(got.later)
                got.ids = served
            # The text filed for the next turn: a native read keeps its spans flat (Spans), equal
            # to the Python path's list of the same text.
            got_scan, want_scan = reader_model.scanner.bases()[0][0], model.scanner.bases()[0][0]
            assert got_scan.data == want_scan.data == text.encode()
            assert got_scan.spans == want_scan.spans and list(got_scan.spans) == list(want_scan.spans), turn
            assert got_scan.stable == want_scan.stable and got_scan.tail == want_scan.tail, turn
            flat_scans += type(got_scan.spans) is lookup_mod._native.Spans
            ar_turns += got.decision.source == "ar"
            spliced_turns += got.decision.segment_splices > 0
            for name in ("source", "cached_tokens", "cached_chars", "encoded_chars", "boundaries", "l0_hit",
                         "l1_hit", "ar_prefix_hit", "ar_spliced_tokens", "segment_splices"):
                assert getattr(got.decision, name) == getattr(want.decision, name), (turn, name)
            if mode == "exact":
                full = engine.reference.encode_full(text) if add else engine.reference.encode(text)
                assert got.ids == full, turn
            assert (got.write is None) == (want.write is None), turn
            if got.write is not None and want.write is not None:
                assert got.write.parent == want.write.parent and got.write.parent_tokens == want.write.parent_tokens
                assert list(got.write.ids) == list(want.write.ids), turn
                assert got.write.entries() == want.write.entries(), turn
                # One side stores (as a client does); the reference's memo learns the record, the
                # reading process's memo holds it (commit).
                ref_ = commit(store, other.memo if elsewhere else fast_memo, got.write)
                if ref_ is not None:
                    ref_memo.put(ref_, ref_memo.fmt.compact(want.write.full),
                                 {e[0]: e[1] + ref_.n - len(want.write.ids) for e in want.write.entries()})
            got.ids.append(-1)  # the caller's own list: nothing the lookup keeps changes
            got.ids[0] = -2
            answer = _para(rng, rng.randint(5, 120))
            if record:  # the answer as generated: its text up to the stop token, and its ids
                after = engine.render([*msgs, {"role": "assistant", "content": answer},
                                       {"role": "user", "content": "x"}], add_generation_prompt=True)
                if after.startswith(text) and eos in after[len(text):]:
                    out = after[len(text):].split(eos)[0]
                    engine.store = store
                    try:
                        engine.record_output(prompt_text=text, prompt_ids=list(want.ids), output_text=out,
                                             output_ids=engine.reference.encode(out) + eos_id, salt=salt)
                    finally:
                        engine.store = None
                    recorded += 1
            if turn % 7 == 6:  # a rewritten history: the next text extends none of the latest
                msgs[1]["content"] += " (edited)"
            msgs.append({"role": "assistant", "content": answer})
        # The native path served the steady state here, not a turn or two: the first turn read
        # here (a text this process never read) and turns after another process's (chains it
        # stored) among them.
        assert served_here >= here // 2, (served_here, here, counting.calls)
        assert no_base >= 1 and not_held >= 3, (no_base, not_held)
        assert flat_scans == counting.served, (flat_scans, counting.served)  # every native read's scan
        if record:  # recorded outputs decided most turns, on both sides
            assert recorded >= turns - 2 and ar_turns >= turns // 2, (recorded, ar_turns)
            assert counting.with_ar >= turns // 3, (counting.with_ar, counting.served)
            assert spliced_turns >= 2, spliced_turns  # rewritten histories found earlier outputs (segment AR)


@pytest.mark.parametrize("mode", ["exact", "kv-stable"])
def test_many_conversations_in_flight_take_the_native_path(engine: ModelEngine, model: ReadModel,
                                                           own_model: ReadModel, mode: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A process serving many conversations at once (an API server: each turn of one comes
    between turns of the others) finds each one's previous turn among its latest texts: the
    native path serves every turn but a conversation's first, with the Python path's ids on
    the same segment. (With the 4 latest texts it kept before, 12 conversations in flight sent
    every such turn past the native path: its only other way in is the roots of a rewritten
    history; the Python path found them by anchor.)"""
    counting = _Counting(lookup_mod._native)
    monkeypatch.setattr(lookup_mod, "_native", counting)
    convs, turns = 12, 6
    with _segment(engine) as (store, reader):
        fast_memo: ChainMemo[Chunks] = ChainMemo(LISTS)
        fast: Lookup[Chunks, list[int]] = Lookup(own_model, reader, fast_memo, defer=True)
        ref: Lookup[Chunks, list[int]] = Lookup(model, reader, ChainMemo(LISTS))
        rng = random.Random(f"in-flight-{engine.name}-{mode}")
        chats: list[list[dict[str, Any]]] = [[{"role": "system", "content": f"agent {c}: " + _para(rng, 150)}]
                                             for c in range(convs)]
        for turn in range(turns):
            for c, msgs in enumerate(chats):
                msgs.append({"role": "user", "content": _para(rng, rng.randint(20, 200))})
                text = engine.render(msgs, add_generation_prompt=True)
                got = fast.tokenize(text, add_special_tokens=False, mode=mode)
                monkeypatch.setattr(lookup_mod, "_native", None)
                want = ref.tokenize(text, add_special_tokens=False, mode=mode)
                monkeypatch.setattr(lookup_mod, "_native", counting)
                assert got.ids == want.ids, (turn, c, got.decision, want.decision)
                if mode == "exact":
                    assert got.ids == engine.reference.encode(text), (turn, c)
                assert got.later is not None
                write = fast.settle(got.later)
                if write is not None:
                    commit(store, fast_memo, write)
                msgs.append({"role": "assistant", "content": _para(rng, rng.randint(5, 60))})
    assert counting.served >= convs * (turns - 1), (counting.served, counting.calls)


def test_a_live_mark_keeps_kv_stable_reads_on_the_native_path_which_finds_its_own_text_marked(
        engine: ModelEngine, model: ReadModel, own_model: ReadModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a pending-record mark (a response went before its record) may be live, kv-stable
    reads stay on the native path, which probes the marks of the text's own AR keys past the
    hit as the Python path does: another conversation's mark leaves ``ar_pending`` False, a
    mark on this conversation's last output makes it True (the caller then waits for the
    record), on the native path and the Python path alike, with the same ids. (Leaving every
    kv-stable read to the Python path while any mark lived kept make e2e's plugin server off
    the native path for ~21 s after each late record: 0 of 48 prompts read natively.)"""
    counting = _Counting(lookup_mod._native)
    monkeypatch.setattr(lookup_mod, "_native", counting)
    with _segment(engine) as (store, reader):
        fast_memo: ChainMemo[Chunks] = ChainMemo(LISTS)
        fast: Lookup[Chunks, list[int]] = Lookup(own_model, reader, fast_memo, defer=True)
        ref: Lookup[Chunks, list[int]] = Lookup(model, reader, ChainMemo(LISTS))
        rng = random.Random(f"marks-{engine.name}")
        msgs: list[dict[str, Any]] = [{"role": "system", "content": _para(rng, 150)}]
        last: list[str] = []  # the latest prompt
        own: list[bytes] = []  # the marks put on this conversation's outputs
        declined: list[str] = []  # each turn's Decision.declined

        def turn(mark_own: bool = False) -> tuple[bool, bool]:
            """One turn, checked against the Python path: (served natively, ar_pending). With
            ``mark_own``, the previous turn's output is marked as on its way first."""
            output = msgs[-1]["content"] if msgs[-1]["role"] == "assistant" else None
            msgs.append({"role": "user", "content": _para(rng, rng.randint(20, 200))})
            text = engine.render(msgs, add_generation_prompt=True)
            if mark_own:
                assert output is not None and text.startswith(last[-1] + output)
                own.append(pending_key(output_key(last[-1], output)))
                assert store.mark(own[-1], int(time.time()) + 30)
            last.append(text)
            served = counting.served
            got = fast.tokenize(text, add_special_tokens=False, mode="kv-stable")
            native = counting.served > served
            monkeypatch.setattr(lookup_mod, "_native", None)
            want = ref.tokenize(text, add_special_tokens=False, mode="kv-stable")
            monkeypatch.setattr(lookup_mod, "_native", counting)
            assert got.ids == want.ids, (got.decision, want.decision)
            assert got.decision.ar_pending == want.decision.ar_pending, (got.decision, want.decision)
            assert got.decision.native == native and (got.decision.declined == "") == native
            declined.append(got.decision.declined)
            assert got.later is not None
            write = fast.settle(got.later)
            if write is not None:
                commit(store, fast_memo, write)
            # (stripped: Llama 3.2's template trims it; the mark is put on the output as rendered)
            msgs.append({"role": "assistant", "content": _para(rng, rng.randint(5, 60)).strip()})
            return native, bool(got.decision.ar_pending)

        assert [turn() for _ in range(3)][1:] == [(True, False), (True, False)]
        assert not reader.marks_live(time.time())
        assert store.mark(bytes(range(1, 17)), int(time.time()) + 30)  # another text's output on its way
        assert reader.marks_live(time.time()) and store.marks_live(time.time())
        # The first read since: the Python path (the texts before it made no AR keys, which the
        # native call takes from its base's state), which makes them; then the native path.
        assert [turn(), turn()] == [(False, False), (True, False)]
        assert declined[0] == "no_window_hit" and declined[3] == "ar_keys", declined
        assert turn(mark_own=True) == (True, True)
        assert store.mark(own[-1], 1)  # withdrawn: its record was answered
        assert turn() == (True, False)


def test_a_read_the_native_path_declines_says_why(engine: ModelEngine, own_model: ReadModel,
                                                 other_model: ReadModel) -> None:
    """``Decision.declined`` names why the native path left a read to the Python path (the
    clients count it by reason): nothing cached in the probe window (a first turn), a text
    cached whole (L0, the Python path's to read); "" when the native path served it: also a
    text this process never read whose prefix another process stored (hashed from the
    namespace's root, its chain read from the segment)."""
    with _segment(engine) as (store, reader):
        memo: ChainMemo[Chunks] = ChainMemo(LISTS)
        lookup: Lookup[Chunks, list[int]] = Lookup(own_model, reader, memo)
        elsewhere: Lookup[Chunks, list[int]] = Lookup(other_model, reader, ChainMemo(LISTS))
        rng = random.Random(f"declined-{engine.name}")
        first = engine.render([{"role": "system", "content": _para(rng, 150)},
                               {"role": "user", "content": _para(rng, 80)}], add_generation_prompt=True)
        second = first + _para(rng, 40) + _para(rng, 200)

        def read(text: str, mode: str = "exact", lk: Lookup[Chunks, list[int]] = lookup) -> Decision:
            r = lk.tokenize(text, add_special_tokens=False, mode=mode)
            assert r.ids == engine.reference.encode(text)
            if r.write is not None:
                commit(store, lk.memo, r.write)
            return r.decision

        d = read(first)
        assert (d.source, d.native, d.declined) == ("miss", False, "no_window_hit")
        d = read(second)
        assert (d.native, d.declined) == (True, "")
        d = read(second)
        assert (d.source, d.native, d.declined) == ("l0", False, "l0")
        # Another process's conversation: stored there, its next turn read here first.
        theirs = engine.render([{"role": "system", "content": _para(rng, 150)},
                                {"role": "user", "content": _para(rng, 80)}], add_generation_prompt=True)
        read(theirs, lk=elsewhere)
        d = read(theirs + _para(rng, 40) + _para(rng, 200))
        assert (d.source, d.native, d.declined) == ("l1", True, ""), d
        with pytest.raises(InvalidRequest):
            read(second + "more", mode="no-such-mode")  # the Python path still refuses it


@pytest.mark.parametrize("mode,record", [("exact", False), ("kv-stable", False), ("kv-stable", True)],
                         ids=["exact", "kv", "kv-recorded"])
def test_the_sidecar_serves_rpc_text_natively(engine: ModelEngine, model: ReadModel, mode: str, record: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecar's own requests (``ModelEngine.tokenize``: the RPC path's entry, packed ids,
    settled and stored before the next request) take the native path as a client's do, with
    the ids and decision of the Python path on the same segment (a reference lookup that
    stores nothing, run first each turn so both see the same entries)."""
    counting = _Counting(lookup_mod._native)
    monkeypatch.setattr(lookup_mod, "_native", counting)
    with _segment(engine) as (store, reader):
        ref: Lookup[bytes, bytes] = Lookup(model, reader, ChainMemo(BYTES))
        engine.store = store
        try:
            rng = random.Random(f"sidecar-{engine.name}-{mode}-{record}")
            msgs: list[dict[str, Any]] = [{"role": "system", "content": _para(rng, 200)}]
            eos = {"qwen3": "<|im_end|>", "llama32": "<|eot_id|>"}[engine.name]
            turns = 16
            for turn in range(turns):
                msgs.append({"role": "user", "content": _para(rng, rng.randint(20, 300))})
                text = engine.render(msgs, add_generation_prompt=True)
                monkeypatch.setattr(lookup_mod, "_native", None)
                want = ref.tokenize(text, add_special_tokens=False, mode=mode)
                monkeypatch.setattr(lookup_mod, "_native", counting)
                got = engine.tokenize(text, add_special_tokens=False, mode=mode)  # stores its entries
                assert got.ids == want.ids, (turn, got.decision, want.decision)
                if mode == "exact":
                    assert got.ids == pack_ids(engine.reference.encode(text)), turn
                for name in ("source", "cached_tokens", "cached_chars", "encoded_chars", "boundaries", "l1_hit",
                             "ar_spliced_tokens"):
                    assert getattr(got.decision, name) == getattr(want.decision, name), (turn, name)
                answer = _para(rng, rng.randint(5, 80))
                if record:
                    after = engine.render([*msgs, {"role": "assistant", "content": answer},
                                           {"role": "user", "content": "x"}], add_generation_prompt=True)
                    if after.startswith(text) and eos in after[len(text):]:
                        out = after[len(text):].split(eos)[0]
                        engine.record_output(prompt_text=text, prompt_ids=got.ids, output_text=out,
                                             output_ids=engine.reference.encode(out) + engine.reference.encode(eos))
                msgs.append({"role": "assistant", "content": answer})
        finally:
            engine.store = None
        assert counting.served >= turns // 2, (counting.served, counting.calls)


_MARKUP = {"qwen3": ("<|im_end|>\n", "<|im_start|>{}\n"),
           "llama32": ("<|eot_id|>", "<|start_header_id|>{}<|end_header_id|>\n\n")}


@pytest.mark.parametrize("mode", ["exact", "kv-stable"])
def test_a_history_rewritten_from_its_root_is_served_natively(engine: ModelEngine, model: ReadModel,
                                                              own_model: ReadModel, mode: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A template that rewrites history when the user speaks (Qwen3 drops the reasoning since the
    user's previous message) renders a text extending the prompt that followed that message: the
    root of the conversation's line of turns (BoundaryScanner.bases), not its latest text. The
    native path serves it from that root, with the Python path's ids, decision and write, and
    the rewrite starts a line the next rewrite extends."""
    counting = _Counting(lookup_mod._native)
    monkeypatch.setattr(lookup_mod, "_native", counting)
    end, head = _MARKUP[engine.name]
    with _segment(engine) as (store, reader):
        fast_memo: ChainMemo[Chunks] = ChainMemo(LISTS)
        ref_memo: ChainMemo[Chunks] = ChainMemo(LISTS)
        fast: Lookup[Chunks, list[int]] = Lookup(own_model, reader, fast_memo)
        ref: Lookup[Chunks, list[int]] = Lookup(model, reader, ref_memo)
        rng = random.Random(f"root-{engine.name}-{mode}")
        root = engine.render([{"role": "system", "content": _para(rng, 300)},
                              {"role": "user", "content": _para(rng, 100)}], add_generation_prompt=True)
        rewrites = served_rewrites = 0

        def turn(text: str) -> bool:
            """Both paths on ``text``; the fast side's write stored, both memos told. Served natively?"""
            before = counting.served
            got = fast.tokenize(text, add_special_tokens=False, mode=mode)
            monkeypatch.setattr(lookup_mod, "_native", None)
            want = ref.tokenize(text, add_special_tokens=False, mode=mode)
            monkeypatch.setattr(lookup_mod, "_native", counting)
            assert got.ids == want.ids == engine.reference.encode(text)
            for name in ("source", "cached_tokens", "cached_chars", "encoded_chars", "boundaries", "l1_hit"):
                assert getattr(got.decision, name) == getattr(want.decision, name), name
            assert (got.write is None) == (want.write is None)
            if got.write is not None and want.write is not None:
                assert list(got.write.ids) == list(want.write.ids) and got.write.entries() == want.write.entries()
                stored = commit(store, fast_memo, got.write)
                if stored is not None:
                    ref_memo.put(stored, ref_memo.fmt.compact(want.write.full),
                                 {e[0]: e[1] + stored.n - len(want.write.ids) for e in want.write.entries()})
            return counting.served > before

        turn(root)
        for _ in range(4):
            latest = root
            for _ in range(4):  # the agent's turns, with their reasoning
                latest += (f"<think>{_para(rng, 60)}</think>{_para(rng, 20)}{end}{head.format('tool')}"
                           f"{_para(rng, 80)}{end}{head.format('assistant')}")
                turn(latest)
            # The user speaks: the reasoning since the previous user message is dropped.
            root += (f"{_para(rng, 20)}{end}{head.format('tool')}{_para(rng, 80)}{end}{head.format('user')}"
                     f"{_para(rng, 30)}{end}{head.format('assistant')}")
            assert not root.startswith(latest)
            rewrites += 1
            served_rewrites += turn(root)
        assert served_rewrites == rewrites, (served_rewrites, rewrites)


def test_the_native_path_marks_the_chain_it_serves_as_used(engine: ModelEngine, own_model: ReadModel,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The native path reads the memo's entry in place (ChainMemo.native_view) and marks it used,
    as ``held_key`` does: the memo drops its least recently used chain first, never the one a
    conversation is reading."""
    counting = _Counting(lookup_mod._native)
    monkeypatch.setattr(lookup_mod, "_native", counting)
    with _segment(engine) as (store, reader):
        memo: ChainMemo[Chunks] = ChainMemo(LISTS)
        lk: Lookup[Chunks, list[int]] = Lookup(own_model, reader, memo)
        rng = random.Random(f"lru-{engine.name}")
        chats = [[{"role": "system", "content": _para(rng, 200)}, {"role": "user", "content": _para(rng, 60)}]
                 for _ in range(2)]
        for msgs in chats:  # two first turns, stored: the second one's record is the newest entry
            got = lk.tokenize(engine.render(msgs, add_generation_prompt=True), add_special_tokens=False, mode="exact")
            assert got.write is not None and commit(store, memo, got.write) is not None
        by_lsn, entries = memo.native_view()
        newest = next(reversed(entries))
        chats[0] += [{"role": "assistant", "content": _para(rng, 30)}, {"role": "user", "content": _para(rng, 40)}]
        text = engine.render(chats[0], add_generation_prompt=True)
        served = counting.served
        got = lk.tokenize(text, add_special_tokens=False, mode="exact")
        assert counting.served == served + 1, counting.calls  # the first chat's next turn, served natively
        assert got.ids == engine.reference.encode(text)
        assert got.write is not None and got.write.parent is not None
        slot = reader.slot(got.write.parent)
        assert slot is not None
        assert next(reversed(entries)) == by_lsn[slot[0]] != newest


def test_a_key_state_of_another_hasher_type_is_the_python_paths(engine: ModelEngine, own_model: ReadModel,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The native key pass works on tokcache.store._speedups.Hasher states in place; a state
    whose hasher is anything else (hashlib's, as a pure-Python process makes) is never read
    as one: ``extend`` says None and the Python path serves the same ids from the same keys."""
    counting = _Counting(lookup_mod._native)
    monkeypatch.setattr(lookup_mod, "_native", counting)
    with _segment(engine) as (store, reader):
        memo: ChainMemo[Chunks] = ChainMemo(LISTS)
        lk: Lookup[Chunks, list[int]] = Lookup(own_model, reader, memo)
        rng = random.Random(f"foreign-{engine.name}")
        msgs = [{"role": "system", "content": _para(rng, 200)}, {"role": "user", "content": _para(rng, 60)}]
        got = lk.tokenize(engine.render(msgs, add_generation_prompt=True), add_special_tokens=False, mode="exact")
        assert got.write is not None and commit(store, memo, got.write) is not None
        msgs += [{"role": "assistant", "content": _para(rng, 30)}, {"role": "user", "content": _para(rng, 40)}]
        text = engine.render(msgs, add_generation_prompt=True)
        bases, _ = own_model.scanner.bases()
        swapped = 0
        for base in bases:
            for ns, state in list(base.hashers.items()):
                if state.hasher is None:
                    continue
                # The same state, made by hashlib: the namespace header, then the text to the cut.
                same = hashlib.sha256(b"tokcache/v1\x00" + namespace(*ns) + base.data[:base.spans[state.cut][1]])
                assert same.digest() == state.hasher.digest()
                base.hashers[ns] = state._replace(hasher=same)
                swapped += 1
        assert swapped
        got = lk.tokenize(text, add_special_tokens=False, mode="exact")
        assert counting.calls >= 1 and counting.served == 0
        assert got.ids == engine.reference.encode(text)
        assert got.decision.source == "l1"  # the same keys: the stored prefix is still found


_CONTAINERS = (dict, list, tuple, set, frozenset, OrderedDict, deque)


def _reachable(*roots: object) -> list[object]:
    """The objects reachable from ``roots`` through plain containers and tokcache's own objects
    (tracked by the collector or not). Not through anything else: walking into types, modules
    and functions would reach the whole interpreter (on 3.12 the walk did not end)."""
    seen: dict[int, object] = {}
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen[id(obj)] = obj
        kind = type(obj)
        if kind in _CONTAINERS or (kind.__module__.startswith("tokcache.") and not isinstance(obj, type)):
            todo += gc.get_referents(obj)
    return list(seen.values())


def test_what_a_reader_keeps_costs_the_garbage_collector_nothing(engine: ModelEngine, own_model: ReadModel) -> None:
    """The id lists (memo chains, a scan's encoding), boundary spans and key lists a reader
    keeps hold only ints, tuples of ints, bytes and None, so they are untracked by the cyclic
    collector: each collection of the caller's process would visit every id of every
    conversation kept (and every AR key of every scan kept).
    The caller's own list stays tracked (it may put anything in it)."""
    with _segment(engine) as (store, reader):
        memo: ChainMemo[Chunks] = ChainMemo(LISTS)
        lk: Lookup[Chunks, list[int]] = Lookup(own_model, reader, memo)
        rng = random.Random(f"{engine.name}-gc")
        msgs: list[dict[str, Any]] = [{"role": "system", "content": _para(rng, 300)}]
        for _ in range(6):
            msgs.append({"role": "user", "content": _para(rng, 200)})
            got = lk.tokenize(engine.render(msgs, add_generation_prompt=True), add_special_tokens=False)
            assert gc.is_tracked(got.ids)
            if got.write is not None:
                commit(store, memo, got.write)
            msgs.append({"role": "assistant", "content": _para(rng, 80)})
        kept = _reachable(memo, own_model.scanner)
        id_lists = [ref for c in kept if isinstance(c, Chunks) for ref, _ in c.parts]
        id_lists += [ref for s in kept if isinstance(s, Scan) and s.encoded is not None
                     for ref, _ in s.encoded.ids.parts]
        scans = [s for s in kept if isinstance(s, Scan)]
        spans = [s.spans for s in scans if s.spans] + [s.tail for s in scans if s.tail]
        # Where hashing each text stopped (KeyState): its keys, AR keys and cut indices.
        states = [st for s in scans for st in s.hashers.values()]
        key_lists = [x for st in states for x in (st.l1, st.ar, st.keyed) if x]
        assert len(id_lists) >= 3 and spans and key_lists, (len(id_lists), len(spans), len(key_lists))
        assert not [len(x) for x in id_lists + spans + key_lists if gc.is_tracked(x)]
        assert not [t for s in scans for t in s.spans if gc.is_tracked(t)]  # the spans themselves
    with pytest.raises(TypeError):
        untrack((1, 2))  # type: ignore[arg-type]


def test_a_reused_encoding_is_kept_with_interned_ints(engine: ModelEngine, own_model: ReadModel) -> None:
    """A turn's new ids join the memo and the next turn's reused encoding as this process's ints
    (IdFormat.own: one int object per id value), whatever the encoder hands out. With an encoder
    that makes new ints every call (``tokenizers``; fastokens hands out the same objects each
    time), the kept encoding still holds only the interned ones, turn after turn of a
    conversation whose tail reuses the previous turn's encoding."""
    import dataclasses

    from tokcache.engine.encoder import TokenizersEncoder

    model = dataclasses.replace(own_model, encoder=TokenizersEncoder(engine.tokenizer_json))
    with _segment(engine) as (store, reader):
        memo: ChainMemo[Chunks] = ChainMemo(LISTS)
        lk: Lookup[Chunks, list[int]] = Lookup(model, reader, memo, defer=True)
        table = ids_mod._interned()
        rng = random.Random(f"{engine.name}-raw")
        msgs: list[dict[str, Any]] = [{"role": "system", "content": _para(rng, 200)}]
        reused = 0
        for turn in range(16):
            msgs.append({"role": "user", "content": _para(rng, rng.randint(20, 300))})
            text = engine.render(msgs, add_generation_prompt=True)
            got = lk.tokenize(text, add_special_tokens=False, mode="exact")
            assert got.ids == engine.reference.encode(text), turn
            assert got.later is not None
            reused += got.later.tail.prior is not None
            write = lk.settle(got.later)
            enc = got.later.scan.encoded
            assert enc is not None and all(x is table[x] for x in enc.ids), turn
            if write is not None:
                commit(store, memo, write)
            msgs.append({"role": "assistant", "content": _para(rng, rng.randint(5, 80))})
        assert reused >= 4, reused  # the reuse path ran (else this tested nothing)


def test_native_cut_tokens_equals_the_python_walk(engine: ModelEngine, model: ReadModel,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(engine.name)
    native = lookup_mod._native
    id_of = dict(model.boundary_id_of)
    for _ in range(30):
        msgs = [{"role": "system", "content": _para(rng, 30)}]
        for _ in range(rng.randint(1, 6)):
            msgs.append({"role": rng.choice(("user", "assistant")), "content": _para(rng, rng.randint(1, 80))})
        text = engine.render(msgs, add_generation_prompt=rng.random() < 0.5)
        scan = model.scanner.scan(text.encode("utf-8"))
        if not scan.spans:
            continue
        ids = engine.reference.encode(text)
        keyed = sorted(rng.sample(range(len(scan.spans)), k=rng.randint(0, len(scan.spans))))
        # From the start, and from a cut inside (its token position found by the walk itself).
        starts = [(0, 0)]
        cut_i = rng.randrange(len(scan.spans))
        full = _cut_tokens(scan, list(range(len(scan.spans))), ids, id_of, 0, 0, {})
        cut_end = scan.spans[cut_i][1]
        if cut_end in full:
            starts.append((cut_end, full[cut_end]))
        for start, pos in starts:
            monkeypatch.setattr(lookup_mod, "_native", None)
            want = _cut_tokens(scan, keyed, ids, id_of, start, pos, {start: pos})
            monkeypatch.setattr(lookup_mod, "_native", native)
            got = _cut_tokens(scan, keyed, ids, id_of, start, pos, {start: pos})
            assert got == want
        # A surprise (an id missing from the ids): both stop at the same place.
        if len(ids) > 4:
            broken = ids[: len(ids) // 2]
            monkeypatch.setattr(lookup_mod, "_native", None)
            want = _cut_tokens(scan, keyed, broken, id_of, 0, 0, {0: 0})
            monkeypatch.setattr(lookup_mod, "_native", native)
            assert _cut_tokens(scan, keyed, broken, id_of, 0, 0, {0: 0}) == want
        # Ints the native walk reads in place (one digit) mixed with ones it converts (big,
        # negative, an int subclass): the same answer as list.index's comparisons.
        unread = (lambda v: (1 << 40) + v, lambda v: -v - 1, lambda v: True if v == 1 else v)
        odd = [unread[i % 3](v) if i % 4 == 1 else v for i, v in enumerate(ids)]
        monkeypatch.setattr(lookup_mod, "_native", None)
        want = _cut_tokens(scan, keyed, odd, id_of, 0, 0, {0: 0})
        monkeypatch.setattr(lookup_mod, "_native", native)
        assert _cut_tokens(scan, keyed, odd, id_of, 0, 0, {0: 0}) == want


def test_spans_is_a_read_only_sequence_of_the_tuples_it_holds() -> None:
    """``_speedups.Spans`` (a native read's boundary spans, one flat array) reads as the list of
    (start, end) tuples it replaces, everywhere the Python code reads spans: length, indexing
    (negative too), slices (lists), iteration, bisect, equality with a list; its tuples are not
    tracked by the cyclic GC; bad input is a clear TypeError or IndexError."""
    Spans = lookup_mod._native.Spans
    pairs = [(0, 12), (40, 52), (52, 60), (1 << 40, (1 << 40) + 3)]
    spans = Spans(pairs)
    assert len(spans) == 4 and spans and not Spans([]) and len(Spans()) == 0
    assert spans[0] == (0, 12) and spans[-1] == pairs[-1] and spans[-4] == pairs[0]
    assert spans[1:3] == pairs[1:3] and type(spans[1:3]) is list and spans[::-1] == pairs[::-1] and spans[5:] == []
    assert list(spans) == pairs and [e for _, e in spans] == [e for _, e in pairs]
    assert spans == pairs and pairs == spans and spans == tuple(pairs)
    assert spans != pairs[:3] and spans != pairs + [(9, 9)]
    assert spans == Spans(pairs) and spans != Spans(pairs[:3]) and (spans == "x") is False
    for x in (0, 1, 40, 41, 52, 53, 1 << 40, 1 << 41):
        assert bisect.bisect_left(spans, (x, -1)) == bisect.bisect_left(pairs, (x, -1)), x
    assert not gc.is_tracked(spans) and not [t for t in spans if gc.is_tracked(t)]
    assert untrack(spans) is spans  # type: ignore[type-var]  # (a no-op: it holds no objects)
    assert repr(spans) == f"Spans({pairs!r})" and spans.__sizeof__() >= 16 * len(pairs)
    with pytest.raises(IndexError):
        spans[4]
    with pytest.raises(IndexError):
        spans[-5]
    with pytest.raises(TypeError):
        spans["a"]  # type: ignore[index]
    with pytest.raises(TypeError):
        hash(spans)
    for bad in ([(1, 2, 3)], [[1, 2]], [(1, "a")], 5):
        with pytest.raises(TypeError):
            Spans(bad)
    with pytest.raises(TypeError):
        spans[0] = (1, 2)  # type: ignore[index]


def test_native_join_equals_the_python_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """ListFormat.result in C (``_speedups.join``: the list allocated once at its final size)
    returns what the Python reference does, for parts cut anywhere, with and without affixes;
    the result is a new list (the parts are untouched) and bad parts are errors, not ids."""
    from tokcache.engine import ids as ids_mod

    native = ids_mod._native
    rng = random.Random("join")
    for _ in range(400):
        parts = []
        for _ in range(rng.randrange(0, 6)):
            ref = [rng.randrange(1 << 17) for _ in range(rng.randrange(0, 40))]
            parts.append((ref, rng.randrange(0, len(ref) + 1)))
        chunks = Chunks(tuple(parts), sum(ln for _, ln in parts))
        n = rng.randrange(-1, chunks.n + 3)
        prefix = tuple(rng.randrange(1000) for _ in range(rng.randrange(0, 3)))
        suffix = tuple(rng.randrange(1000) for _ in range(rng.randrange(0, 3)))
        before = [list(ref) for ref, _ in parts]
        got = LISTS.result(chunks, n, prefix, suffix)
        monkeypatch.setattr(ids_mod, "_native", None)
        want = LISTS.result(chunks, n, prefix, suffix)
        monkeypatch.setattr(ids_mod, "_native", native)
        assert got == want and type(got) is list, (parts, n, prefix, suffix)
        assert [ref for ref, _ in parts] == before
        if parts and got:
            assert got is not parts[0][0]
    with pytest.raises(ValueError):
        native.join((([1, 2], 3),), 3, (), ())
    with pytest.raises(TypeError):
        native.join(((1, 2),), 3, (), ())
    with pytest.raises(TypeError):
        native.join((([1, 2], 2),), 2, None, ())
