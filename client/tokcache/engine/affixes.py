"""Post-processor special tokens (BOS/EOS) as a separable prefix/suffix.

The cache stores *raw* ids (no post-processor tokens), so one entry serves
requests with and without ``add_special_tokens``. That is only sound when the
post-processor does nothing but wrap the raw ids in fixed ids:
``encode(x, True) == prefix + encode(x, False) + suffix`` for every ``x``.
:func:`detect_affixes` learns ``prefix``/``suffix`` from probes and checks
that property; when it fails, requests with ``add_special_tokens`` bypass the
cache rather than risk wrong ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokcache.engine.encoder import Encoder

__all__ = ["Affixes", "detect_affixes"]

_PROBES = ("", "a", "hello world", " x ", "\n\n", "你好", "<|im_end|>", "1 2 3", "  ")


@dataclass(frozen=True)
class Affixes:
    """What ``add_special_tokens=True`` adds around raw ids; ``separable`` False if not a wrap."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    separable: bool
    reason: str = ""

    def apply(self, raw: Sequence[int]) -> list[int]:
        """``prefix + raw + suffix``; only valid when ``separable``."""
        return [*self.prefix, *raw, *self.suffix]


def _split(full: list[int], raw: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Find ``raw`` inside ``full`` as ``prefix + raw + suffix``; None if it is not."""
    for start in range(len(full) - len(raw) + 1):
        if full[start:start + len(raw)] == raw:
            return tuple(full[:start]), tuple(full[start + len(raw):])
    return None


def detect_affixes(reference: Encoder, probes: Sequence[str] = _PROBES) -> Affixes:
    """Learn the BOS/EOS wrap of ``reference`` (the HF tokenizers encoder)."""
    found: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    # Longest probe first: with raw ids of length 0 the split is ambiguous.
    for text in sorted(probes, key=len, reverse=True):
        raw = reference.encode(text)
        full = reference.encode_full(text)
        split = _split(full, raw)
        if split is None:
            return Affixes((), (), False, f"post-processor rewrites ids of {text!r}")
        if raw and found is None:
            found = split
        if found is not None and split != found and raw:
            return Affixes((), (), False, "post-processor adds different ids per input")
        if found is not None and not raw and list(found[0] + found[1]) != full:
            return Affixes((), (), False, "post-processor differs on empty input")
    assert found is not None  # "hello world" always has raw ids
    return Affixes(found[0], found[1], True)
