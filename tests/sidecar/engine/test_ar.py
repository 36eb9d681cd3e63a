"""AR: recorded outputs come back bit-exact in the next turn's ids; bad records leave no trace."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ar_helpers import noncanonical
from tokcache.engine.errors import InvalidRequest
from tokcache.sidecar.engine.model import ModelEngine
from tokcache.store import Store

ANSWER = ("Sure.\n\nHere is the fix:\n\n```python\n    if not value:\n        continue\n```\n\n"
          "  Done: 12345 items, 你好 🎉.")


def _ids(b: bytes) -> list[int]:
    return [int.from_bytes(b[i:i + 4], "little") for i in range(0, len(b), 4)]


@pytest.fixture(scope="module", params=["qwen3", "llama32"])
def engine(request: pytest.FixtureRequest) -> Iterator[ModelEngine]:
    path = Path(request.getfixturevalue(f"{request.param}_path"))
    eng = ModelEngine(request.param, path, store=None)
    store = Store.open(prefix=f"tkt-ar-{uuid.uuid4().hex[:8]}", fingerprint=eng.fingerprint, size=32 << 20)
    eng.store = store
    yield eng
    store.unlink()
    store.close()


def _eos(engine: ModelEngine) -> int:
    return 151645 if engine.name == "qwen3" else 128009  # <|im_end|> / <|eot_id|>


def _turn(engine: ModelEngine, msgs: list[dict[str, Any]], salt: str, mode: str = "kv-stable") -> tuple[str, Any]:
    text = engine.render(msgs, add_generation_prompt=True)
    return text, engine.tokenize(text, add_special_tokens=False, salt=salt, mode=mode)


def _record(engine: ModelEngine, prompt: str, out: Any, answer: str, ids: list[int], salt: str, **kw: Any) -> Any:
    return engine.record_output(prompt_text=prompt, prompt_ids=_ids(out.ids), output_text=answer,
                                output_ids=ids, salt=salt, **kw)


def test_recorded_answer_is_spliced_bit_exact(engine: ModelEngine) -> None:
    salt = uuid.uuid4().hex
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Fix it."}]
    p1, o1 = _turn(engine, msgs, salt)
    generated = noncanonical(engine, ANSWER)
    res = _record(engine, p1, o1, ANSWER, generated + [_eos(engine)], salt)
    assert res.stop_token_dropped and res.recorded_tokens == len(generated)
    msgs += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "And the tests?"}]
    p2, o2 = _turn(engine, msgs, salt)
    ids2 = _ids(o2.ids)
    head = _ids(o1.ids) + generated
    assert ids2[:len(head)] == head
    assert o2.decision.source == "ar" and o2.decision.ar_spliced_tokens >= len(generated)
    rest = p2[len(p1) + len(ANSWER):]
    assert ids2[len(head):] == engine.reference.encode(rest)
    # exact mode: canonical ids only
    exact = engine.tokenize(p2, add_special_tokens=False, salt=salt, mode="exact")
    assert _ids(exact.ids) == engine.reference.encode(p2)
    assert ids2 != _ids(exact.ids)
    # Turn 3 keeps turn 2's ids (the KV the engine holds) and splices the new answer.
    answer2 = "Tests:\n\n    pytest -q\n\n3 passed."
    gen2 = noncanonical(engine, answer2)
    _record(engine, p2, o2, answer2, gen2, salt, finish_reason="length")
    msgs += [{"role": "assistant", "content": answer2}, {"role": "user", "content": "Thanks!"}]
    _, o3 = _turn(engine, msgs, salt)
    assert _ids(o3.ids)[:len(ids2) + len(gen2)] == ids2 + gen2
    # Other salts see nothing of it.
    _, other = _turn(engine, msgs, salt + "-other")
    assert other.decision.source != "ar"
    assert _ids(other.ids) == engine.reference.encode(engine.render(msgs, add_generation_prompt=True))


def test_poisoned_records_are_refused_and_leave_no_trace(engine: ModelEngine) -> None:
    salt = uuid.uuid4().hex
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Hello?"}]
    p1, o1 = _turn(engine, msgs, salt)
    good = noncanonical(engine, ANSWER)
    puts = engine.store.stats().puts if engine.store else 0
    bad_cases: list[tuple[dict[str, Any], str]] = [
        ({"output_ids": engine.reference.encode("something else entirely")}, "output_token_ids"),
        ({"output_ids": good + [engine.vocab_size + 5]}, "output_token_ids"),
        ({"output_ids": good[:-1]}, "output_token_ids"),
        ({"prompt_ids": _ids(o1.ids)[:-1] + [42]}, "prompt_token_ids"),
        ({"prompt_ids": _ids(o1.ids) + [engine.vocab_size]}, "prompt_token_ids"),
        ({"stop_string": "STOP"}, "stop_reason"),
        ({"output_ids": []}, "output_token_ids"),
    ]
    for override, field in bad_cases:
        kwargs: dict[str, Any] = {"prompt_text": p1, "prompt_ids": _ids(o1.ids), "output_text": ANSWER,
                                  "output_ids": good, "salt": salt}
        kwargs.update(override)
        with pytest.raises(InvalidRequest) as exc:
            engine.record_output(**kwargs)
        assert exc.value.field == field, (override, exc.value)
    assert engine.store is not None and engine.store.stats().puts == puts
    msgs += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "ok"}]
    p2, o2 = _turn(engine, msgs, salt)
    assert o2.decision.source != "ar"
    assert _ids(o2.ids) == engine.reference.encode(p2)


def test_prompt_ids_packed_or_listed_record_the_same(engine: ModelEngine) -> None:
    """RecordOutput hands the prompt ids over packed (compared with the stored prompt as they
    are); a Python caller passes a list. Both chain the record to the prompt; a prompt never
    tokenized is looked up (and stored) by the record itself; bad ids are refused by field."""
    generated = noncanonical(engine, ANSWER)
    for packed in (False, True):
        salt = uuid.uuid4().hex
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"packed={packed}"}]
        # A prompt this engine never served: its canonical ids, recorded before any Tokenize.
        p1 = engine.render(msgs, add_generation_prompt=True)
        canonical = engine.reference.encode(p1)
        prompt_ids: Any = b"".join(i.to_bytes(4, "little") for i in canonical) if packed else canonical
        res = engine.record_output(prompt_text=p1, prompt_ids=prompt_ids, output_text=ANSWER,
                                   output_ids=generated + [_eos(engine)], salt=salt)
        assert res.recorded_tokens == len(generated) and res.entries >= 1
        msgs += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "next"}]
        p2, o2 = _turn(engine, msgs, salt)
        assert o2.decision.source == "ar"
        assert _ids(o2.ids)[:len(canonical) + len(generated)] == canonical + generated
    for bad in ([1, -1], [1, "2"], b"\x01\x00\x00"):
        with pytest.raises(InvalidRequest) as exc:
            engine.record_output(prompt_text=p1, prompt_ids=bad, output_text=ANSWER, output_ids=generated, salt=salt)
        assert exc.value.field == "prompt_token_ids", bad


def test_identical_output_in_another_conversation_is_spliced(engine: ModelEngine) -> None:
    salt = uuid.uuid4().hex
    p1, o1 = _turn(engine, [{"role": "user", "content": "first conversation"}], salt)
    generated = noncanonical(engine, ANSWER)
    _record(engine, p1, o1, ANSWER, generated, salt)
    other = [{"role": "system", "content": "Another agent."}, {"role": "user", "content": "q"},
             {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "next"}]
    _, out = _turn(engine, other, salt)
    ids = _ids(out.ids)
    assert out.decision.source == "ar" and out.decision.ar_spliced_tokens == len(generated)
    assert any(ids[k:k + len(generated)] == generated for k in range(len(ids)))


def test_trimmed_and_reasoning_dropped_history_still_splices(engine: ModelEngine) -> None:
    salt = uuid.uuid4().hex
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "think about it"}]
    p1, o1 = _turn(engine, msgs, salt)
    if engine.name == "qwen3":
        # Qwen3 drops the reasoning of earlier turns when re-rendering history.
        body = "The answer is:\n\n```\n  42\n```"
        answer = "<think>\nLet me think.\n\nOK.\n</think>\n\n" + body
    else:
        # The Llama template trims content.
        body = "The answer is:\n\n```\n  42\n```"
        answer = "\n\n" + body + "\n  "
    generated = noncanonical(engine, answer)
    _record(engine, p1, o1, answer, generated, salt)
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and?"},
             {"role": "assistant", "content": "more"}, {"role": "user", "content": "last"}]
    _, out = _turn(engine, msgs, salt)
    ids = _ids(out.ids)
    assert out.decision.ar_spliced_tokens > 0
    decode = engine.reference.tokenizer.decode
    # The slice of the generated ids that spells exactly `body`.
    span = next((generated[a:b] for a in range(len(generated)) for b in range(len(generated), a, -1)
                 if decode(generated[a:b], skip_special_tokens=False) == body), None)
    assert span is not None and span != engine.reference.encode(body)
    assert any(ids[j:j + len(span)] == span for j in range(len(ids))), "recorded ids of the body not spliced"
