"""``tokcache-sidecar serve`` that cannot start: one line naming the flag or file, a non-zero exit.

Before, each of these printed a traceback (a missing model directory 72 lines, twice; a metrics
port in use 50 lines and "coroutine … was never awaited"), often after "listening on …" had
been logged; an invalid tokenizer.json named neither the file nor the model, and gRPC's
"Failed to bind" gave no reason. Each case runs the real CLI in a subprocess.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import tokcache


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tokcache.sidecar.cli", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _one_line(out: subprocess.CompletedProcess[str], code: int) -> str:
    """The one stderr line of a failed start (asserting that it is all there is)."""
    assert out.returncode == code, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("tokcache-sidecar: "), lines[0]
    for noise in ("Traceback", "listening on", "never awaited", "Failed to bind"):
        assert noise not in out.stderr + out.stdout, out.stderr
    return lines[0]


@pytest.fixture
def listen(tmp_path: Path) -> str:
    return f"unix://{tmp_path}/run/tokcache.sock"


@pytest.fixture
def base(listen: str, shm_prefix: str) -> list[str]:
    return ["--listen", listen, "--shm-prefix", shm_prefix, "--shm-size", "8MiB"]


@pytest.fixture
def held_port() -> Iterator[int]:
    """A TCP port on 127.0.0.1 that another process-like listener holds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


def test_model_directory_that_does_not_exist(base: list[str], tmp_path: Path) -> None:
    line = _one_line(_serve(*base, "--model", f"q={tmp_path}/nope"), 2)
    assert line == f"tokcache-sidecar: --model q={tmp_path}/nope: directory {tmp_path}/nope does not exist"


def test_model_directory_without_tokenizer_json(base: list[str], tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    line = _one_line(_serve(*base, "--model", f"q={tmp_path}/empty"), 2)
    assert line.startswith(f"tokcache-sidecar: --model q={tmp_path}/empty: {tmp_path}/empty/tokenizer.json not found")


def test_the_model_is_named_as_it_was_given(base: list[str], tmp_path: Path) -> None:
    line = _one_line(_serve(*base, env={"TOKCACHE_MODELS": f"m={tmp_path}/gone"}), 2)
    assert line.startswith(f"tokcache-sidecar: TOKCACHE_MODELS m={tmp_path}/gone: ")
    (tmp_path / "c.toml").write_text(f'[models]\nk = "{tmp_path}/gone"\n')
    line = _one_line(_serve(*base, "--config", str(tmp_path / "c.toml")), 2)
    assert line.startswith(f"tokcache-sidecar: models.k in {tmp_path}/c.toml: directory ")


def test_invalid_tokenizer_json(base: list[str], listen: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 7}}')
    line = _one_line(_serve(*base, "--model", f"q={bad}"), 1)
    assert line.startswith(f"tokcache-sidecar: --model q={bad}: {bad}/tokenizer.json is not a valid tokenizer: ")
    # The socket was bound (NOT_SERVING) while loading; the failed start removed it.
    assert not Path(listen[len("unix://"):]).exists()


def test_invalid_tokenizer_json_with_workers(shm_prefix: str, tmp_path: Path) -> None:
    """``--workers N``: the supervisor reads each tokenizer before starting any worker; a bad
    one is the same one line, not a traceback."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 7}}')
    line = _one_line(_serve("--listen", "127.0.0.1:0", "--workers", "2", "--shm-prefix", shm_prefix,
                            "--shm-size", "8MiB", "--model", f"q={bad}"), 1)
    assert line.startswith(f"tokcache-sidecar: --model q={bad}: {bad}/tokenizer.json is not a valid tokenizer: ")


def test_bad_model_flag_names_the_flag(base: list[str]) -> None:
    line = _one_line(_serve(*base, "--model", "justaname"), 2)
    assert line == "tokcache-sidecar: models (from --model): expected NAME=DIR, got 'justaname'"


def test_tcp_port_in_use(qwen3_path: Path, shm_prefix: str, held_port: int) -> None:
    listen = f"127.0.0.1:{held_port}"
    line = _one_line(_serve("--listen", listen, "--shm-prefix", shm_prefix, "--model", f"q={qwen3_path}"), 1)
    assert line.startswith(f"tokcache-sidecar: --listen {listen}: cannot bind 127.0.0.1:{held_port}: ")
    assert "Address already in use" in line


@pytest.mark.parametrize("where", ["parent is a file", "not a socket", "too long"])
def test_unusable_socket_path(where: str, qwen3_path: Path, shm_prefix: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    path, reason = {
        "parent is a file": (tmp_path / "file" / "tokcache.sock", "cannot create the directory"),
        "not a socket": (tmp_path / "file", "exists and is not a socket"),
        "too long": (tmp_path / ("d" * 120) / "tokcache.sock", "the kernel takes at most 107"),
    }[where]
    listen = f"unix://{path}"
    line = _one_line(_serve("--listen", listen, "--shm-prefix", shm_prefix, "--model", f"q={qwen3_path}"), 1)
    assert line.startswith(f"tokcache-sidecar: --listen {listen}: ") and reason in line, line


def test_metrics_port_in_use(base: list[str], listen: str, qwen3_path: Path, held_port: int) -> None:
    out = _serve(*base, "--model", f"q={qwen3_path}", "--metrics-port", str(held_port),
                 "--metrics-addr", "127.0.0.1")
    line = _one_line(out, 1)
    assert line == (f"tokcache-sidecar: --metrics-port {held_port}: cannot listen on 127.0.0.1:{held_port}: "
                    "Address already in use")
    assert not Path(listen[len("unix://"):]).exists()


def test_version() -> None:
    out = subprocess.run([sys.executable, "-m", "tokcache.sidecar.cli", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"tokcache-sidecar {tokcache.__version__}"
