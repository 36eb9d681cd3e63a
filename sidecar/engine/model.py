"""One served model: its tokenizer, template, boundaries and cache, and Tokenize.

The lookup, for a text ``T`` with safe cuts ``c1 < … < cK``:

1. L0: the whole of ``T`` → ids, one store read.
2. L1: the longest cut ``cj`` whose prefix ``T[:cj]`` is cached (probe the
   last few cuts, then binary-search the rest: a growing conversation has all
   its earlier cuts cached and none of the new ones).
3. Encode only ``T[cj:]``, one segment per remaining cut, in one native call.
4. Store one record with the new segment ids, chained to the ``cj`` entry,
   with a key for every new cut and the L0 key for ``T``. Memory grows with
   the new text only: no prefix is ever copied.

Correctness rests on two facts checked at load: cuts are only made after
added tokens that passed :func:`~sidecar.engine.boundaries.check_boundaries`,
and the encoder passed the exactness suite against HF ``tokenizers``. The
store returns either the bytes put for a key or nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blake3 import blake3

from sidecar.engine.affixes import Affixes, detect_affixes
from sidecar.engine.boundaries import BoundaryCheck, BoundaryScanner, check_boundaries
from sidecar.engine.encoder import EncoderChoice, _le, choose_encoder
from sidecar.engine.errors import InvalidRequest, RequestTooLarge
from sidecar.engine.keys import MODE_EXACT, MODE_KV_STABLE, KeyStream
from sidecar.engine.render import ChatRenderer
from sidecar.store import Kind, Store, StoreError

from array import array

log = logging.getLogger(__name__)

__all__ = ["Decision", "Limits", "ModelEngine", "Outcome", "fingerprint_of"]

# Probing the last cuts first finds a growing conversation's hit at once;
# the rest is binary-searched.
_TAIL_PROBES = 4


def fingerprint_of(tokenizer_json: Path) -> str:
    """Tokenizer identity: blake3 of tokenizer.json, 32 hex chars.

    Ids depend on tokenizer.json alone (templates only change the text), so
    that is what the cache segment and the vLLM handshake are bound to.
    """
    return blake3(tokenizer_json.read_bytes()).hexdigest(16)


@dataclass(frozen=True)
class Limits:
    """Request size limits; over them a request is refused with RESOURCE_EXHAUSTED."""

    max_text_bytes: int = 8 << 20
    max_messages: int = 10_000


@dataclass
class Decision:
    """How the ids of one request were produced (mirrors the proto CacheDecision)."""

    source: str = "miss"  # miss | l0 | l1 | ar
    cached_tokens: int = 0
    cached_chars: int = 0
    encoded_chars: int = 0
    ar_spliced_tokens: int = 0
    boundaries: int = 0
    l1_disabled_reason: str = ""


@dataclass
class Outcome:
    """Result of :meth:`ModelEngine.tokenize`: ids as little-endian uint32 bytes."""

    ids: bytes
    decision: Decision
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.ids) // 4


class ModelEngine:
    """Everything needed to serve one tokenizer; thread-safe after construction."""

    def __init__(self, name: str, path: Path, *, store: Store | None,
                 limits: Limits | None = None, backends: tuple[str, ...] = ("fastokens", "tokenizers")) -> None:
        self.name = name
        self.path = path
        tokenizer_json = path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"model {name!r}: {tokenizer_json} not found")
        self.fingerprint = fingerprint_of(tokenizer_json)
        self.choice: EncoderChoice = choose_encoder(tokenizer_json, allow=backends)
        self.encoder = self.choice.encoder
        self.reference = self.choice.reference
        self.vocab_size: int = self.reference.tokenizer.get_vocab_size(with_added_tokens=True)
        self.boundary_check: BoundaryCheck = check_boundaries(tokenizer_json, self.reference)
        self.scanner = BoundaryScanner.from_tokenizer(tokenizer_json, self.boundary_check)
        self.affixes: Affixes = detect_affixes(self.reference)
        self.renderer: ChatRenderer | None = ChatRenderer.from_dir(path)
        self.store = store
        self.limits = limits or Limits()
        log.info(
            "model %s: fingerprint %s, backend %s (passed %s, failed %s), %d boundary tokens%s, affixes %s",
            name, self.fingerprint, self.encoder.name, ",".join(self.choice.passed),
            ",".join(self.choice.failed) or "-", len(self.boundary_check.boundary_tokens),
            f" (L1 off: {self.boundary_check.disabled_reason})" if self.boundary_check.disabled_reason else "",
            self.affixes if self.affixes.separable else f"not separable: {self.affixes.reason}",
        )

    # -- rendering --------------------------------------------------------

    def render(self, messages: Any, **options: Any) -> str:
        """Render chat messages with the model's template (see ChatRenderer.render)."""
        if self.renderer is None:
            raise InvalidRequest("chat", f"model {self.name!r} has no chat template")
        if isinstance(messages, list) and len(messages) > self.limits.max_messages:
            raise RequestTooLarge("chat.messages", self.limits.max_messages)
        return self.renderer.render(messages, **options)

    # -- tokenize ---------------------------------------------------------

    def tokenize(self, text: str, *, add_special_tokens: bool, salt: str = "",
                 mode: str = "kv-stable") -> Outcome:
        """Ids of ``text`` (== HF tokenizers ``encode(text, add_special_tokens)``), via the cache.

        Raises InvalidRequest for text that is not valid Unicode (lone
        surrogates) and RequestTooLarge over the size limit. A failing store
        degrades to plain encoding; it never fails the request.
        """
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest("text", f"not valid Unicode at index {exc.start}") from exc
        if len(data) > self.limits.max_text_bytes:
            raise RequestTooLarge("text", self.limits.max_text_bytes)
        decision = Decision(l1_disabled_reason=self.boundary_check.disabled_reason)
        if add_special_tokens and not self.affixes.separable:
            decision.l1_disabled_reason = f"add_special_tokens: {self.affixes.reason}"
            ids = _le(array("I", self.encoder.encode_full(text)))
            decision.encoded_chars = len(text)
            return Outcome(ids, decision)
        raw = self._raw_ids(data, salt, MODE_EXACT if mode == "exact" else MODE_KV_STABLE, decision)
        if add_special_tokens and (self.affixes.prefix or self.affixes.suffix):
            raw = _le(array("I", self.affixes.prefix)) + raw + _le(array("I", self.affixes.suffix))
        return Outcome(raw, decision)

    def _raw_ids(self, data: bytes, salt: str, mode: bytes, decision: Decision) -> bytes:
        cuts = self.scanner.cuts(data)
        decision.boundaries = len(cuts)
        stream = KeyStream(salt, mode)
        keys: list[bytes] = []
        prev = 0
        for cut in cuts:
            stream.feed(data[prev:cut])
            keys.append(stream.prefix_key())
            prev = cut
        stream.feed(data[prev:])
        exact_key = stream.exact_key()
        store = self.store
        if store is not None:
            try:
                hit = store.get(exact_key)
            except StoreError:
                log.exception("store read failed; encoding without cache")
                store = None
                hit = None
            if hit is not None:
                decision.source = "l0"
                decision.cached_tokens = len(hit) // 4
                decision.cached_chars = len(data.decode("utf-8"))
                return hit
        # Longest cached cut.
        j, prefix = (-1, b"") if store is None else self._longest(store, keys)
        start = cuts[j] if j >= 0 else 0
        bounds = [*cuts[j + 1:], len(data)]
        pieces: list[str] = []
        a = start
        for b in bounds:
            pieces.append(data[a:b].decode("utf-8"))
            a = b
        # The last piece (after the last cut) may be empty; encoders give [] for it.
        flat, ends = self.encoder.encode_segments(pieces)
        tail_chars = sum(len(p) for p in pieces)
        if j >= 0:
            decision.source = "l1"
            decision.cached_tokens = len(prefix) // 4
            decision.cached_chars = len(data.decode("utf-8")) - tail_chars
        decision.encoded_chars = tail_chars
        if store is not None:
            entries = [(keys[i], ends[n]) for n, i in enumerate(range(j + 1, len(cuts)))]
            entries.append((exact_key, ends[-1]))
            try:
                store.put(keys[j] if j >= 0 else None, len(prefix) // 4, flat, entries, Kind.L1)
            except StoreError:
                log.exception("store write failed; result served uncached")
        return prefix + flat

    @staticmethod
    def _longest(store: Store, keys: list[bytes]) -> tuple[int, bytes]:
        """(index, ids) of the longest cut whose prefix is cached, or (-1, b"")."""
        n = len(keys)
        for i in range(n - 1, max(-1, n - 1 - _TAIL_PROBES), -1):
            hit = store.get(keys[i])
            if hit is not None:
                return i, hit
        best: tuple[int, bytes] = (-1, b"")
        lo, hi = 0, n - 1 - _TAIL_PROBES
        while lo <= hi:
            mid = (lo + hi) // 2
            hit = store.get(keys[mid])
            if hit is None:
                hi = mid - 1
            else:
                best = (mid, hit)
                lo = mid + 1
        return best

    def info(self) -> dict[str, Any]:
        """Static facts about this model, for ListModels and logs."""
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "backend": self.encoder.name,
            "vocab_size": self.vocab_size,
            "boundary_tokens": len(self.boundary_check.boundary_tokens),
            "l1_disabled_reason": self.boundary_check.disabled_reason,
            "has_chat_template": self.renderer is not None,
            "loaded_at": time.time(),
        }
