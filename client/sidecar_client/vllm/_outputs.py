"""From vLLM's stream of outputs to RecordOutput records (no vLLM import here).

Two pieces of per-request state:

- :class:`ServedPrompts` remembers which prompts tokcache tokenized, so only their
  generations are recorded (a prompt vLLM tokenized itself has nothing to extend). The
  tokenize hook runs before vLLM assigns a request id, so entries are keyed by (salt,
  text), and a request whose ids plainly differ (another length, other ends: vLLM truncated
  them) is not recorded. The recorder compares the prompt ids in full with what it served.
- :class:`ChoiceAssembler` accumulates one request's outputs per choice
  index: DELTA outputs (streaming) are appended, FINAL_ONLY / CUMULATIVE
  outputs replace; a choice is emitted once, when its ``finish_reason`` appears.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "RECORDABLE_FINISHES",
    "ChoiceAssembler",
    "CompletionLike",
    "FinishedChoice",
    "ServedPrompt",
    "ServedPrompts",
    "held_back_tokens",
    "skip_reason",
]

# finish reasons whose output is a real continuation of the prompt ("abort" and
# "error" stop anywhere, possibly mid-character).
RECORDABLE_FINISHES = frozenset({"stop", "length"})


class CompletionLike(Protocol):
    """What the assembler reads of ``vllm.outputs.CompletionOutput``."""

    @property
    def index(self) -> int: ...
    @property
    def text(self) -> str: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def stop_reason(self) -> int | str | None: ...


@dataclass(frozen=True)
class FinishedChoice:
    """One choice's whole output, as vLLM produced it (trailing EOS id included)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None


def skip_reason(choice: FinishedChoice) -> str | None:
    """Why this output must not be recorded, or None to record it.

    A stop *string* truncates the text but not the ids, so the sidecar refuses
    those; they are not sent at all. A trailing EOS / stop-token id is kept:
    the sidecar drops it when it is absent from the text.
    """
    if choice.finish_reason not in RECORDABLE_FINISHES:
        return f"finish_{choice.finish_reason}"
    if isinstance(choice.stop_reason, str):
        return "stop_string"
    if not choice.token_ids:
        return "empty"
    return None


_REPLACEMENT = "\ufffd"


def held_back_tokens(ids: Sequence[int], text: str, decode: Callable[[list[int]], str], *, window: int = 8) -> int:
    """How many trailing ids are not in ``text`` because they end mid-character.

    When generation stops inside a multi-byte UTF-8 character (``length``
    finish on byte-level tokens), vLLM's detokenizer holds the unfinished
    bytes back: the text lacks them, while ``decode(ids)`` ends with U+FFFD, so
    the sidecar would refuse the whole record. Without those ids the record
    verifies, and it is exactly what the client will send back. ``decode``
    must not skip special tokens. Costs one decode of ``window`` ids.
    """
    if not ids or text.endswith(_REPLACEMENT):
        return 0
    tail = list(ids[-window:])
    if not decode(tail).endswith(_REPLACEMENT):
        return 0
    for k in range(1, min(4, len(tail)) + 1):  # a UTF-8 character has at most 4 bytes
        if not decode(tail[:-k]).endswith(_REPLACEMENT):
            return k
    return 0


@dataclass
class _Choice:
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


class ChoiceAssembler:
    """Assembles the choices of ONE request. ``delta``: outputs carry only new text/ids.

    Merged DELTA chunks (vLLM aggregates queued deltas when the consumer lags)
    are just longer deltas. Outputs for a choice after its finish are ignored.
    """

    def __init__(self, *, delta: bool) -> None:
        self.delta = delta
        self._open: dict[int, _Choice] = {}
        self._finished: set[int] = set()

    def feed(self, outputs: Iterable[CompletionLike]) -> list[FinishedChoice]:
        """Take one ``RequestOutput.outputs``; return the choices that finished in it."""
        done: list[FinishedChoice] = []
        for out in outputs:
            index = out.index
            if index in self._finished:
                continue
            if self.delta:
                acc = self._open.setdefault(index, _Choice())
                acc.texts.append(out.text)
                acc.ids.extend(out.token_ids)
            else:
                acc = self._open[index] = _Choice([out.text], list(out.token_ids))
            if out.finish_reason is not None:
                self._finished.add(index)
                del self._open[index]
                done.append(FinishedChoice(index=index, text="".join(acc.texts), token_ids=acc.ids,
                                           finish_reason=out.finish_reason, stop_reason=out.stop_reason))
        return done

    @property
    def pending(self) -> int:
        """Choices seen but not finished."""
        return len(self._open)


@dataclass(frozen=True)
class ServedPrompt:
    """What tokcache returned for a prompt (its ids kept as their length and ends, not copied:
    hashing every id of a 57 KB prompt cost ~100 µs of the event loop per request, and the
    recorder compares the ids in full anyway)."""

    model: str
    add_special_tokens: bool
    n_ids: int
    ids_ends: tuple[int, int]


def _ends(ids: Sequence[int]) -> tuple[int, int]:
    return (ids[0], ids[-1]) if len(ids) else (-1, -1)


class ServedPrompts:
    """Bounded map (salt, text) -> :class:`ServedPrompt`, oldest dropped first.

    ``add`` at tokenize time, ``take`` when the request starts generating. Keys
    hold the text's hash and length, not the text, so entries left behind by
    prompts that never generate (``/tokenize``) cost a few dozen bytes each.
    Used from the event loop only (no lock).
    """

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, int, int], tuple[ServedPrompt, int]] = OrderedDict()

    @staticmethod
    def _key(salt: str | None, text: str) -> tuple[str, int, int]:
        return (salt or "", len(text), hash(text))

    def add(self, salt: str | None, text: str, ids: Sequence[int], *, model: str, add_special_tokens: bool) -> None:
        """Remember that the sidecar served ``ids`` for ``text`` (counted: concurrent equal prompts)."""
        key = self._key(salt, text)
        served = ServedPrompt(model, add_special_tokens, len(ids), _ends(ids))
        old = self._entries.pop(key, None)
        count = old[1] + 1 if old is not None and old[0] == served else 1
        self._entries[key] = (served, count)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def take(self, salt: str | None, text: str, ids: Sequence[int]) -> ServedPrompt | None:
        """The entry for ``text`` if the engine's ``ids`` are exactly those served; consumes one use."""
        key = self._key(salt, text)
        entry = self._entries.get(key)
        if entry is None:
            return None
        served, count = entry
        if count <= 1:
            del self._entries[key]
        else:
            self._entries[key] = (served, count - 1)
        if served.n_ids != len(ids) or served.ids_ends != _ends(ids):
            return None  # vLLM changed them (truncation) or another tokenizer produced them
        return served

    def __len__(self) -> int:
        return len(self._entries)
