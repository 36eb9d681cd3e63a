"""A client's copy of a tokenizer: where its ``tokenizer.json`` is.

The in-process read path and the vLLM plugin both find the ``tokenizer.json`` here: a
file or directory they were given, the directory a loaded tokenizer came from, or the
Hugging Face hub cache. Its fingerprint, which the sidecar's must equal, is
``tokcache.engine.tokenizer.fingerprint_of``: the one formula both sides run.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_FILE", "find_tokenizer_json"]

TOKENIZER_FILE = "tokenizer.json"


def _candidates(tokenizer: Any, names: Iterable[str | Path | None]) -> list[Path]:
    """Paths that may be a tokenizer.json or a directory holding one, in order."""
    paths: list[Path] = []
    for name in (*names, getattr(tokenizer, "name_or_path", None)):
        if isinstance(name, Path) or (isinstance(name, str) and name):
            paths.append(Path(name).expanduser())
    # transformers keeps the resolved paths of the files it loaded (vocab.json etc.)
    init_kwargs = getattr(tokenizer, "init_kwargs", None)
    if isinstance(init_kwargs, dict):
        for key in ("tokenizer_file", "vocab_file", "merges_file"):
            value = init_kwargs.get(key)
            if isinstance(value, str) and value:
                paths.append(Path(value).parent)
    return paths


def find_tokenizer_json(*names: str | Path | None, tokenizer: Any = None, revision: str | None = None) -> Path | None:
    """The first ``tokenizer.json`` found for ``names`` and ``tokenizer``, or None.

    ``names``, in order: a path to the file itself or to a directory holding it, or a
    hub id, looked up in the local hub cache only (no download; None and "" are
    skipped). ``tokenizer`` (a transformers tokenizer, e.g. vLLM's) adds the directory
    it was loaded from. Reads only the file system; never raises for a missing path.
    """
    for p in _candidates(tokenizer, names):
        f = p / TOKENIZER_FILE if p.is_dir() else p
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
