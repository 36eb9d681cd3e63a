"""Result types of the client API (plain dataclasses; no protobuf types leak out)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheDecision", "ModelInfo", "RecordResult", "RecordSummary", "TokenizeResult", "local_result"]


@dataclass(frozen=True)
class CacheDecision:
    """How the sidecar produced the ids.

    ``source`` is ``"miss"`` (all encoded), ``"l0"`` (exact text cached),
    ``"l1"`` (a prefix cached, the rest encoded) or ``"ar"`` (recorded model
    output ids spliced in).
    """

    source: str
    cached_tokens: int
    cached_chars: int
    encoded_chars: int
    ar_spliced_tokens: int = 0
    boundaries: int = 0
    l1_disabled_reason: str = ""


@dataclass(frozen=True)
class TokenizeResult:
    """Token ids and the cache decision of one Tokenize call.

    ``served_by`` is ``"local"`` when the ids were decided in this process (the sidecar's
    shared memory read directly, no RPC) and ``"sidecar"`` when its Tokenize RPC answered.
    """

    token_ids: list[int]
    fingerprint: str
    decision: CacheDecision
    backend: str = ""
    prompt_text: str | None = None
    served_by: str = "sidecar"


_new = object.__new__


def local_result(token_ids: list[int], fingerprint: str, backend: str, source: str, cached_tokens: int,
                 cached_chars: int, encoded_chars: int, ar_spliced_tokens: int, boundaries: int,
                 l1_disabled_reason: str) -> TokenizeResult:
    """``TokenizeResult(token_ids, fingerprint, CacheDecision(source, ...), backend, None, "local")``:
    equal to it, as frozen, made without the dataclasses' ``__init__``. A frozen dataclass sets
    each field through ``object.__setattr__`` in a Python frame of its own, and an in-process
    read makes two (13 fields) for every request: ~1.6 µs warm against ~0.7 here, and several
    times that when the caches are cold between requests. Their ``__dict__`` is filled instead
    (neither class has ``__slots__`` nor a ``__post_init__``; a test checks the fields stay these)."""
    decision = _new(CacheDecision)
    decision.__dict__.update(source=source, cached_tokens=cached_tokens, cached_chars=cached_chars,
                             encoded_chars=encoded_chars, ar_spliced_tokens=ar_spliced_tokens, boundaries=boundaries,
                             l1_disabled_reason=l1_disabled_reason)
    result = _new(TokenizeResult)
    result.__dict__.update(token_ids=token_ids, fingerprint=fingerprint, decision=decision, backend=backend,
                           prompt_text=None, served_by="local")
    return result


@dataclass(frozen=True)
class ModelInfo:
    """A model served by the sidecar."""

    name: str
    fingerprint: str
    backend: str
    vocab_size: int
    boundary_tokens: int
    l1_disabled_reason: str
    has_chat_template: bool
    shm_name: str = ""
    model_dir: str = ""
    default_mode: str = ""


@dataclass(frozen=True)
class RecordResult:
    """What the sidecar stored for one recorded output."""

    recorded_tokens: int
    stop_token_dropped: bool
    entries: int


@dataclass(frozen=True)
class RecordSummary:
    """Outcome of a streamed batch of records; ``refusals`` are (index, reason)."""

    recorded: int
    refused: int
    refusals: list[tuple[int, str]]
