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
added tokens that passed :func:`~tokcache.engine.boundaries.check_boundaries`,
and the encoder passed the exactness suite against HF ``tokenizers``. The
store returns either the bytes put for a key or nothing.
"""

from __future__ import annotations

import logging
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blake3 import blake3

from tokcache.engine.affixes import Affixes, detect_affixes
from tokcache.engine.boundaries import BoundaryCheck, BoundaryScanner, check_boundaries
from tokcache.engine.encoder import EncoderChoice, _le, choose_encoder
from tokcache.engine.errors import InvalidRequest, RequestTooLarge
from tokcache.engine.memo import ChainMemo
from tokcache.sidecar.engine.ar import segment_variants, verify_output
from tokcache.sidecar.engine.render import ChatRenderer
from tokcache.sidecar.engine.tokenbytes import TokenBytes
from tokcache.store import Kind, Store, StoreError
from tokcache.store.keys import MODE_EXACT, MODE_KV_STABLE, KeyStream, TextKeys, segment_key

log = logging.getLogger(__name__)

__all__ = ["Decision", "Limits", "ModelEngine", "Outcome", "RecordResult", "fingerprint_of", "utf8"]

# Keys of the last cuts are computed in one pass (a turn adds ~4-12 cuts);
# also how many shorter cuts are tried when a winner's chain is broken.
_TAIL_PROBES = 16
# Segment AR: pieces shorter than this are not looked up; a recorded output
# may start after at most this many leading newlines of a piece (role headers).
_MIN_SEGMENT_BYTES = 4
_SEGMENT_HEADER_BYTES = 64
_SEGMENT_MAX_STARTS = 3


def _segment_starts(piece: bytes) -> list[int]:
    """Offsets where a recorded output may start in a piece: 0 and after early newlines."""
    starts = [0]
    pos = piece.find(b"\n", 0, _SEGMENT_HEADER_BYTES)
    while pos >= 0 and len(starts) < _SEGMENT_MAX_STARTS:
        starts.append(pos + 1)
        pos = piece.find(b"\n", pos + 1, _SEGMENT_HEADER_BYTES)
    return [s for s in starts if s < len(piece)]


def utf8(text: str) -> bytes:
    """``text`` as UTF-8; InvalidRequest naming ``text`` for a lone surrogate."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest("text", f"not valid Unicode at index {exc.start}") from exc


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
    # Per-layer lookup results (None: layer not consulted), for metrics.
    l0_hit: bool | None = None
    l1_hit: bool | None = None
    ar_prefix_hit: bool | None = None
    segment_splices: int = 0
    cached_bytes: int = 0
    encoded_bytes: int = 0
    stored: bool | None = None
    store_errors: int = 0
    # Phase -> (perf_counter_ns start, end), for trace child spans.
    timings: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class RecordResult:
    """What :meth:`ModelEngine.record_output` stored."""

    recorded_tokens: int
    stop_token_dropped: bool
    entries: int


@dataclass
class Outcome:
    """Result of :meth:`ModelEngine.tokenize`: ids as little-endian uint32 bytes."""

    ids: bytes
    decision: Decision
    # Writes the request's new cache entries (None: nothing to write). Run once.
    commit_step: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.ids) // 4

    def commit(self) -> None:
        """Store the new entries (no-op when there are none or they were stored)."""
        step, self.commit_step = self.commit_step, None
        if step is not None:
            step()


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
        self.token_bytes = TokenBytes.from_tokenizer_json(tokenizer_json)
        # Ids that vLLM may leave out of the text at the end of an output (EOS and friends).
        self.special_ids = frozenset(
            i for i, t in self.reference.tokenizer.get_added_tokens_decoder().items() if t.special)
        self.store = store
        self.memo = ChainMemo()
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
                 mode: str = "kv-stable", defer_store: bool = False) -> Outcome:
        """Ids of ``text`` (== HF tokenizers ``encode(text, add_special_tokens)``), via the cache.

        With ``defer_store`` the new cache entries are not written yet: the
        caller answers first and then calls ``Outcome.commit()`` (a server
        does that after sending the response, taking the store write off the
        request's latency). Without it they are written before returning.

        Raises InvalidRequest for text that is not valid Unicode (lone
        surrogates) and RequestTooLarge over the size limit. A failing store
        degrades to plain encoding; it never fails the request.
        """
        return self.tokenize_utf8(utf8(text), len(text), add_special_tokens=add_special_tokens, salt=salt, mode=mode,
                                  defer_store=defer_store)

    def tokenize_utf8(self, data: bytes, n_chars: int, *, add_special_tokens: bool, salt: str = "",
                      mode: str = "kv-stable", defer_store: bool = False) -> Outcome:
        """:meth:`tokenize` of a text given as valid UTF-8 ``data`` of ``n_chars`` characters
        (a server that assembled it from parts skips a decode and an encode)."""
        if len(data) > self.limits.max_text_bytes:
            raise RequestTooLarge("text", self.limits.max_text_bytes)
        decision = Decision(l1_disabled_reason=self.boundary_check.disabled_reason)
        if add_special_tokens and not self.affixes.separable:
            decision.l1_disabled_reason = f"add_special_tokens: {self.affixes.reason}"
            ids = _le(array("I", self.encoder.encode_full(data.decode("utf-8"))))
            decision.encoded_chars = n_chars
            return Outcome(ids, decision)
        raw, _key, commit = self._lookup_encode(data, salt, MODE_EXACT if mode == "exact" else MODE_KV_STABLE,
                                                decision, n_chars)
        if add_special_tokens and (self.affixes.prefix or self.affixes.suffix):
            raw = _le(array("I", self.affixes.prefix)) + raw + _le(array("I", self.affixes.suffix))
        out = Outcome(raw, decision, commit_step=commit)
        if not defer_store:
            out.commit()
        return out

    def _lookup_encode(self, data: bytes, salt: str, mode: bytes, decision: Decision,
                       n_chars: int) -> tuple[bytes, bytes, Callable[[], None] | None]:
        """(raw ids, L0 key, store step) of ``data``: L0, else longest L1/AR prefix + encoded tail.

        The store step (None when there is nothing to store) writes the new
        entries; call it once. Phase times (perf_counter_ns start, end) go to
        ``decision.timings`` for the tracer's child spans: lookup, encode,
        and insert when the store step runs.
        """
        t0 = time.perf_counter_ns()
        spans, base_len = self.scanner.spans_and_base(data)
        n = len(spans)
        decision.boundaries = n
        keys = TextKeys(data, spans, salt, mode)
        store = self.store
        kv_stable = mode == MODE_KV_STABLE
        # Recorded outputs are looked up only where some can exist: a segment that
        # never took an AR record answers every AR probe with a miss.
        try:
            ar = store is not None and kv_stable and store.holds_ar()
        except StoreError:
            ar = False  # the L0 read below fails the same way and turns the cache off
        # One hashing pass: the L1 keys of the last cuts (a turn adds a handful), the
        # AR keys between them and the whole-text key.
        keys.scan_tail(n - _TAIL_PROBES, ar=ar)
        exact_key = keys.exact_key()
        if store is not None:
            try:
                hit = self.memo.get(store, exact_key)
                if hit is None:
                    hit = store.get(exact_key)
            except StoreError:
                log.exception("store read failed; encoding without cache")
                decision.store_errors += 1
                store, hit, ar = None, None, False
            decision.l0_hit = hit is not None
            if hit is not None:
                decision.source = "l0"
                decision.cached_tokens = len(hit) // 4
                decision.cached_chars = n_chars
                decision.cached_bytes = len(data)
                decision.timings["lookup"] = (t0, time.perf_counter_ns())
                return hit, exact_key, None
        # Longest cached cut (L1). The cuts of the text this one extends were cached
        # when it was served: the last of them is the first guess.
        cuts = [end for _, end in spans]
        hint = bisect_right(cuts, base_len) - 1 if base_len else -1
        j, prefix = (-1, b"") if store is None else self._longest(store, self.memo, keys, n, hint)
        start = cuts[j] if j >= 0 else 0
        parent = keys.key(j) if j >= 0 else None
        first_new = j + 1  # index of the first cut not covered by the cached prefix
        if j >= 0:
            decision.source = "l1"
        decision.l1_hit = j >= 0
        if store is not None and ar:
            found = self._prefix_ar(store, keys, spans, j, start)
            decision.ar_prefix_hit = False
            if found is not None:
                i, ar_start, ar_key, ar_ids = found
                decision.ar_prefix_hit = True
                # Tokens gained over the L1 prefix: the recorded output (and the
                # few prompt tokens between the L1 cut and the output).
                decision.ar_spliced_tokens = (len(ar_ids) - len(prefix)) // 4
                prefix, start, parent, first_new = ar_ids, ar_start, ar_key, i
                decision.source = "ar"
        # Pieces: (text up to the next boundary token, that token), the last with none.
        pieces: list[tuple[bytes, bytes]] = []
        a = start
        for s_i, e_i in spans[first_new:]:
            pieces.append((data[a:s_i], data[s_i:e_i]))
            a = e_i
        pieces.append((data[a:], b""))
        t1 = time.perf_counter_ns()
        decision.timings["lookup"] = (t0, t1)
        flat, ends, spliced = self._encode_pieces(pieces, salt, mode, store if ar else None)
        t2 = time.perf_counter_ns()
        decision.timings["encode"] = (t1, t2)
        decision.segment_splices = spliced
        if spliced:
            decision.ar_spliced_tokens += spliced
            if decision.source in ("miss", "l1"):
                decision.source = "ar"
        tail_chars = len(data[start:].decode("utf-8"))
        if decision.source != "miss":
            decision.cached_tokens = len(prefix) // 4
            decision.cached_chars = n_chars - tail_chars
        decision.encoded_chars = tail_chars
        decision.cached_bytes = start
        decision.encoded_bytes = len(data) - start
        full = prefix + flat
        if store is None:
            return full, exact_key, None

        def commit() -> None:
            """Store one record with the new ids: a key per new cut, and the L0 key."""
            assert store is not None
            t3 = time.perf_counter_ns()
            keys.fill(first_new, n)
            entries: list[tuple[bytes, int] | tuple[bytes, int, Kind]] = [
                (keys.key(i), ends[k]) for k, i in enumerate(range(first_new, n))]
            entries.append((exact_key, ends[-1], Kind.L0))  # its own kind: --ttl-l0 applies
            try:
                decision.stored = store.put(parent, len(prefix) // 4, flat, entries, Kind.L1)
            except StoreError:
                log.exception("store write failed; result served uncached")
                decision.store_errors += 1
            if decision.stored:
                # The next turn of this conversation looks these up: keep their ids
                # (one buffer; the last cut's ids are a prefix of it).
                if n > first_new:
                    self.memo.put(store, keys.key(n - 1), full, len(prefix) + ends[n - 1 - first_new] * 4)
                self.memo.put(store, exact_key, full)
            elif parent is not None:
                self.memo.drop(parent)  # its chain may be gone: read it from the store next time
            decision.timings["insert"] = (t3, time.perf_counter_ns())

        return full, exact_key, commit

    @staticmethod
    def _prefix_ar(store: Store, keys: TextKeys, spans: list[tuple[int, int]],
                   j: int, start: int) -> tuple[int, int, bytes, bytes] | None:
        """The longest recorded output ending where a boundary token starts, beyond the L1 hit.

        Returns (index of that boundary, its start offset, AR key, ids) or None.
        """
        for i in range(len(spans) - 1, j, -1):
            s = spans[i][0]
            if s < start:
                break
            key = keys.ar_key(i)
            hit = store.get(key)
            if hit is not None:
                return i, s, key, hit
        return None

    def _encode_pieces(self, pieces: list[tuple[bytes, bytes]], salt: str, mode: bytes,
                       store: Store | None) -> tuple[bytes, list[int], int]:
        """Encode ``pieces`` (body, boundary token) in one call; with a store, splice segment AR.

        A body whose text — from its start, or after one of its first
        newlines (a role header such as ``assistant\\n``) — is a recorded
        output is encoded as ``encode(header) + recorded ids``. Returns (flat
        ids, cumulative token count after each piece, spliced token count).
        """
        splices: dict[int, tuple[int, bytes]] = {}
        if store is not None:
            for n, (body, _) in enumerate(pieces):
                if len(body) < _MIN_SEGMENT_BYTES:
                    continue
                for p in _segment_starts(body):
                    hit = store.get(segment_key(salt, mode, body[p:]))
                    if hit is not None:
                        splices[n] = (p, hit)
                        break
        if not splices:
            flat, ends = self.encoder.encode_segments([(b + t).decode("utf-8") for b, t in pieces])
            return flat, ends, 0
        # Spliced pieces are encoded as two texts (header, token) around the recorded ids.
        texts: list[str] = []
        for n, (body, token) in enumerate(pieces):
            if n in splices:
                texts += [body[:splices[n][0]].decode("utf-8"), token.decode("utf-8")]
            else:
                texts.append((body + token).decode("utf-8"))
        flat, ends = self.encoder.encode_segments(texts)
        out: list[bytes] = []
        piece_ends: list[int] = []
        total = prev = k = spliced = 0
        for n in range(len(pieces)):
            if n in splices:
                head, tok = flat[prev * 4:ends[k] * 4], flat[ends[k] * 4:ends[k + 1] * 4]
                ar_ids = splices[n][1]
                chunk = head + ar_ids + tok
                spliced += len(ar_ids) // 4
                prev = ends[k + 1]
                k += 2
            else:
                chunk = flat[prev * 4:ends[k] * 4]
                prev = ends[k]
                k += 1
            out.append(chunk)
            total += len(chunk) // 4
            piece_ends.append(total)
        return b"".join(out), piece_ends, spliced

    # -- AR: recorded outputs ---------------------------------------------

    def record_output(self, *, prompt_text: str, prompt_ids: list[int], output_text: str,
                      output_ids: list[int], finish_reason: str = "stop", stop_token_id: int | None = None,
                      stop_string: str | None = None, salt: str = "",
                      prompt_add_special_tokens: bool = False) -> RecordResult:
        """Verify a finished generation and store its AR entries (kv-stable namespace).

        Raises InvalidRequest (nothing stored) when the output ids do not
        decode to the text, an id is out of the vocabulary, the finish was a
        stop string, or the prompt ids are neither what tokcache serves for
        ``prompt_text`` nor its canonical tokenization.
        """
        if self.store is None:
            raise InvalidRequest("model", "no cache configured")
        for field_name, text in (("prompt_text", prompt_text), ("output_text", output_text)):
            if len(text) > self.limits.max_text_bytes:  # chars <= bytes: a cheap first test
                raise RequestTooLarge(field_name, self.limits.max_text_bytes)
        if prompt_ids and max(prompt_ids) >= self.vocab_size:
            raise InvalidRequest("prompt_token_ids", f"id {max(prompt_ids)} is outside the vocabulary "
                                                     f"(size {self.vocab_size})")
        verified = verify_output(
            output_text=output_text, output_ids=output_ids, finish_reason=finish_reason,
            stop_token_id=stop_token_id, stop_string=stop_string, vocab_size=self.vocab_size,
            special_ids=self.special_ids, decode=self._decode)
        # The prompt: what we serve for it (kv-stable), or its canonical ids.
        try:
            data = prompt_text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest("prompt_text", f"not valid Unicode at index {exc.start}") from exc
        affix_pre = list(self.affixes.prefix) if prompt_add_special_tokens else []
        affix_suf = list(self.affixes.suffix) if prompt_add_special_tokens else []
        if affix_suf:
            raise InvalidRequest("prompt_add_special_tokens",
                                 "this tokenizer appends special tokens to prompts; outputs cannot follow them")
        if prompt_ids[:len(affix_pre)] != affix_pre:
            raise InvalidRequest("prompt_token_ids", "does not start with the tokenizer's BOS tokens")
        raw_prompt = prompt_ids[len(affix_pre):]
        served, prompt_key, commit = self._lookup_encode(data, salt, MODE_KV_STABLE, Decision(), len(prompt_text))
        if commit is not None:
            commit()  # the AR record chains to the prompt's entry: store it first
        out_bytes = _le(array("I", verified.ids))
        if _le(array("I", raw_prompt)) == served:
            parent, parent_tokens, record = prompt_key, len(raw_prompt), out_bytes
        elif raw_prompt == self.encoder.encode(prompt_text):
            parent, parent_tokens, record = None, 0, _le(array("I", raw_prompt)) + out_bytes
        else:
            raise InvalidRequest("prompt_token_ids", "not what tokcache serves for prompt_text, "
                                                     "nor its canonical tokenization")
        stream = KeyStream(salt, MODE_KV_STABLE)
        stream.feed(data)
        stream.feed(output_text.encode("utf-8"))
        prefix_key = stream.output_key()
        n_out = len(verified.ids)
        entries = self._put_ar(parent, parent_tokens, record, [(prefix_key, len(record) // 4)])
        # Segment entries, one record per distinct start token.
        by_start: dict[int, list[tuple[bytes, int]]] = {}
        out_data = output_text.encode("utf-8")
        for seg in segment_variants(output_text, verified.ids, self.token_bytes, self.scanner.spans(out_data)):
            if len(seg.text) < _MIN_SEGMENT_BYTES and seg.text != output_text:
                continue  # a tiny fragment ("\n") would splice into unrelated text
            key = segment_key(salt, MODE_KV_STABLE, seg.text.encode("utf-8"))
            by_start.setdefault(seg.start, []).append((key, seg.end - seg.start))
        for seg_start, keys in by_start.items():
            longest = max(n for _, n in keys)
            entries += self._put_ar(None, 0, _le(array("I", verified.ids[seg_start:seg_start + longest])), keys)
        # A store that took nothing (full of a bigger record, lock stuck) is reported, not
        # raised: recording is best effort and the caller's request already succeeded.
        return RecordResult(recorded_tokens=n_out if entries else 0,
                            stop_token_dropped=verified.stop_token_dropped, entries=entries)

    def _put_ar(self, parent: bytes | None, parent_tokens: int, ids: bytes,
                keys: list[tuple[bytes, int]]) -> int:
        """Store one AR record; the number of keys stored (0 if the store refused or failed)."""
        assert self.store is not None
        try:
            return len(keys) if self.store.put(parent, parent_tokens, ids, keys, Kind.AR) else 0
        except StoreError:
            log.exception("store write failed; output not recorded")
            return 0

    def _decode(self, ids: list[int]) -> str:
        return str(self.reference.tokenizer.decode(ids, skip_special_tokens=False))

    @staticmethod
    def _longest(store: Store, memo: ChainMemo, keys: TextKeys, n: int, hint: int = -1) -> tuple[int, bytes]:
        """(index, ids) of the longest cut whose prefix is cached, or (-1, b"").

        ``hint``: a cut that is probably cached and probably the longest (the
        last cut of the text this one extends). Checked first, with the cut
        after it: a conversation's next turn settles in two index probes.
        Otherwise gallops back from the last cut (a turn adds a handful of
        cuts, a history rewrite many) with cheap index probes, binary-searches
        the bracket, and reads the chain of the winner only; a winner whose
        chain turns out broken is skipped for the next shorter present cut.
        """
        hi = n - 1  # highest index that may be present
        lo = -1  # known present (or -1)
        if 0 <= hint < n and store.contains(keys.key(hint)):
            lo = hint
            if hint + 1 >= n or not store.contains(keys.key(hint + 1)):
                hi = hint
            else:
                lo = hint + 1
        if lo < hi:
            step = 1
            probe = n - 1
            while probe > lo:
                if store.contains(keys.key(probe)):
                    lo = probe
                    break
                hi = probe - 1
                probe = n - 1 - step
                step *= 2
            if lo < 0 and probe < 0 and hi >= 0:
                if store.contains(keys.key(0)):
                    lo = 0
        if lo < 0:
            return -1, b""
        # Present at lo, absent at every probed index above it: binary search (lo, hi].
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if store.contains(keys.key(mid)):
                lo = mid
            else:
                hi = mid - 1
        for i in range(lo, max(-1, lo - _TAIL_PROBES), -1):
            key = keys.key(i)
            hit = memo.get(store, key)
            if hit is None:
                hit = store.get(key)
            if hit is not None:
                return i, hit
        return -1, b""

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
        }
