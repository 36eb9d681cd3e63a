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

# Tests marked ``once`` run on the default Python only (``make unit``); the other supported
# Pythons (``make unit-pythons``) run the rest (``-m "not once"``). These are the ones that
# start processes and drive them under load, time or kills — real sidecars, crash cycles, fuzz
# campaigns, benchmark smoke runs, packaging, lint — where the Python version changes nothing
# the library-level tests do not already cover, and which take three quarters of the suite's
# time (the whole suite once per Python did not fit CI's 90 minutes). The RPC API's own tests
# (test_server, test_ar_grpc) and every library-level test run on each Python.
_ONCE = ("integration/", "bench/", "stress/", "fuzz/", "deploy/", "test_packaging.py", "test_lint.py",
         "telemetry/test_shutdown.py")
_EVERY_PYTHON = ("integration/test_server.py", "integration/test_ar_grpc.py")
_TESTS = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "once: runs on the default Python only (see tests/conftest.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = item.path.relative_to(_TESTS).as_posix()
        if rel.startswith(_ONCE) and not rel.startswith(_EVERY_PYTHON):
            item.add_marker(pytest.mark.once)


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
