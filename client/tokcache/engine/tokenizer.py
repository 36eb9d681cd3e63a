"""A tokenizer as the read side uses it, built by proving it (sidecar) or from what was proved (client).

The sidecar loads ``tokenizer.json``, runs the exactness gate on every allowed encoder
backend, self-checks every added token as a boundary and learns the post-processor's
affixes (:func:`prove`); then it publishes the verdicts in the segment's manifest
(:class:`Manifest`). A process that maps the segment builds the same
:class:`~tokcache.engine.lookup.ReadModel` from its own copy of the file and the
manifest (:func:`from_manifest`) without re-running the checks — only an encoder the
sidecar did not prove (another fastokens version here) is gated again, locally.

The manifest is checked before it is trusted: same tokenizer fingerprint (SHA-256 of
``tokenizer.json``), a format this code knows. Anything else raises
:class:`ManifestMismatch` with the reason, and the caller uses the RPC path.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from tokcache.engine.affixes import Affixes, detect_affixes
from tokcache.engine.boundaries import BoundaryCheck, BoundaryScanner, added_tokens, check_boundaries
from tokcache.engine.encoder import Encoder, EncoderChoice, choose_encoder, load_encoder
from tokcache.engine.lookup import Limits, ReadModel
from tokcache.store.keys import KEY_GRID

log = logging.getLogger(__name__)

__all__ = ["MANIFEST_FORMAT", "Manifest", "ManifestMismatch", "Proven", "fingerprint_of", "from_manifest", "prove"]

MANIFEST_FORMAT = 1


class ManifestMismatch(Exception):
    """The published manifest cannot be used by this process (the message says why)."""


def fingerprint_of(tokenizer_json: Path) -> str:
    """Tokenizer identity: SHA-256 of tokenizer.json, its first 32 hex chars.

    Ids depend on tokenizer.json alone (templates only change the text), so that is
    what the cache segment, the manifest and the vLLM handshake are bound to.
    """
    return hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()[:32]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


@dataclass(frozen=True)
class Proven:
    """What :func:`prove` established, beside the ReadModel."""

    model: ReadModel
    choice: EncoderChoice
    boundaries: BoundaryCheck


def prove(tokenizer_json: Path, *, backends: tuple[str, ...] = ("fastokens", "tokenizers"),
          key_grid: int = KEY_GRID) -> Proven:
    """Load and check a tokenizer (the sidecar's job; seconds for big vocabularies).

    ``key_grid``: which cuts carry an L1 key (see ``tokcache.store.keys.KEY_GRID``), published
    in the manifest for readers."""
    fingerprint = fingerprint_of(tokenizer_json)
    choice = choose_encoder(tokenizer_json, allow=backends)
    check = check_boundaries(tokenizer_json, choice.reference)
    scanner = BoundaryScanner.from_tokenizer(tokenizer_json, check)
    affixes = detect_affixes(choice.reference)
    vocab = int(choice.reference.tokenizer.get_vocab_size(with_added_tokens=True))
    id_of = _boundary_map(tokenizer_json, check.boundary_tokens)
    model = ReadModel(fingerprint, choice.encoder, scanner, affixes, check.disabled_reason, vocab,
                      frozenset(id_of.values()), id_of, key_grid)
    return Proven(model, choice, check)


@dataclass(frozen=True)
class Manifest:
    """The facts a reader needs, as published in the segment (JSON)."""

    fingerprint: str
    vocab_size: int
    backend: str
    backend_version: str
    reference_version: str
    boundary_ids: list[list[int]]  # [first, last] id ranges of the boundary tokens
    l1_disabled_reason: str
    affix_prefix: list[int]
    affix_suffix: list[int]
    affix_separable: bool
    affix_reason: str
    max_text_bytes: int
    models: list[str] = field(default_factory=list)
    model_dirs: list[str] = field(default_factory=list)
    # Entry lifetimes in seconds by kind ("l0", "l1", "ar"; 0: none): a process that writes
    # into the segment gives its entries the same TTLs as the sidecar.
    ttl: dict[str, float] = field(default_factory=dict)
    # The sidecar has a cluster tier for recorded outputs: a reader sends a kv-stable request
    # that no local AR applies to over RPC (the sidecar asks the tier; readers cannot).
    ar_tier: bool = False
    # Which cuts carry an L1 key (tokcache.store.keys.KEY_GRID): a reader keys and probes the
    # same ones the writers did. 0 (an older sidecar's manifest, which has none): every cut.
    key_grid: int = 0
    tokcache: str = ""
    format: int = MANIFEST_FORMAT

    @classmethod
    def of(cls, proven: Proven, tokenizer_json: Path, *, limits: Limits, models: list[str],
           model_dirs: list[str], ttl: dict[str, float] | None = None, ar_tier: bool = False) -> Manifest:
        """The manifest a sidecar publishes for ``proven``."""
        ids = sorted(_boundary_ids(tokenizer_json, proven.boundaries.boundary_tokens))
        ranges: list[list[int]] = []
        for i in ids:
            if ranges and ranges[-1][1] + 1 == i:
                ranges[-1][1] = i
            else:
                ranges.append([i, i])
        m = proven.model
        backend = m.encoder.name
        return cls(
            fingerprint=m.fingerprint, vocab_size=m.vocab_size, backend=backend,
            backend_version=_version(backend), reference_version=_version("tokenizers"),
            boundary_ids=ranges, l1_disabled_reason=m.l1_disabled_reason,
            affix_prefix=list(m.affixes.prefix), affix_suffix=list(m.affixes.suffix),
            affix_separable=m.affixes.separable, affix_reason=m.affixes.reason,
            max_text_bytes=limits.max_text_bytes, models=models, model_dirs=model_dirs,
            tokcache=_version("tokcache"), ttl=dict(ttl or {}), ar_tier=ar_tier, key_grid=m.key_grid)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode("utf-8")

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        """Parse a published manifest; ManifestMismatch for another format or bad JSON."""
        try:
            data: Any = json.loads(raw)
        except ValueError as exc:
            raise ManifestMismatch(f"manifest is not JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ManifestMismatch(f"manifest format {data.get('format') if isinstance(data, dict) else '?'}, "
                                   f"this code reads {MANIFEST_FORMAT}")
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except TypeError as exc:
            raise ManifestMismatch(f"manifest fields: {exc}") from exc


def _boundary_ids(tokenizer_json: Path, contents: tuple[str, ...]) -> list[int]:
    return list(_boundary_map(tokenizer_json, contents).values())


def _boundary_map(tokenizer_json: Path, contents: tuple[str, ...]) -> dict[bytes, int]:
    """The id of each boundary token, by its UTF-8 text."""
    wanted = set(contents)
    out: dict[bytes, int] = {}
    for t in added_tokens(tokenizer_json):
        tid = t.get("id")
        content = t.get("content")
        if content in wanted and isinstance(tid, int):
            out[str(content).encode("utf-8")] = tid
    return out


def from_manifest(tokenizer_json: Path, manifest: Manifest, *, encoder: Encoder | None = None) -> ReadModel:
    """The ReadModel of ``tokenizer_json`` as the sidecar proved it (no self-checks).

    Uses the manifest's backend when this process has the same version of it; else gates
    its own candidates against its own reference (``tokenizers``) exactly as the sidecar
    does. Raises ManifestMismatch when the file is another tokenizer, FileNotFoundError
    when it is missing.
    """
    fingerprint = fingerprint_of(tokenizer_json)
    if fingerprint != manifest.fingerprint:
        raise ManifestMismatch(f"tokenizer {tokenizer_json} has fingerprint {fingerprint}, "
                               f"the segment holds {manifest.fingerprint}")
    if encoder is None:
        if manifest.backend in ("fastokens", "tokenizers") and _version(manifest.backend) == manifest.backend_version:
            encoder = load_encoder(manifest.backend, tokenizer_json)
        else:
            # Not the build the sidecar proved: prove this one here (same gate, same probes).
            choice = choose_encoder(tokenizer_json)
            log.info("tokcache: the sidecar proved %s %s; this process has %r and chose %s after its own gate",
                     manifest.backend, manifest.backend_version, _version(manifest.backend), choice.encoder.name)
            encoder = choice.encoder
    by_id: dict[int, str] = {}
    for t in added_tokens(tokenizer_json):
        tid = t.get("id")
        if isinstance(tid, int):
            by_id[tid] = str(t["content"])
    boundary = tuple(by_id[i] for lo, hi in manifest.boundary_ids for i in range(lo, hi + 1) if i in by_id)
    check = BoundaryCheck(boundary, (), manifest.l1_disabled_reason)
    scanner = BoundaryScanner.from_tokenizer(tokenizer_json, check)
    affixes = Affixes(tuple(manifest.affix_prefix), tuple(manifest.affix_suffix), manifest.affix_separable,
                      manifest.affix_reason)
    id_of = {by_id[i].encode("utf-8"): i for lo, hi in manifest.boundary_ids for i in range(lo, hi + 1) if i in by_id}
    return ReadModel(fingerprint, encoder, scanner, affixes, manifest.l1_disabled_reason, manifest.vocab_size,
                     frozenset(id_of.values()), id_of, manifest.key_grid)
