"""Packaging: installable beside PyPI's ``sidecar``; a client install has none of the server's dependencies.

Builds the real wheel (``pip wheel`` with build isolation, so the build prints what a user's
would), installs it with ``--no-deps`` into fresh virtual environments and checks file
ownership, imports and the console script. Needs PyPI (the build backend, ``sidecar==0.8.1``):
skipped with the reason when it cannot be reached.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SERVER_ONLY = {"grpcio-health-checking", "grpcio-reflection", "jinja2", "opentelemetry-sdk", "prometheus-client"}
SERVER_MODULES = {"grpc_health", "grpc_reflection", "jinja2", "opentelemetry.sdk", "prometheus_client"}


def _name(req: str) -> str:
    return req.split(";")[0].split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, str]]:
    out = tmp_path_factory.mktemp("wheels")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    if build.returncode != 0 and ("Could not find a version" in build.stderr or "connection" in build.stderr.lower()):
        pytest.skip(f"no package index to build with: {build.stderr.strip().splitlines()[-1]}")
    assert build.returncode == 0, build.stderr[-3000:]
    ours = next(out.glob("tokcache-*.whl"))
    dl = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(out), "sidecar==0.8.1"],
                        capture_output=True, text=True, timeout=300)
    if dl.returncode != 0:
        pytest.skip(f"PyPI's sidecar==0.8.1 cannot be downloaded here: {dl.stderr.strip().splitlines()[-1:]}")
    theirs = next(p for p in out.iterdir() if p.name.lower().startswith("sidecar-0.8.1"))
    yield ours, theirs, build.stdout + build.stderr


def _venv(path: Path) -> Path:
    venv.create(path, with_pip=True)
    return path / "bin" / "python"


def _run(py: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(py), *args], capture_output=True, text=True, timeout=300, cwd="/")


def test_base_dependencies_are_the_clients(tmp_path: Path) -> None:
    """The vLLM image gets the client's dependencies only; the server's are the `server` extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_name(r) for r in project["dependencies"]}
    assert not base & SERVER_ONLY, base & SERVER_ONLY
    assert SERVER_ONLY <= {_name(r) for r in project["optional-dependencies"]["server"]}
    docs = (ROOT / "docs" / "vllm.md").read_text()
    for dep in base - {"tomli"}:
        assert f"`{dep}`" in docs, f"docs/vllm.md does not list the client dependency {dep}"
    # What a client and the plugin import, in a fresh interpreter: nothing of the server's
    # (beyond what `import grpc` itself pulls in when it finds grpc_health/grpc_reflection).
    code = ("import sys, grpc\n"
            f"server = lambda: {{m for m in sys.modules if any(m == s or m.startswith(s + '.') for s in "
            f"{sorted(SERVER_MODULES)!r})}}\n"
            "before = server()\n"
            "import sidecar_client, sidecar_client.vllm._link, sidecar_client._local, tokcache.engine.lookup, "
            "tokcache.engine.tokenizer, tokcache.store\n"
            "print(sorted(server() - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_build_prints_no_license_deprecation(wheels: tuple[Path, Path, str]) -> None:
    log = wheels[2]
    assert "SetuptoolsDeprecationWarning" not in log and "License classifiers" not in log, log[-2000:]


def test_installs_beside_pypi_sidecar_and_uninstalls_cleanly(wheels: tuple[Path, Path, str], tmp_path: Path) -> None:
    ours, theirs, _ = wheels
    py = _venv(tmp_path / "v")
    assert _run(py, "-m", "pip", "install", "-q", "--no-deps", str(ours), str(theirs)).returncode == 0
    site = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    records = {}
    for dist in site.glob("*.dist-info"):
        records[dist.name.split("-")[0].lower()] = {
            line.split(",")[0] for line in (dist / "RECORD").read_text().splitlines() if line}
    assert not (records["tokcache"] & records["sidecar"])  # no file is claimed by both
    top = {p.split("/")[0] for p in records["tokcache"] if not p.startswith(("tokcache-", "../"))}
    assert top == {"tokcache", "sidecar_client"}, top  # only names of ours at the top level
    check = ("import importlib.util as u; print(u.find_spec('tokcache.sidecar.cli').origin); "
             "print(u.find_spec('sidecar').origin)")
    before = _run(py, "-c", check).stdout.split()
    assert "tokcache/sidecar/cli.py" in before[0] and before[1].endswith("sidecar/__init__.py")
    # Removing theirs leaves ours whole, and the other way round.
    assert _run(py, "-m", "pip", "uninstall", "-y", "-q", "sidecar").returncode == 0
    cli = tmp_path / "v" / "bin" / "tokcache-sidecar"
    version = subprocess.run([str(cli), "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("tokcache-sidecar "), version.stderr
    assert _run(py, "-m", "pip", "install", "-q", "--no-deps", str(theirs)).returncode == 0
    assert _run(py, "-m", "pip", "uninstall", "-y", "-q", "tokcache").returncode == 0
    assert _run(py, "-c", "import importlib.util as u; assert u.find_spec('sidecar')").returncode == 0


def test_sidecar_without_the_server_extra_says_what_to_install(wheels: tuple[Path, Path, str],
                                                              tmp_path: Path) -> None:
    py = _venv(tmp_path / "client")
    assert _run(py, "-m", "pip", "install", "-q", "--no-deps", str(wheels[0])).returncode == 0
    out = subprocess.run([str(tmp_path / "client" / "bin" / "tokcache-sidecar"), "serve", "--model", "x=/nowhere"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "pip install 'tokcache[server]'" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
