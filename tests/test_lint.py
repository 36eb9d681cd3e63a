"""The code passes the project's own checks: ruff (style, imports) and mypy --strict (types)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.skipif(not (BIN / "ruff").exists(), reason="ruff is not installed in this environment")
def test_ruff() -> None:
    out = subprocess.run([str(BIN / "ruff"), "check", "sidecar", "client", "tests", "bench", "scripts", "e2e"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]


@pytest.mark.skipif(not (BIN / "mypy").exists() or shutil.which("bash") is None,
                    reason="mypy is not installed in this environment")
def test_mypy_strict() -> None:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "typecheck.sh")], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env={"MYPY": str(BIN / "mypy"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
