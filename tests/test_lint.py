"""The code passes the project's own checks: ruff (style, imports) and mypy --strict (types)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_ruff() -> None:
    out = subprocess.run([str(BIN / "ruff"), "check", "sidecar", "client", "tests", "bench", "scripts", "e2e"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]


def test_mypy_strict() -> None:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "typecheck.sh")], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env={"MYPY": str(BIN / "mypy"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
