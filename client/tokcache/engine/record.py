"""AR records: verify a model output before it may enter the cache, and derive its keys.

Verification (nothing unverified is stored; a refusal changes nothing):

* every id is in the vocabulary;
* ``decode(ids) == output_text`` — after dropping one trailing stop/EOS id
  that is absent from the text (vLLM keeps EOS in ``token_ids``, not in
  ``text``);
* a finish by stop *string* is refused: vLLM truncates the text at the
  string but not the ids, so the ids run past the text;
* the prompt ids are what tokcache serves for the prompt text (checked by
  the engine, which owns the cache).

Keys: the *prefix* entry (prompt text + output text → prompt ids + output
ids) and *segment* entries (output text alone → output ids), for the whole
output and for variants templates produce when they re-render history: the
content after ``</think>`` and whitespace-trimmed forms — each only where its
start and end fall on token boundaries of the generated ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokcache.engine.errors import InvalidRequest
from tokcache.sidecar.engine.tokenbytes import TokenBytes

__all__ = ["Segment", "VerifiedOutput", "segment_variants", "verify_output", "verify_segment"]

THINK_END = "</think>"


@dataclass(frozen=True)
class VerifiedOutput:
    """Output ids that decode exactly to the output text."""

    ids: list[int]
    stop_token_dropped: bool


@dataclass(frozen=True)
class Segment:
    """A variant of the output text and the token slice ``ids[start:end]`` that spells it."""

    text: str
    start: int
    end: int


def verify_output(*, output_text: str, output_ids: list[int], finish_reason: str,
                  stop_token_id: int | None, stop_string: str | None, vocab_size: int,
                  special_ids: frozenset[int], decode: Callable[[list[int]], str]) -> VerifiedOutput:
    """Check an output as described in the module docstring; InvalidRequest names the reason."""
    if stop_string is not None:
        # Named as the client's parameter (record_output(stop_reason="...")); the
        # proto field is stop_string.
        raise InvalidRequest("stop_reason", "a finish by a stop string is not recorded: "
                                            "vLLM cuts the text at the string but not the ids")
    if not output_ids:
        raise InvalidRequest("output_token_ids", "empty")
    bad = next((i for i in output_ids if i >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest("output_token_ids", f"id {bad} is outside the vocabulary (size {vocab_size})")
    if decode(output_ids) == output_text:
        return VerifiedOutput(list(output_ids), False)
    last = output_ids[-1]
    droppable = last == stop_token_id or last in special_ids
    if finish_reason in ("stop", "") and droppable and decode(output_ids[:-1]) == output_text:
        return VerifiedOutput(list(output_ids[:-1]), True)
    raise InvalidRequest("output_token_ids", "decode(output_token_ids) does not equal output_text")


def verify_segment(text: bytes, ids: list[int], *, vocab_size: int, decode: Callable[[list[int]], str]) -> bool:
    """Whether ``ids`` may be spliced for the piece ``text`` (UTF-8): ids in the vocabulary
    that decode exactly to it — what a recorded output's segment passed when it was recorded.
    For entries that come from elsewhere (the cluster tier), checked again before use."""
    if not ids or max(ids) >= vocab_size:
        return False
    try:
        return decode(ids) == text.decode("utf-8")
    except (UnicodeDecodeError, ValueError, OverflowError):
        return False


def segment_variants(output_text: str, ids: list[int], token_bytes: TokenBytes | None,
                     boundary_spans: list[tuple[int, int]] = ()) -> list[Segment]:  # type: ignore[assignment]
    """The segment keys of a verified output.

    The output is cut at its own boundary tokens (``<think>``, ``</think>``,
    ``<tool_call>`` …), because a prompt is looked up piece by piece between
    boundaries: each piece of the output, and its whitespace-trimmed forms
    (``lstrip("\\n")``, ``strip()`` … — what templates do to history), is
    keyed where its ends fall on token boundaries of the generated ids.
    ``boundary_spans`` are byte offsets in the UTF-8 output. Without a byte
    table only the whole output is keyed.
    """
    whole = Segment(output_text, 0, len(ids))
    if token_bytes is None or not output_text:
        return [whole] if output_text else []
    data = output_text.encode("utf-8")
    offsets = token_bytes.offsets(ids)
    if offsets is None or offsets[-1] != len(data):
        return [whole]
    index = {off: k + 1 for k, off in enumerate(offsets)}
    index[0] = 0
    pieces: list[tuple[int, int]] = []
    a = 0
    for s, e in boundary_spans:
        pieces.append((a, s))
        a = e
    pieces.append((a, len(data)))
    spans: set[tuple[int, int]] = {(0, len(data))}
    for a, b in pieces:
        piece = data[a:b].decode("utf-8")
        if not piece.strip():
            continue
        heads = {0, len(piece) - len(piece.lstrip("\n")), len(piece) - len(piece.lstrip())}
        tails = {len(piece), len(piece.rstrip())}
        for h in heads:
            for t in tails:
                if h < t:
                    spans.add((a + len(piece[:h].encode("utf-8")), a + len(piece[:t].encode("utf-8"))))
    out: list[Segment] = []
    for a, b in sorted(spans):
        if a in index and b in index and index[a] < index[b]:
            out.append(Segment(data[a:b].decode("utf-8"), index[a], index[b]))
    return out
