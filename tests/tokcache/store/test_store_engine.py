"""The engine over a failing or full store: requests still succeed, and RecordOutput says what was stored."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.tokcache.store.store_helpers import FINGERPRINT
from tokcache.sidecar.engine.model import ModelEngine
from tokcache.store import Kind, LockTimeout, Store


@pytest.fixture(scope="module")
def engine(qwen3_path: Path) -> Iterator[ModelEngine]:
    prefix = f"tkt{os.getpid()}-engine-{uuid.uuid4().hex[:8]}"
    store = Store.open(prefix=prefix, fingerprint=FINGERPRINT, size=1 << 20, ttl={Kind.L0: 60.0})
    yield ModelEngine("qwen3", qwen3_path, store=store)
    store.unlink()
    store.close()


PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _record(engine: ModelEngine) -> Any:
    output = "Hello there."
    return engine.record_output(prompt_text=PROMPT, prompt_ids=engine.reference.encode(PROMPT),
                                output_text=output, output_ids=engine.reference.encode(output))


def test_record_output_reports_what_was_stored(engine: ModelEngine) -> None:
    result = _record(engine)
    assert result.entries >= 1 and result.recorded_tokens > 0


def test_record_output_survives_a_stuck_lock(engine: ModelEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine.store is not None

    def stuck(*args: Any, **kwargs: Any) -> bool:
        raise LockTimeout("held by pid 1")

    engine.tokenize(PROMPT, add_special_tokens=False)  # cached before the lock gets stuck
    monkeypatch.setattr(engine.store, "put", stuck)
    monkeypatch.setattr(engine.store, "put_many", stuck)
    result = _record(engine)
    assert (result.entries, result.recorded_tokens) == (0, 0)  # nothing stored, and it says so
    out = engine.tokenize(PROMPT + "more text", add_special_tokens=False)  # still served, uncached
    assert list(memoryview(out.ids).cast("I")) == engine.reference.encode(PROMPT + "more text")


def test_l0_entries_have_their_own_kind(engine: ModelEngine) -> None:
    assert engine.store is not None
    before = engine.store.stats().live_entries
    engine.tokenize(PROMPT + "a new text", add_special_tokens=False)
    after = engine.store.stats().live_entries
    assert after[Kind.L0] == before[Kind.L0] + 1  # the whole-text key: --ttl-l0 applies to it
    assert after[Kind.L1] >= before[Kind.L1]
