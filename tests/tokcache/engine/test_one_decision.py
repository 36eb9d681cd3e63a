"""One decision-maker: a client reading the segment in its own process and the sidecar agree.

The sidecar runs :class:`~tokcache.engine.lookup.Lookup` on its read-write store (ids as
bytes, its own memo); a client runs the same class on a read-only mapping of the same
segment (ids as lists, another memo, a ReadModel rebuilt from the published manifest).
Property: at every point of a random multi-turn history — text and chat, exact and
kv-stable, with recorded (non-canonical) outputs, rewritten history (Qwen3 drops old
reasoning, the Llama template trims), writes from either side or none, every cut keyed or
a sparse grid, and a small segment that evicts and wraps — both return the same ids and
the same decision, and exact mode equals the ``tokenizers`` reference.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.ar_helpers import noncanonical
from tests.strategies import prompt_text
from tokcache.engine.ids import LISTS, Chunks
from tokcache.engine.lookup import Lookup, commit
from tokcache.engine.memo import ChainMemo
from tokcache.engine.tokenizer import Manifest, from_manifest
from tokcache.ids import pack_ids, unpack_ids
from tokcache.sidecar.engine.model import ModelEngine
from tokcache.store import Kind, Store, StoreReader

SEGMENT = 2 << 20  # small: junk puts evict and wrap the log within an example


@pytest.fixture(scope="module", params=[("qwen3", 0), ("llama32", 0), ("qwen3", 256), ("llama32", 256)],
                ids=lambda p: f"{p[0]}-grid{p[1]}")
def engine(request: pytest.FixtureRequest) -> ModelEngine:
    """The sidecar's engine; key_grid 0 keys every cut, 256 keys a few cuts of these short texts
    (the sparse keying of long ones: tokcache.store.keys.KEY_GRID)."""
    name, grid = request.param
    path = Path(request.getfixturevalue(f"{name}_path"))
    return ModelEngine(name, path, store=None, key_grid=grid)


_CLIENT_MODELS: dict[tuple[str, int], Any] = {}  # one client ReadModel per tokenizer: loading an encoder is slow


class Pair:
    """The sidecar's engine and a client's lookup on one fresh segment (close it)."""

    def __init__(self, engine: ModelEngine) -> None:
        prefix = f"tkt-one-{uuid.uuid4().hex[:8]}"
        self.engine = engine
        self.store = Store.open(prefix=prefix, fingerprint=engine.fingerprint, size=SEGMENT, id_bytes=3)
        engine.store = store = self.store
        engine.memo = ChainMemo(engine.memo.fmt)  # a fresh memo per example (stale entries would be harmless)
        engine.lookup.memo = engine.memo
        assert engine.publish([engine.name])
        self.reader = StoreReader.attach_name(store.name)
        manifest = Manifest.from_bytes(self.reader.manifest() or b"")
        model = _CLIENT_MODELS.get((engine.fingerprint, manifest.key_grid))
        if model is None:  # built from the published manifest, as a client process does
            model = from_manifest(engine.tokenizer_json, manifest)
            _CLIENT_MODELS[(engine.fingerprint, manifest.key_grid)] = model
        assert model.key_grid == engine.proven.model.key_grid
        self.client_memo: ChainMemo[Chunks] = ChainMemo(LISTS)
        self.client: Lookup[Chunks, list[int]] = Lookup(model, self.reader, self.client_memo)
        self.client_store = Store.attach(store.name, fingerprint=engine.fingerprint)

    def close(self) -> None:
        self.client_store.close()
        self.reader.close()
        self.engine.store = None
        self.store.unlink()
        self.store.close()




answer_text = st.one_of(
    st.sampled_from(["Sure.\n\nDone.", "  padded answer  ", "\n\nlead\n", "ok", "x = 1\n\n\ny = 2\n",
                     "你好 🎉\n\n- a\n- b", "{\"k\": [1, 2]}\n"]),
    prompt_text.filter(lambda t: 0 < len(t) < 400),
)


def _eos(engine: ModelEngine) -> int:
    return 151645 if engine.name == "qwen3" else 128009


def _output_ids(engine: ModelEngine, text: str, weird: bool) -> list[int]:
    canonical = engine.reference.encode(text)
    if weird:
        try:
            return noncanonical(engine, text)
        except AssertionError:  # nothing to split
            return canonical
    return canonical


def _check_same(pair: Pair, text: str, *, add: bool, salt: str, mode: str) -> Any:
    server = pair.engine.lookup.tokenize(text, add_special_tokens=add, salt=salt, mode=mode)
    local = pair.client.tokenize(text, add_special_tokens=add, salt=salt, mode=mode)
    assert unpack_ids(server.ids) == local.ids, (mode, add, server.decision, local.decision)
    for name in ("source", "cached_tokens", "ar_spliced_tokens", "encoded_chars", "boundaries"):
        assert getattr(server.decision, name) == getattr(local.decision, name), name
    if mode == "exact":
        want = pair.engine.reference.encode_full(text) if add else pair.engine.reference.encode(text)
        assert local.ids == want
    event(f"{mode} {local.decision.source}" + (" +segment AR" if local.decision.segment_splices else ""))
    return server, local


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_client_and_sidecar_take_the_same_decision(engine: ModelEngine, data: Any) -> None:
    pair = Pair(engine)
    try:
        _run_history(engine, pair, data)
    finally:
        pair.close()


def _run_history(engine: ModelEngine, pair: Pair, data: Any) -> None:
    salt = data.draw(st.sampled_from(["", "tenant-a"]), label="salt")
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for turn in range(data.draw(st.integers(2, 5), label="turns")):
        msgs.append({"role": "user", "content": data.draw(prompt_text.filter(lambda t: len(t) < 300), label="user")})
        text = engine.render(msgs, add_generation_prompt=True)
        mode = data.draw(st.sampled_from(["kv-stable", "exact"]), label="mode")
        add = data.draw(st.booleans(), label="add_special_tokens")
        server, local = _check_same(pair, text, add=add, salt=salt, mode=mode)
        # Also the raw text (no chat) and a prefix of it: the cache must agree there too.
        _check_same(pair, text[: len(text) // 2], add=False, salt=salt, mode=mode)
        # Store what one side learned (both would store the same), or nothing (a client skips
        # short tails: the next turn's hit stays where it was and the client reuses what it
        # encoded, which must not change a decision).
        who = data.draw(st.sampled_from(["client", "sidecar", "nobody"]), label="who writes")
        if who == "client" and local.write is not None:
            commit(pair.client_store, pair.client_memo, local.write)
        elif who == "sidecar" and server.write is not None:
            pair.engine.commit(server.write)
        answer = data.draw(answer_text, label="answer")
        reasoning = engine.name == "qwen3" and data.draw(st.booleans(), label="reasoning")
        if mode == "kv-stable" and not add and data.draw(st.booleans(), label="record"):
            # What vLLM would send: the served prompt ids, the generated ids (+ EOS).
            out_text = f"<think>\nhm {turn}\n</think>\n\n{answer}" if reasoning else answer
            ids = _output_ids(engine, out_text, data.draw(st.booleans(), label="non-canonical"))
            try:
                pair.engine.record_output(prompt_text=text, prompt_ids=local.ids, output_text=out_text,
                                          output_ids=[*ids, _eos(engine)], salt=salt)
            except Exception as exc:  # a refused record is fine; a wrong one is not
                assert "InvalidRequest" in type(exc).__name__, exc
        msgs.append({"role": "assistant", "content": answer,
                     **({"reasoning_content": f"hm {turn}"} if reasoning else {})})
        junk = data.draw(st.integers(0, 3), label="junk puts x100")
        for i in range(junk * 100):  # evict and wrap the log under both readers
            key = uuid.uuid4().bytes
            pair.store.put(None, 0, pack_ids(range(i % 500)), [(key, i % 500)], Kind.L1)
    # The conversation's next request, after everything: still one answer.
    msgs.append({"role": "user", "content": "last"})
    _check_same(pair, engine.render(msgs, add_generation_prompt=True), add=False, salt=salt, mode="kv-stable")
