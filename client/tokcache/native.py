"""Loading the optional C extensions (``tokcache.store._speedups``, ``tokcache.engine._speedups``).

Each accelerates Python code that stays the reference (the tests compare both). An extension is
used only when it was built, TOKCACHE_PURE_PYTHON is not set, and its ``API`` is the version this
code calls: a checkout updated without rebuilding keeps an older build, whose functions differ.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any

__all__ = ["ENGINE_API", "STORE_API", "engine", "load", "store"]

# The version of tokcache.engine._speedups' functions this code calls (its ``API``).
ENGINE_API = 15
# The same for tokcache.store._speedups.
STORE_API = 6


def load(module: str, api: int) -> Any:  # noqa: ANN401 - the extension module, or None
    """The extension ``module`` if it can serve (see above), else None (warning on a stale build)."""
    if os.environ.get("TOKCACHE_PURE_PYTHON", "") in ("1", "true", "yes"):
        return None
    try:
        ext = importlib.import_module(module)
    except ImportError:  # not compiled here: the Python code serves
        return None
    built = getattr(ext, "API", 0)
    if built != api:
        warnings.warn(f"tokcache: {ext.__file__} is a stale build (API {built}, this code needs {api}); "
                      "using the pure-Python code. Rebuild: pip install -e .", RuntimeWarning, stacklevel=2)
        return None
    return ext


def engine() -> Any:  # noqa: ANN401 - the extension module, or None
    """``tokcache.engine._speedups`` if it can serve (see :func:`load`), else None."""
    return load("tokcache.engine._speedups", ENGINE_API)


def store() -> Any:  # noqa: ANN401 - the extension module, or None
    """``tokcache.store._speedups`` if it can serve (see :func:`load`), else None."""
    return load("tokcache.store._speedups", STORE_API)
