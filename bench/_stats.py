"""Summary statistics of latency samples, computed the same way by every benchmark."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` (``q`` in [0, 100]), linearly interpolated between
    the two nearest ranks (numpy's default method); None when there are no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
