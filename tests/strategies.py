"""Hypothesis strategies for adversarial prompt text and conversations."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

FRAGMENTS = [
    " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", " \n", "\r\n", "\u00a0", "\u3000",
    "def f(x):\n    return x\n", "    if a:\n        b()\n", '{"k": [1, 2, {"z": null}]}',
    "你好，世界", "日本語", "한국어", "🎉", "👨‍👩‍👧", "🇫🇷", "e\u0301", "ﬁ",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|begin_of_text|>",
    "<|im_end|", "<|im_", "|>", "<|eot_id", "<|notatoken|>",
    "123", "3.14", "1,000,000", "I'm", "you'LL", "$$", "**", "```", "...", "—", "\\n",
]

_alphabet = st.characters(codec="utf-8", categories=["L", "N", "P", "S", "Z", "M"])

text_piece = st.one_of(
    st.sampled_from(FRAGMENTS),
    st.text(alphabet=_alphabet, max_size=20),
    st.text(alphabet=" \t\n\r", min_size=1, max_size=12),
    st.text(alphabet="abc xyz\n", max_size=400),
)

prompt_text = st.lists(text_piece, max_size=25).map("".join)
long_text = st.lists(text_piece, min_size=50, max_size=200).map("".join)

content = st.one_of(st.just(""), prompt_text, long_text.filter(lambda s: len(s) < 3000))


@st.composite
def conversations(draw: Any, with_system: bool = True) -> list[dict[str, Any]]:
    """Alternating user/assistant messages, optionally a system prompt first."""
    msgs: list[dict[str, Any]] = []
    if with_system and draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(content)})
    n = draw(st.integers(min_value=1, max_value=6))
    for i in range(n):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": draw(content)})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": draw(content)})
    return msgs
