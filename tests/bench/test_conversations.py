"""The benchmark's conversation generator: deterministic, realistic, the promised size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import conversations  # noqa: E402


@pytest.fixture(scope="module")
def render(qwen3_path: Path) -> conversations.Renderer:
    return conversations.load_renderer(qwen3_path)


def test_same_seed_same_texts(render: conversations.Renderer) -> None:
    a = conversations.generate(7, render, turns=12)
    b = conversations.generate(7, render, turns=12)
    c = conversations.generate(8, render, turns=12)
    assert a.texts == b.texts
    assert a.texts != c.texts


def test_forty_turns_grow_to_target(render: conversations.Renderer) -> None:
    conv = conversations.generate(0, render)
    assert len(conv.texts) == conversations.DEFAULT_TURNS
    assert abs(conv.last_bytes - conversations.DEFAULT_TARGET_BYTES) < 0.08 * conversations.DEFAULT_TARGET_BYTES
    assert all(t.endswith("<|im_start|>assistant\n") for t in conv.texts)
    last = conv.texts[-1]
    for needle in ("<tool_call>", "<tool_response>", '"arguments": {', "\n        ", "  ", "<think>"):
        assert needle in last, needle
    assert any("\u4e00" <= ch <= "\u9fff" for ch in last), "no CJK"
    assert any(ord(ch) >= 0x1F300 for ch in last), "no emoji"
    # Turns after tool results extend the previous text; only user turns may rewrite history.
    for t in conv.rewritten_turns():
        assert conv.kinds[t - 1] == "user"
    assert "user" in conv.kinds[1:] and conv.kinds.count("tool") > 25
