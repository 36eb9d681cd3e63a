"""Loading the C extensions (``tokcache.store._speedups``, ``tokcache.engine._speedups``).

Both are part of the install (``setup.py``): a module that uses one loads it here, and a
missing or stale build is an error at import, naming the extension, never a silent switch to
slower code. ``TOKCACHE_PURE_PYTHON=1`` is the one way to run without them: then the Python
code they accelerate, which stays the reference the tests compare them with, serves.

An extension's ``API`` must be the version this code calls: a checkout updated without
rebuilding keeps an older build, whose functions differ.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__all__ = ["ENGINE_API", "STORE_API", "ExtensionError", "engine", "load", "pure_python", "store"]

# The version of tokcache.engine._speedups' functions this code calls (its ``API``).
ENGINE_API = 18
# The same for tokcache.store._speedups.
STORE_API = 6

_REINSTALL = "reinstall tokcache (in a checkout: pip install -e .)"


class ExtensionError(ImportError):
    """A C extension cannot be imported, or is a build of other sources: the install is broken."""


def pure_python() -> bool:
    """Whether ``TOKCACHE_PURE_PYTHON`` asks for the pure-Python reference (read at each call)."""
    return os.environ.get("TOKCACHE_PURE_PYTHON", "") in ("1", "true", "yes")


def load(module: str, api: int) -> Any:  # noqa: ANN401 - the extension module, or None
    """The extension ``module`` at version ``api``; None only when :func:`pure_python`.

    Raises :class:`ExtensionError` (an ImportError) when it cannot be imported (not built,
    or its shared library cannot load) or its ``API`` is not ``api`` (a stale build).
    """
    if pure_python():
        return None
    try:
        ext = importlib.import_module(module)
    except ImportError as exc:
        raise ExtensionError(f"tokcache: the C extension {module} cannot be imported ({exc}); it is part of "
                             f"the install: {_REINSTALL}") from exc
    built = getattr(ext, "API", 0)
    if built != api:
        raise ExtensionError(f"tokcache: the C extension {module} ({ext.__file__}) is a stale build (API {built}, "
                             f"this code needs {api}): {_REINSTALL}")
    return ext


def engine() -> Any:  # noqa: ANN401 - the extension module, or None
    """``tokcache.engine._speedups`` (see :func:`load`)."""
    return load("tokcache.engine._speedups", ENGINE_API)


def store() -> Any:  # noqa: ANN401 - the extension module, or None
    """``tokcache.store._speedups`` (see :func:`load`)."""
    return load("tokcache.store._speedups", STORE_API)
