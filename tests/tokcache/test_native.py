"""The C extensions are part of the build: built here, loaded, and missed loudly.

A build that lost an extension must be a red test, not a run that quietly takes the Python
code (or skips the tests that compare the two): here both are built and loaded, a compile
error fails the build, and an extension that cannot be imported, or a stale one, fails the
import of every module that uses it with an error naming it. ``TOKCACHE_PURE_PYTHON=1`` is the
one way to run without them.
"""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokcache import native

ROOT = Path(__file__).resolve().parents[2]
EXTENSIONS = {"tokcache.store._speedups": native.STORE_API, "tokcache.engine._speedups": native.ENGINE_API}

# Makes importing one module fail as a missing or unloadable shared library does.
_BLOCK = """
import sys
from importlib.abc import MetaPathFinder

class Block(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Block())
import importlib
importlib.import_module(sys.argv[2])
print("imported")
"""


def _env(pure: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TOKCACHE_PURE_PYTHON"}
    if pure:
        env["TOKCACHE_PURE_PYTHON"] = "1"
    return env


@pytest.mark.parametrize("name", sorted(EXTENSIONS))
def test_both_extensions_are_built_and_loaded(name: str) -> None:
    """Each extension is a built shared library of the API this code calls, and the modules
    that use it hold it (or, under TOKCACHE_PURE_PYTHON=1, the loader hands out none)."""
    ext = importlib.import_module(name)  # built, whatever the run's mode
    assert Path(ext.__file__ or "").suffix == ".so" and ext.API == EXTENSIONS[name]
    from tokcache.engine import lookup
    from tokcache.store import _hash, _log

    if native.pure_python():
        assert native.load(name, EXTENSIONS[name]) is None
        assert (_hash.NATIVE, _log._native, lookup._native) == (False, None, None)
    else:
        assert native.load(name, EXTENSIONS[name]) is ext
        held = _log._native if name.startswith("tokcache.store") else lookup._native
        assert held is ext and _hash.NATIVE


@pytest.mark.parametrize(("name", "importer"), [
    ("tokcache.store._speedups", "tokcache.store"),
    ("tokcache.store._speedups", "tokcache.engine.lookup"),
    ("tokcache.engine._speedups", "tokcache.engine.lookup"),
    ("tokcache.engine._speedups", "sidecar_client._local"),
])
def test_a_missing_extension_fails_the_import_naming_it(name: str, importer: str) -> None:
    """Without the extension the package does not import: the error names the extension and
    says to reinstall. With TOKCACHE_PURE_PYTHON=1 the same import works (the reference)."""
    run = subprocess.run([sys.executable, "-c", _BLOCK, name, importer], capture_output=True, text=True,
                         env=_env(pure=False), cwd=ROOT, timeout=120)
    assert run.returncode != 0 and "imported" not in run.stdout
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("tokcache.native.ExtensionError: tokcache: the C extension "), run.stderr[-2000:]
    assert name in last and "reinstall tokcache" in last
    pure = subprocess.run([sys.executable, "-c", _BLOCK, name, importer], capture_output=True, text=True,
                          env=_env(pure=True), cwd=ROOT, timeout=120)
    assert pure.returncode == 0 and pure.stdout.strip() == "imported", pure.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(EXTENSIONS))
def test_a_stale_build_is_refused(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkout updated without rebuilding keeps an older extension (other functions or
    arguments): its API differs and loading it is an error saying so, not a fallback."""
    monkeypatch.delenv("TOKCACHE_PURE_PYTHON", raising=False)
    built = EXTENSIONS[name]
    with pytest.raises(native.ExtensionError, match=rf"{name} .* is a stale build \(API {built}, this code needs "
                                                    rf"{built + 1}\)"):
        native.load(name, built + 1)
    assert issubclass(native.ExtensionError, ImportError)


def _stub_names(path: Path) -> set[str]:
    """The public names a stub declares at its top level (functions, classes, constants)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("name", sorted(EXTENSIONS))
def test_the_stub_declares_what_the_extension_exports(name: str) -> None:
    """Each extension's ``.pyi`` (shipped for type checkers, and the place a reader finds the
    C functions' signatures) declares exactly the public names the built module has, so a
    function added to or dropped from the C side cannot leave the stub behind."""
    ext = importlib.import_module(name)
    stub = (ROOT / "client" / Path(*name.split("."))).with_suffix(".pyi")
    assert _stub_names(stub) == {n for n in dir(ext) if not n.startswith("_")}


def test_a_compile_error_fails_the_build(tmp_path: Path) -> None:
    """The extensions are not optional: a compiler that fails (here ``CC=false``) fails
    ``build_ext``, which fails ``pip install``, rather than installing the package without them."""
    src = tmp_path / "src"
    for rel in ("setup.py", "pyproject.toml", "README.md"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, src / rel)
    for pkg in ("client/tokcache/store", "client/tokcache/engine"):
        (src / pkg).mkdir(parents=True)
        for f in (ROOT / pkg).glob("*.[ch]"):
            shutil.copy(f, src / pkg / f.name)
    env = {**os.environ, "CC": "false"}
    run = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                          "--build-temp", str(tmp_path / "tmp")], capture_output=True, text=True, env=env, cwd=src,
                         timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert "building 'tokcache.store._speedups' extension" in out and "could not be compiled" not in out
