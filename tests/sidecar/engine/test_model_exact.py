"""ModelEngine.tokenize == HF tokenizers/transformers, on every cache path (miss, L0, L1).

Property tests over adversarial texts and conversations, for both test
tokenizers, with and without add_special_tokens. Each example uses a fresh
salt, so its first request is a real miss and the next ones exercise L1/L0.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.strategies import conversations, prompt_text
from tokcache.sidecar.engine.model import ModelEngine
from tokcache.store import Store

SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _ids(b: bytes) -> list[int]:
    return [int.from_bytes(b[i:i + 4], "little") for i in range(0, len(b), 4)]


class Subject:
    def __init__(self, path: Path, prefix: str) -> None:
        # Every cut keyed (key_grid=0): these tests check which cut a lookup takes on short texts.
        self.engine = ModelEngine(path.name, path, store=None, key_grid=0)
        self.store = Store.open(prefix=prefix, fingerprint=self.engine.fingerprint, size=32 << 20)
        self.engine.store = self.store
        self.ref = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path))

    def ref_ids(self, text: str, add_special: bool) -> list[int]:
        return list(self.ref.encode(text, add_special_tokens=add_special).ids)


@pytest.fixture(scope="module", params=["qwen3", "llama32"])
def subject(request: pytest.FixtureRequest) -> Iterator[Subject]:
    path = Path(request.getfixturevalue(f"{request.param}_path"))
    prefix = f"tkt-exact-{uuid.uuid4().hex[:8]}"
    s = Subject(path, prefix)
    yield s
    s.store.unlink()
    s.store.close()


def _check(s: Subject, text: str, add_special: bool, salt: str) -> str:
    out = s.engine.tokenize(text, add_special_tokens=add_special, salt=salt)
    assert _ids(out.ids) == s.ref_ids(text, add_special), (text, out.decision)
    return out.decision.source


@SETTINGS
@given(parts=st.lists(prompt_text, min_size=1, max_size=5), add_special=st.booleans())
def test_growing_text_matches_reference(subject: Subject, parts: list[str], add_special: bool) -> None:
    salt = uuid.uuid4().hex
    text = ""
    for part in parts:
        text += part
        _check(subject, text, add_special, salt)
    # Repeating the last text is an exact hit.
    assert _check(subject, text, add_special, salt) == "l0"


@SETTINGS
@given(messages=conversations(), add_special=st.booleans(), gen=st.booleans())
def test_chat_turns_match_transformers(subject: Subject, messages: list[dict[str, Any]],
                                       add_special: bool, gen: bool) -> None:
    salt = uuid.uuid4().hex
    sources = []
    for end in range(1, len(messages) + 1):
        turn = messages[:end]
        if turn[-1]["role"] != "user":
            continue
        text = subject.engine.render(turn, add_generation_prompt=gen)
        want = subject.hf.apply_chat_template(turn, tokenize=True, add_generation_prompt=gen, return_dict=False)
        assert subject.engine.render(turn, add_generation_prompt=gen) == subject.hf.apply_chat_template(
            turn, tokenize=False, add_generation_prompt=gen)
        out = subject.engine.tokenize(text, add_special_tokens=False, salt=salt)
        assert _ids(out.ids) == list(want)
        sources.append(out.decision.source)
        # And the flag's variant, against tokenizers.
        _check(subject, text, add_special, salt)
    # Every turn after the first reuses the previous turn's prefix.
    assert all(src in ("l1", "l0") for src in sources[1:]), sources


def test_decisions_on_a_growing_conversation(subject: Subject) -> None:
    salt = uuid.uuid4().hex
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi  \n\n there"}]
    t1 = subject.engine.render(msgs, add_generation_prompt=True)
    o1 = subject.engine.tokenize(t1, add_special_tokens=False, salt=salt)
    assert o1.decision.source == "miss" and o1.decision.cached_tokens == 0
    assert o1.decision.encoded_chars == len(t1)
    msgs += [{"role": "assistant", "content": "Hello!\n\n"}, {"role": "user", "content": "again 你好"}]
    t2 = subject.engine.render(msgs, add_generation_prompt=True)
    o2 = subject.engine.tokenize(t2, add_special_tokens=False, salt=salt)
    d = o2.decision
    assert d.source == "l1" and d.cached_tokens > 0
    assert d.cached_chars + d.encoded_chars == len(t2)
    assert _ids(o2.ids)[:d.cached_tokens] == subject.ref_ids(t2, False)[:d.cached_tokens]
    o3 = subject.engine.tokenize(t2, add_special_tokens=False, salt=salt)
    assert o3.decision.source == "l0" and o3.decision.cached_tokens == o2.num_tokens
    # Another salt sees nothing of it.
    o4 = subject.engine.tokenize(t2, add_special_tokens=False, salt=salt + "x")
    assert o4.decision.source == "miss"
    # Exact mode is a separate namespace.
    assert subject.engine.tokenize(t2, add_special_tokens=False, salt=salt, mode="exact").decision.source == "miss"


def test_long_conversation_memory_is_linear(subject: Subject) -> None:
    salt = uuid.uuid4().hex
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    used = []
    for turn in range(30):
        msgs.append({"role": "user", "content": f"question {turn}: " + "word " * 60})
        text = subject.engine.render(msgs, add_generation_prompt=True)
        out = subject.engine.tokenize(text, add_special_tokens=False, salt=salt)
        assert turn == 0 or out.decision.source == "l1"
        msgs.append({"role": "assistant", "content": f"answer {turn} " + "ok " * 40})
        used.append(subject.store.stats().used_bytes)
    grown = used[-1] - used[0]
    final_tokens = out.num_tokens
    # Linear: total bytes stay within a small factor of 4 bytes per final token.
    assert grown < final_tokens * 4 * 3, (grown, final_tokens)


def test_deferred_store_writes_only_on_commit(subject: Subject) -> None:
    salt = uuid.uuid4().hex
    text = subject.engine.render([{"role": "user", "content": "deferred 你好\n\n"}], add_generation_prompt=True)
    out = subject.engine.tokenize(text, add_special_tokens=False, salt=salt, defer_store=True)
    assert _ids(out.ids) == subject.ref_ids(text, False)
    assert out.decision.stored is None and "insert" not in out.decision.timings
    # Nothing is cached until the caller commits.
    assert subject.engine.tokenize(text, add_special_tokens=False, salt=salt + "-probe").decision.source == "miss"
    assert subject.engine.tokenize(text, add_special_tokens=False, salt=salt,
                                   defer_store=True).decision.source == "miss"
    out.commit()
    assert out.decision.stored is True and "insert" in out.decision.timings
    out.commit()  # a second commit is a no-op
    again = subject.engine.tokenize(text, add_special_tokens=False, salt=salt)
    assert again.decision.source == "l0" and again.ids == out.ids


def test_hinted_lookup_still_finds_the_longest_cut(subject: Subject) -> None:
    """The scan memo's guess (the last cut of the text this one extends) is only a start:
    a longer cached cut past it is still found, and a rewritten history still gets the
    longest common cut."""
    salt = uuid.uuid4().hex
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    texts = []
    for turn in range(6):
        msgs += [{"role": "user", "content": f"q{turn} " + "ab " * 20}, {"role": "assistant", "content": f"a{turn}"}]
        texts.append(subject.engine.render(msgs[:-1], add_generation_prompt=True))
    long = texts[4]
    _check(subject, long, False, salt)  # caches every cut of turns 0-4
    subject.engine.scanner._memo.clear()  # a process that has seen only the short text
    _check(subject, texts[0], False, salt)
    out = subject.engine.tokenize(texts[5], add_special_tokens=False, salt=salt)
    assert _ids(out.ids) == subject.ref_ids(texts[5], False)
    # The cached prefix reaches past turn 0 into what the long text cached.
    assert out.decision.source == "l1" and out.decision.cached_chars > len(texts[3])
    # A rewritten history (first user message edited) reuses only the system prompt.
    edited = texts[5].replace("q0 ", "Q0 ", 1)
    out = subject.engine.tokenize(edited, add_special_tokens=False, salt=salt)
    assert _ids(out.ids) == subject.ref_ids(edited, False)
    assert out.decision.source == "l1" and out.decision.cached_chars < edited.index("Q0 ")
