"""Shared fixtures: real tokenizer directories and isolated shm prefixes."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokcache.sidecar.bundled import llama32_dir, qwen3_dir

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def qwen3_path() -> Path:
    """Qwen3 tokenizer dir as shipped (tokenizer.json + config with template)."""
    return qwen3_dir()


@pytest.fixture(scope="session")
def llama32_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 3.2 tokenizer dir plus our Llama-3-format chat template fixture."""
    out = tmp_path_factory.mktemp("llama32")
    src = llama32_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    shutil.copy(FIXTURES / "llama32_chat_template.jinja", out / "chat_template.jinja")
    return out


@pytest.fixture(params=["qwen3", "llama32"])
def tokenizer_path(request: pytest.FixtureRequest) -> Path:
    """Each test tokenizer in turn."""
    return Path(request.getfixturevalue(f"{request.param}_path"))


def _unlink_prefix(prefix: str) -> None:
    for entry in Path("/dev/shm").glob(f"{prefix}*"):
        entry.unlink(missing_ok=True)
    for entry in Path("/dev/shm").glob(f"sem.{prefix}*"):
        entry.unlink(missing_ok=True)


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    """A unique shared-memory name prefix; every segment under it is unlinked after."""
    prefix = f"tkt{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield prefix
    _unlink_prefix(prefix)
