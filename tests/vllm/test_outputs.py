"""Per-(request, choice) assembly of vLLM outputs, what is recorded, and served-prompt bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from tokenizers import Tokenizer

from sidecar_client.vllm._outputs import (
    ChoiceAssembler,
    FinishedChoice,
    ServedPrompts,
    held_back_tokens,
    skip_reason,
)
from tokcache.sidecar.bundled import qwen3_dir


@dataclass
class Out:
    """Stand-in for vllm.outputs.CompletionOutput."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def test_delta_outputs_are_appended_until_finish() -> None:
    asm = ChoiceAssembler(delta=True)
    assert asm.feed([Out(0, "Hel", [1])]) == []
    assert asm.feed([Out(0, "lo", [2])]) == []
    done = asm.feed([Out(0, "!", [3], "length")])
    assert done == [FinishedChoice(0, "Hello!", [1, 2, 3], "length", None)]
    assert asm.pending == 0


def test_n2_interleaved_and_merged_chunks() -> None:
    """Choices arrive interleaved, one per RequestOutput (n>1 DELTA), and sometimes several
    deltas merged into one output (the consumer lagged: RequestOutput.add(aggregate=True))."""
    asm = ChoiceAssembler(delta=True)
    assert asm.feed([Out(1, "b1", [21])]) == []
    assert asm.feed([Out(0, "a1", [11])]) == []
    assert asm.feed([Out(0, "a2a3", [12, 13]), Out(1, "b2", [22])]) == []  # merged
    done = asm.feed([Out(1, "b3", [23, 24], "stop", 7)])
    assert done == [FinishedChoice(1, "b1b2b3", [21, 22, 23, 24], "stop", 7)]
    done = asm.feed([Out(0, "", [99], "stop", None)])  # EOS: an id without text
    assert done == [FinishedChoice(0, "a1a2a3", [11, 12, 13, 99], "stop", None)]


def test_final_only_and_cumulative_outputs_replace() -> None:
    asm = ChoiceAssembler(delta=False)
    assert asm.feed([Out(0, "He", [1])]) == []  # CUMULATIVE: the whole output so far
    done = asm.feed([Out(0, "Hello", [1, 2], "length"), Out(1, "Bye", [5], "length")])  # FINAL_ONLY, n=2
    assert [d.text for d in done] == ["Hello", "Bye"] and done[0].token_ids == [1, 2]


def test_outputs_after_a_finish_are_ignored() -> None:
    asm = ChoiceAssembler(delta=True)
    assert len(asm.feed([Out(0, "x", [1], "length")])) == 1
    assert asm.feed([Out(0, "y", [2], "length")]) == []


@pytest.mark.parametrize(("finish", "stop", "ids", "reason"), [
    ("stop", None, [1, 2], None),  # EOS: recorded, the sidecar drops the trailing EOS id
    ("stop", 42, [1, 42], None),  # stop_token_ids: same
    ("length", None, [1], None),
    ("stop", "\n\n", [1, 2], "stop_string"),  # text truncated, ids not: never sent
    ("abort", None, [1], "finish_abort"),
    ("error", None, [1], "finish_error"),
    ("length", None, [], "empty"),
])
def test_skip_reason(finish: str, stop: int | str | None, ids: list[int], reason: str | None) -> None:
    assert skip_reason(FinishedChoice(0, "t", ids, finish, stop)) == reason


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return Tokenizer.from_file(str(qwen3_dir() / "tokenizer.json"))


def test_held_back_tokens_of_an_unfinished_character(qwen: Tokenizer) -> None:
    """max_tokens cut a multi-byte character: vLLM's text lacks its bytes, decode(ids) ends in U+FFFD."""
    def decode(ids: list[int]) -> str:
        return str(qwen.decode(ids, skip_special_tokens=False))

    whole = qwen.encode("caching 缓存 works", add_special_tokens=False).ids
    pieces = qwen.encode("\U00013000", add_special_tokens=False).ids  # Egyptian hieroglyph: 3 byte-level tokens
    assert len(pieces) == 3 and decode(pieces[:2]).endswith("\ufffd")
    text = decode(whole)  # what vLLM's detokenizer emits when max_tokens cuts the character
    assert held_back_tokens(whole + pieces[:1], text, decode) == 1
    assert held_back_tokens(whole + pieces[:2], text, decode) == 2
    assert held_back_tokens(whole, text, decode) == 0  # a complete output
    assert held_back_tokens(whole + pieces[:1], text + "\ufffd", decode) == 0  # U+FFFD in the text itself
    assert held_back_tokens([], "", decode) == 0


def test_served_prompts_take_matches_ids_and_consumes() -> None:
    served = ServedPrompts()
    served.add(None, "hello", [1, 2, 3], model="m", add_special_tokens=False)
    assert served.take(None, "hello", [1, 2, 4]) is None  # other ids: vLLM changed them
    served.add(None, "hello", [1, 2, 3], model="m", add_special_tokens=False)
    got = served.take(None, "hello", [1, 2, 3])
    assert got is not None and got.model == "m" and got.add_special_tokens is False
    assert served.take(None, "hello", [1, 2, 3]) is None and len(served) == 0


def test_served_prompts_count_concurrent_equal_prompts_and_separate_salts() -> None:
    served = ServedPrompts()
    for _ in range(2):
        served.add("a", "same", [7], model="m", add_special_tokens=True)
    assert served.take(None, "same", [7]) is None  # another salt
    assert served.take("a", "same", [7]) is not None
    assert served.take("a", "same", [7]) is not None
    assert served.take("a", "same", [7]) is None


def test_served_prompts_are_bounded_oldest_first() -> None:
    served = ServedPrompts(capacity=2)
    for text in ("a", "b", "c"):
        served.add(None, text, [1], model="m", add_special_tokens=False)
    assert len(served) == 2
    assert served.take(None, "a", [1]) is None
    assert served.take(None, "c", [1]) is not None
