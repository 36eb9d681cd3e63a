"""A tokenizer's fingerprint, and finding a client's tokenizer.json."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from sidecar_client._fingerprint import find_tokenizer_json
from tokcache.engine.tokenizer import fingerprint_of


@pytest.mark.parametrize("which", ["qwen3", "llama32"])
def test_fingerprint_is_the_files_sha256_prefix(which: str, request: pytest.FixtureRequest) -> None:
    """The handshake compares this value with one an older peer may have computed: its formula is fixed."""
    path = Path(request.getfixturevalue(f"{which}_path")) / "tokenizer.json"
    assert fingerprint_of(path) == hashlib.sha256(path.read_bytes()).hexdigest()[:32]


def test_different_tokenizers_differ(qwen3_path: Path, llama32_path: Path) -> None:
    assert fingerprint_of(qwen3_path / "tokenizer.json") != fingerprint_of(llama32_path / "tokenizer.json")


def test_find_in_the_model_directory(tmp_path: Path, qwen3_path: Path) -> None:
    shutil.copy(qwen3_path / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = SimpleNamespace(name_or_path="not-a-dir", init_kwargs={})
    assert find_tokenizer_json(str(tmp_path), tokenizer=tok) == tmp_path / "tokenizer.json"
    assert find_tokenizer_json(tokenizer=SimpleNamespace(name_or_path=str(tmp_path))) == tmp_path / "tokenizer.json"


def test_find_next_to_the_files_transformers_loaded(tmp_path: Path, qwen3_path: Path) -> None:
    shutil.copy(qwen3_path / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = SimpleNamespace(name_or_path="some/repo-id", init_kwargs={"vocab_file": str(tmp_path / "vocab.json")})
    assert find_tokenizer_json(tokenizer=tok) == tmp_path / "tokenizer.json"


def test_nothing_to_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    tok = SimpleNamespace(name_or_path=str(tmp_path), init_kwargs={})  # a dir without tokenizer.json
    assert find_tokenizer_json(str(tmp_path), tokenizer=tok) is None
    assert find_tokenizer_json("org/never-downloaded-model", tokenizer=object()) is None  # hub id, not cached
    assert find_tokenizer_json(None, "") is None


def test_find_a_file_or_a_directory_given(tmp_path: Path, qwen3_path: Path) -> None:
    """What a client is given (``tokenizers={model: path}``): the file itself, under any name,
    or its directory; the first that exists wins."""
    own = tmp_path / "qwen3-tokenizer.json"
    shutil.copy(qwen3_path / "tokenizer.json", own)
    assert find_tokenizer_json(own) == own
    assert find_tokenizer_json(tmp_path / "missing", qwen3_path) == qwen3_path / "tokenizer.json"
    assert find_tokenizer_json(None, str(qwen3_path)) == qwen3_path / "tokenizer.json"
