"""Recording what a model generated: verify the output, then store prompt + output as one chain.

Verification (nothing unverified is stored; a refusal changes nothing):

* every id is in the vocabulary;
* ``decode(ids) == output_text`` — after dropping one trailing stop/EOS id that is absent
  from the text (vLLM keeps EOS in ``token_ids``, not in ``text``); checked with the
  tokenizer's byte table where it has one (:mod:`tokcache.engine.tokenbytes`), else with
  ``tokenizers``' own decode;
* a finish by stop *string* is refused: vLLM truncates the text at the string but not the
  ids, so the ids run past the text;
* the prompt ids are what tokcache serves for the prompt text: the ids a read in this
  process just served for it (:class:`Served`, compared in C), or what the segment holds
  for it, or what a lookup serves for it now, or failing all those its canonical encoding.

What is stored. The prompt's entries and the output go into the segment as one chain: when
the read that served the prompt left its entries unstored (its :class:`PendingWrite`), one
record holds the prompt's new ids and the output's, keyed at the prompt's cuts (L1), its
end (L0) and the output's end (the *prefix* AR entry, prompt text + output text -> prompt
ids + output ids); else one record of the output's ids continues the prompt's stored
chain. *Segment* entries (output text alone -> output ids, for the whole output and the
variants templates produce when they re-render history: the content after ``</think>``,
whitespace-trimmed forms) are records of their own, each keyed only where its start and
end fall on token boundaries of the generated ids; they carry ``F_SEGMENT`` so whoever
feeds the cluster tier finds them by following the log.

:class:`Recorder` runs in whichever process has the output and a writable mapping: vLLM's
API server (through the client library) or the sidecar (``RecordOutput``): one writer.
"""

from __future__ import annotations

import json
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic

from tokcache import native
from tokcache.engine.errors import InvalidRequest, RequestTooLarge
from tokcache.engine.ids import LISTS, Chunks, IdFormat, Ids, Out
from tokcache.engine.lookup import Lookup, PendingWrite, ReadModel, utf8
from tokcache.engine.memo import ChainMemo
from tokcache.engine.tokenbytes import TokenBytes
from tokcache.ids import pack_ids, unpack_ids
from tokcache.store import F_SEGMENT, Kind, RecordRef, Store, StoreError
from tokcache.store.keys import MODE_KV_STABLE, l0_key, output_key, segment_key, segment_root

__all__ = ["OutputChecks", "RecordResult", "Recorder", "Segment", "Served", "VerifiedOutput", "segment_variants",
           "verify_output", "verify_segment"]

_native: Any = native.engine()

THINK_END = "</think>"
# Segment AR: a recorded output's pieces shorter than this are not keyed on their own.
MIN_SEGMENT_BYTES = 4


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


class OutputChecks:
    """What checking an output needs of its tokenizer: the vocabulary size, the ids a server
    may leave out of the text at the end (the special added tokens: EOS and friends), the
    byte table, and ``tokenizers``' decode (loaded on first need: the byte table decides
    every output of a byte-level BPE tokenizer). Thread-safe."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, *, reference: Any = None) -> None:  # noqa: ANN401
        self.vocab_size = vocab_size
        self.path = tokenizer_json
        data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
        self.special_ids = frozenset(int(t["id"]) for t in data.get("added_tokens") or [] if t.get("special"))
        self.token_bytes = TokenBytes.from_tokenizer_json(tokenizer_json)
        self._reference = reference  # a tokenizers.Tokenizer
        self._lock = threading.Lock()  # guards the reference's loading

    def decode(self, ids: list[int]) -> str:
        """``tokenizers``' ``decode(ids, skip_special_tokens=False)``."""
        ref = self._reference
        if ref is None:
            with self._lock:
                if self._reference is None:
                    import tokenizers

                    self._reference = tokenizers.Tokenizer.from_file(str(self.path))
                ref = self._reference
        return str(ref.decode(ids, skip_special_tokens=False))

    def decodes_to(self, ids: list[int], text: str, data: bytes | None = None) -> bool:
        """Whether ``decode(ids) == text`` (``data``: its UTF-8, when the caller has it)."""
        table = self.token_bytes
        if table is not None:
            got = table.decodes_to(ids, data if data is not None else text.encode("utf-8", "surrogatepass"))
            if got is not None:
                return got
        try:
            return self.decode(ids) == text
        except (ValueError, OverflowError, TypeError):
            return False


def verify_output(*, output_text: str, output_ids: list[int], finish_reason: str, stop_token_id: int | None,
                  stop_string: str | None, checks: OutputChecks) -> VerifiedOutput:
    """Check an output as described in the module docstring; InvalidRequest names the reason."""
    if stop_string is not None:
        # Named as the client's parameter (record_output(stop_reason="...")); the
        # proto field is stop_string.
        raise InvalidRequest("stop_reason", "a finish by a stop string is not recorded: "
                                            "vLLM cuts the text at the string but not the ids")
    if not output_ids:
        raise InvalidRequest("output_token_ids", "empty")
    top = max(output_ids)
    if top >= checks.vocab_size:
        raise InvalidRequest("output_token_ids", f"id {top} is outside the vocabulary (size {checks.vocab_size})")
    data = output_text.encode("utf-8", "surrogatepass")
    if checks.decodes_to(output_ids, output_text, data):
        return VerifiedOutput(list(output_ids), False)
    last = output_ids[-1]
    droppable = last == stop_token_id or last in checks.special_ids
    if finish_reason in ("stop", "") and droppable and checks.decodes_to(output_ids[:-1], output_text, data):
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
                     boundary_spans: Sequence[tuple[int, int]] = (), data: bytes | None = None) -> list[Segment]:
    """The segment keys of a verified output.

    The output is cut at its own boundary tokens (``<think>``, ``</think>``,
    ``<tool_call>`` …), because a prompt is looked up piece by piece between
    boundaries: each piece of the output, and its whitespace-trimmed forms
    (``lstrip("\\n")``, ``strip()`` … — what templates do to history), is
    keyed where its ends fall on token boundaries of the generated ids.
    ``boundary_spans`` are byte offsets in the UTF-8 output (``data``, when the
    caller has it). Without a byte table only the whole output is keyed.
    """
    whole = Segment(output_text, 0, len(ids))
    if token_bytes is None or not output_text:
        return [whole] if output_text else []
    if data is None:
        data = output_text.encode("utf-8")
    offsets = token_bytes.offsets(ids)
    if offsets is None or offsets[-1] != len(data):
        return [whole]

    def token_at(off: int) -> int:
        """How many tokens end exactly at byte ``off`` (-1: it falls inside a token)."""
        if off == 0:
            return 0
        k = bisect_left(offsets, off)
        return k + 1 if k < len(offsets) and offsets[k] == off else -1

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
        ascii_piece = piece.isascii()  # then character offsets are byte offsets
        for h in heads:
            for t in tails:
                if h < t:
                    if ascii_piece:
                        spans.add((a + h, a + t))
                    else:
                        spans.add((a + len(piece[:h].encode("utf-8")), a + len(piece[:t].encode("utf-8"))))
    out: list[Segment] = []
    for a, b in sorted(spans):
        ka, kb = token_at(a), token_at(b)
        if ka >= 0 and kb > ka:
            out.append(Segment(data[a:b].decode("utf-8"), ka, kb))
    return out


@dataclass(frozen=True)
class RecordResult:
    """What :meth:`Recorder.record` stored."""

    recorded_tokens: int
    stop_token_dropped: bool
    entries: int
    # How the prompt ids were matched: "served" (a read of this process served them), "stored"
    # (the segment holds them), "looked_up" (a lookup serves them now), "canonical".
    prompt: str = ""
    # The record's first id past the prompt (its chain's tokens before the output).
    prompt_tokens: int = 0


@dataclass
class Served(Generic[Ids, Out]):
    """A prompt a read served in this process, kept for the record of its output.

    ``ids``: the container the caller got (affixes included); ``full``: the prompt's raw ids
    (no affixes) as this process keeps them, ``n`` of them; ``write``: its entries when the
    read left them unstored for the record (None: stored, or nothing to store).
    """

    text: str
    salt: str
    mode: str
    add_special_tokens: bool
    ids: Out
    full: Ids
    n: int
    write: PendingWrite[Ids] | None
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()

    def matches(self, ids: Sequence[int] | bytes, fmt: IdFormat[Ids, Out]) -> bool:
        """Whether ``ids`` (a caller's prompt ids) are the ones served: compared with what this
        process keeps, not with the caller's container (which the caller may have changed)."""
        if isinstance(ids, list) and isinstance(self.full, Chunks) and _native is not None:
            return bool(_native.equal_ids(ids, self.prefix, self.full.parts, self.n, self.suffix))
        want = fmt.result(self.full, self.n, self.prefix, self.suffix)
        if isinstance(ids, bytes):
            return ids == (want if isinstance(want, bytes) else pack_ids(want))
        return list(ids) == (unpack_ids(want) if isinstance(want, bytes) else want)


Serve = Callable[[str, str], "tuple[Out, PendingWrite[Ids] | None]"]
"""serve(prompt_text, salt): what a kv-stable read serves for a prompt (no special tokens) and
the entries it learned, not stored (None: nothing to store)."""

StoreFailed = Callable[[StoreError, str], None]
"""store_failed(error, consequence): a write failed (logged and counted by the caller)."""
_Entries = Sequence[tuple[bytes, int] | tuple[bytes, int, Kind] | tuple[bytes, int, Kind, int]]
_Put = tuple["bytes | None", int, bytes, _Entries, Kind, int]
"""Store.put's arguments: (parent, parent_tokens, ids, entries, kind, flags)."""


class Recorder(Generic[Ids, Out]):
    """Verifies and stores recorded outputs into one segment (see the module docstring).

    ``lookup`` reads what the segment holds for a prompt and keeps the memo (the record's
    chain is remembered there, so the turn that continues it reads nothing); ``serve``
    serves prompts this process did not read; ``store`` is the segment, writable.
    Thread-safe (the store serialises writers).
    """

    def __init__(self, model: ReadModel, checks: OutputChecks, lookup: Lookup[Ids, Out], serve: Serve[Out, Ids],
                 store: Store, *, max_text_bytes: int, store_failed: StoreFailed | None = None,
                 lock_timeout: float | None = None) -> None:
        self.model = model
        self.checks = checks
        self.lookup: Lookup[Ids, Out] = lookup
        self.serve: Serve[Out, Ids] = serve
        self.store = store
        self.memo: ChainMemo[Ids] = lookup.memo
        self.fmt: IdFormat[Ids, Out] = lookup.memo.fmt
        self.max_text_bytes = max_text_bytes
        self._store_failed = store_failed
        # How long a record's writes wait for the writer lock (None: the store's default).
        self.lock_timeout = lock_timeout

    def record(self, *, prompt_text: str, prompt_ids: Sequence[int] | bytes, output_text: str,
               output_ids: list[int], finish_reason: str = "stop", stop_token_id: int | None = None,
               stop_string: str | None = None, salt: str = "", prompt_add_special_tokens: bool = False,
               served: Served[Ids, Out] | None = None) -> RecordResult:
        """Verify a finished generation and store its chain (kv-stable namespace).

        ``prompt_ids``: a list, or packed little-endian uint32. ``served``: what a read of this
        process served for ``prompt_text`` (its entries go into the record's chain when it left
        them unstored). Raises InvalidRequest (nothing stored) when the output ids do not decode
        to the text, an id is out of the vocabulary, the finish was a stop string, or the
        prompt ids are not what tokcache serves for ``prompt_text`` nor its canonical
        tokenization; RequestTooLarge for texts over the limit. A store that takes nothing
        (full of a bigger record, its lock stuck) is reported as 0 entries, not raised: the
        caller's request already succeeded.
        """
        for field_name, text in (("prompt_text", prompt_text), ("output_text", output_text)):
            if len(text) > self.max_text_bytes:  # chars <= bytes: a cheap first test
                raise RequestTooLarge(field_name, self.max_text_bytes)
        verified = verify_output(output_text=output_text, output_ids=output_ids, finish_reason=finish_reason,
                                 stop_token_id=stop_token_id, stop_string=stop_string, checks=self.checks)
        affixes = self.model.affixes
        if prompt_add_special_tokens and affixes.suffix:
            raise InvalidRequest("prompt_add_special_tokens",
                                 "this tokenizer appends special tokens to prompts; outputs cannot follow them")
        out = verified.ids
        out_data = output_text.encode("utf-8")
        if (served is not None and served.salt == salt and served.mode == "kv-stable"
                and served.add_special_tokens == prompt_add_special_tokens
                and (served.text is prompt_text or served.text == prompt_text)
                and served.matches(prompt_ids, self.fmt)):
            how, chain = "served", self._chain(served, salt, out, out_data)
        else:
            how, chain = self._match_prompt(prompt_text, prompt_ids, salt, out, out_data, prompt_add_special_tokens)
        segments: list[tuple[_Put, list[tuple[bytes, int, Kind, int]]]] = self._segments(
            output_text, out_data, out, salt)
        # The chain's first choice and the segment records under one taking of the writer lock.
        first = next(chain)
        refs = self._put_many([first.put, *(put for put, _ in segments)])
        failed = not refs
        refs = refs or [None] * (1 + len(segments))
        ref, link = refs[0], first
        # The chain's parent went meanwhile: the next way to store it (made now). Not after a
        # store failure (its lock busy past the timeout): every other way would wait as long.
        while ref is None and not failed:
            alt = next(chain, None)
            if alt is None:
                break
            got = self._put_many([alt.put])
            failed = not got
            ref, link = (got[0] if got else None), alt
        entries = 0
        if ref is not None:
            entries += len(link.put[3])
            link.stored(ref)
        entries += sum(len(keys) for (_, keys), got in zip(segments, refs[1:], strict=True) if got is not None)
        return RecordResult(recorded_tokens=len(out) if entries else 0, stop_token_dropped=verified.stop_token_dropped,
                            entries=entries, prompt=how, prompt_tokens=link.prompt_tokens if ref is not None else 0)

    # -- the prompt + output chain -------------------------------------------------------

    def _chain(self, served: Served[Ids, Out], salt: str, out: list[int], out_data: bytes) -> Iterator[_Link[Ids]]:
        """The ways to store ``out`` after a prompt a read served, best first, each made when
        asked for: with the prompt's entries the read left unstored, in one record continuing
        its hit; after the prompt's stored L0 entry; alone, with the prompt's ids inline (its
        parent is gone)."""
        write = served.write
        n = served.n
        more = self.fmt.from_list(out)
        if write is not None and write.keys.data is not None:
            data = write.keys.data
            ar_key = write.keys.output_key(out_data)
        else:
            data = utf8(served.text, "prompt_text")
            ar_key = output_key(data, out_data, salt=salt)
        if write is not None and write.decision.stored is None:
            tail = write.ids
            entries: list[tuple[bytes, int] | tuple[bytes, int, Kind]] = list(write.entries())
            entries.append((ar_key, tail.n + len(out), Kind.AR))
            packed = LISTS.to_u32(tail, tail.n) + pack_ids(out)
            yield _Link((write.parent, write.parent_tokens, packed, entries, Kind.L1, 0), self, served.full, n,
                        more, tail.n + len(out), write)
        yield from self._after(served.full, n, data, salt, out, more, ar_key)

    def _after(self, full: Ids, n: int, data: bytes, salt: str, out: list[int], more: Ids,
               ar_key: bytes) -> Iterator[_Link[Ids]]:
        """Storing ``out`` after a prompt whose ids are ``full[:n]``: chained to its L0 entry,
        else with the prompt's ids inline (each made when asked for)."""
        packed = pack_ids(out)
        l0 = l0_key(data, salt=salt, mode="kv-stable")
        yield _Link((l0, n, packed, [(ar_key, len(out), Kind.AR)], Kind.AR, 0), self, full, n, more, len(out))
        yield _Link((None, 0, self.fmt.to_u32(full, n) + packed, [(ar_key, n + len(out), Kind.AR)], Kind.AR, 0),
                    self, full, n, more, n + len(out))

    def _match_prompt(self, prompt_text: str, prompt_ids: Sequence[int] | bytes, salt: str, out: list[int],
                      out_data: bytes, add_special_tokens: bool) -> tuple[str, Iterator[_Link[Ids]]]:
        """The prompt was not served here (or not as given): match its ids against what the
        segment holds, what a lookup serves, or its canonical encoding; how, and the ways to
        store the output after it."""
        data = utf8(prompt_text, "prompt_text")
        packed = prompt_ids if isinstance(prompt_ids, bytes) else _pack_prompt(prompt_ids)
        if len(packed) % 4:
            raise InvalidRequest("prompt_token_ids", "length is not a multiple of 4 (little-endian uint32 ids)")
        affix_pre = pack_ids(self.model.affixes.prefix) if add_special_tokens else b""
        if packed[:len(affix_pre)] != affix_pre:
            raise InvalidRequest("prompt_token_ids", "does not start with the tokenizer's BOS tokens")
        raw = packed[len(affix_pre):]
        n = len(raw) // 4
        ar_key = output_key(data, out_data, salt=salt)
        more = self.fmt.from_list(out)
        # Usually stored already (an RPC reader stores its reads after the reply): equal ids then
        # need neither a scan of the prompt nor a lookup.
        stored = self.lookup.stored_exact(l0_key(data, salt=salt, mode="kv-stable"))
        if stored is not None and self.fmt.to_u32(stored, self.fmt.count(stored)) == raw:
            return "stored", self._after(stored, n, data, salt, out, more, ar_key)
        ids, write = self.serve(prompt_text, salt)
        if (ids if isinstance(ids, bytes) else pack_ids(ids)) == raw:
            if write is not None:
                served = Served(prompt_text, salt, "kv-stable", False, ids, write.full, n, write)
                return "looked_up", self._chain(served, salt, out, out_data)
            return "looked_up", self._after(self.fmt.from_u32(raw), n, data, salt, out, more, ar_key)
        raw_ids = unpack_ids(raw)
        if raw_ids and max(raw_ids) >= self.model.vocab_size:
            raise InvalidRequest("prompt_token_ids", f"id {max(raw_ids)} is outside the vocabulary "
                                                     f"(size {self.model.vocab_size})")
        if raw_ids != self.model.encoder.encode(prompt_text):
            raise InvalidRequest("prompt_token_ids", "not what tokcache serves for prompt_text, "
                                                     "nor its canonical tokenization")
        # Canonical ids that tokcache does not serve for this text (another process's AR
        # applies to it): the record stands alone, the prompt's ids inline.
        return "canonical", iter([_Link((None, 0, raw + pack_ids(out), [(ar_key, n + len(out), Kind.AR)], Kind.AR,
                                         0), self, None, n, more, n + len(out))])

    def _remember(self, ref: RecordRef, full: Ids, n: int, more: Ids, keys: dict[bytes, int]) -> None:
        """The record's chain in this process's memo: the turn that continues it reads nothing."""
        self.memo.put(ref, self.fmt.compact(self.fmt.grow(full, n, more)), keys)

    # -- segment entries -----------------------------------------------------------------

    def _segments(self, output_text: str, out_data: bytes, out: list[int],
                  salt: str) -> list[tuple[_Put, list[tuple[bytes, int, Kind, int]]]]:
        """The output's segment record: its ids once, a key per variant (its first token as the
        entry's start): (the put, its keys); none when no variant is long enough."""
        keys: list[tuple[bytes, int, Kind, int]] = []
        spans = self.model.scanner.find_spans(out_data)
        table = self.checks.token_bytes
        found = self._native_segment_keys(out, out_data, spans, salt)
        if found is not None:
            keys = [(key, end, Kind.AR, start) for key, start, end in found]
        else:
            for seg in segment_variants(output_text, out, table, spans, out_data):
                if len(seg.text) < MIN_SEGMENT_BYTES and seg.text != output_text:
                    continue  # a tiny fragment ("\n") would splice into unrelated text
                keys.append((segment_key(salt, MODE_KV_STABLE, seg.text.encode("utf-8")), seg.end, Kind.AR,
                             seg.start))
        if not keys:
            return []
        return [((None, 0, pack_ids(out), keys, Kind.AR, F_SEGMENT), keys)]

    def _native_segment_keys(self, out: list[int], out_data: bytes, spans: Any,
                             salt: str) -> list[tuple[bytes, int, int]] | None:
        """segment_variants and their keys in one C pass: (key, start, end) each, or None when
        the reference must run (no byte table or extension, ids whose bytes are not exactly
        ``out_data``: a lossy decode, or a piece's edge that needs Python's Unicode whitespace
        rules)."""
        table = self.checks.token_bytes
        packed = table.packed_offsets(out) if table is not None and out_data else None
        if packed is None or len(packed) // 4 != len(out) or int.from_bytes(packed[-4:], "little") != len(out_data):
            return None
        return _native.segment_keys(out_data, packed, spans, segment_root(salt, MODE_KV_STABLE),  # type: ignore[no-any-return]
                                    MIN_SEGMENT_BYTES)

    def _put_many(self, puts: list[_Put]) -> list[RecordRef | None]:
        """``Store.put_many``: a ref per put (None: its parent is gone); an empty list when
        the store failed (recording is best effort: a failing store costs the entries, never
        the caller's request; ``store_failed`` hears of a failure)."""
        try:
            return self.store.put_many(puts, lock_timeout=self.lock_timeout)
        except StoreError as exc:
            if self._store_failed is not None:
                self._store_failed(exc, "output not recorded")
            return []


class _Link(Generic[Ids]):
    """One way to store a recorded output's chain: the put, and what to remember once stored."""

    __slots__ = ("put", "_recorder", "_full", "_n", "_more", "_own", "_write", "prompt_tokens")

    def __init__(self, put: _Put, recorder: Recorder[Ids, Any], full: Ids | None, n: int, more: Ids, own: int,
                 write: PendingWrite[Ids] | None = None) -> None:
        self.put = put
        self._recorder: Recorder[Ids, Any] = recorder
        self._full: Ids | None = full  # the prompt's ids (None: not kept: nothing is remembered)
        self._n = n
        self._more: Ids = more
        self._own = own  # the record's own ids as put (before the store inlines a parent's)
        self._write: PendingWrite[Ids] | None = write  # the read whose entries this record stores
        self.prompt_tokens = n

    def stored(self, ref: RecordRef) -> None:
        """The record is in the segment: mark the read's entries stored, remember the chain."""
        if self._write is not None:
            self._write.decision.stored = True
        if self._full is not None:
            shift = ref.n - self._own  # > 0 when the store inlined the parent's ids
            self._recorder._remember(ref, self._full, self._n, self._more, {e[0]: e[1] + shift for e in self.put[3]})


def _pack_prompt(ids: Sequence[int]) -> bytes:
    """Prompt ids as packed LE uint32; InvalidRequest for an id that is not one."""
    try:
        return pack_ids(ids)
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidRequest("prompt_token_ids", f"expected ints in [0, 2**32): {exc}") from None
