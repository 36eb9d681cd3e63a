"""matplotlib for the benchmarks' PNGs, when it is installed (a plot is optional: the JSON is the result)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["pyplot"]


def pyplot() -> Any:  # noqa: ANN401 - matplotlib.pyplot, or None
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or None (told on stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    return plt
