"""The tokenizer fingerprint of vLLM's own tokenizer, computed as the sidecar does.

The sidecar identifies a tokenizer by ``sha256(tokenizer.json bytes).hexdigest()[:32]``
(``tokcache.sidecar.engine.model.fingerprint_of``); this module repeats that formula
without importing the server package, and finds the ``tokenizer.json`` vLLM
loaded: a local model directory, or the Hugging Face hub cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_FILE", "fingerprint_file", "find_tokenizer_json"]

TOKENIZER_FILE = "tokenizer.json"


def fingerprint_file(path: Path) -> str:
    """``sha256(bytes).hexdigest()[:32]``: 32 hex chars, equal to the server's ``fingerprint_of``."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:32]


def _candidate_dirs(tokenizer: Any, names: Iterable[str | None]) -> list[Path]:
    dirs: list[Path] = []
    for name in (*names, getattr(tokenizer, "name_or_path", None)):
        if isinstance(name, str) and name:
            dirs.append(Path(name).expanduser())
    # transformers keeps the resolved paths of the files it loaded (vocab.json etc.)
    init_kwargs = getattr(tokenizer, "init_kwargs", None)
    if isinstance(init_kwargs, dict):
        for key in ("tokenizer_file", "vocab_file", "merges_file"):
            value = init_kwargs.get(key)
            if isinstance(value, str) and value:
                dirs.append(Path(value).parent)
    return dirs


def find_tokenizer_json(tokenizer: Any, *names: str | None, revision: str | None = None) -> Path | None:
    """The ``tokenizer.json`` behind ``tokenizer`` (vLLM's HF tokenizer), or None.

    ``names`` are what vLLM was given (``model_config.tokenizer``, the model
    path); a hub id is looked up in the local hub cache only (no download).
    """
    for d in _candidate_dirs(tokenizer, names):
        f = d / TOKENIZER_FILE
        if f.is_file():
            return f
    for name in (*names, getattr(tokenizer, "name_or_path", None)):
        if not isinstance(name, str) or not name or Path(name).expanduser().exists():
            continue
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        try:
            hit = try_to_load_from_cache(name, TOKENIZER_FILE, revision=revision)
        except Exception:  # a malformed repo id: not a hub model
            continue
        if isinstance(hit, str) and Path(hit).is_file():
            return Path(hit)
    return None
