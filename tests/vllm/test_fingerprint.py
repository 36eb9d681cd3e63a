"""The plugin's fingerprint of vLLM's tokenizer equals the server's, and finding tokenizer.json."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from sidecar_client.vllm._fingerprint import find_tokenizer_json, fingerprint_file
from tokcache.sidecar.engine.model import fingerprint_of


@pytest.mark.parametrize("which", ["qwen3", "llama32"])
def test_fingerprint_equals_the_servers(which: str, request: pytest.FixtureRequest) -> None:
    path = Path(request.getfixturevalue(f"{which}_path")) / "tokenizer.json"
    assert fingerprint_file(path) == fingerprint_of(path)
    assert len(fingerprint_file(path)) == 32


def test_different_tokenizers_differ(qwen3_path: Path, llama32_path: Path) -> None:
    assert fingerprint_file(qwen3_path / "tokenizer.json") != fingerprint_file(llama32_path / "tokenizer.json")


def test_find_in_the_model_directory(tmp_path: Path, qwen3_path: Path) -> None:
    shutil.copy(qwen3_path / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = SimpleNamespace(name_or_path="not-a-dir", init_kwargs={})
    assert find_tokenizer_json(tok, str(tmp_path)) == tmp_path / "tokenizer.json"
    assert find_tokenizer_json(SimpleNamespace(name_or_path=str(tmp_path))) == tmp_path / "tokenizer.json"


def test_find_next_to_the_files_transformers_loaded(tmp_path: Path, qwen3_path: Path) -> None:
    shutil.copy(qwen3_path / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = SimpleNamespace(name_or_path="some/repo-id", init_kwargs={"vocab_file": str(tmp_path / "vocab.json")})
    assert find_tokenizer_json(tok) == tmp_path / "tokenizer.json"


def test_nothing_to_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    tok = SimpleNamespace(name_or_path=str(tmp_path), init_kwargs={})  # a dir without tokenizer.json
    assert find_tokenizer_json(tok, str(tmp_path)) is None
    assert find_tokenizer_json(object(), "org/never-downloaded-model") is None  # hub id, not in the cache
