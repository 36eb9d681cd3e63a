"""Circuit breaker: stop calling a dependency that keeps failing, probe until it is back.

Used by the vLLM plugin (calls to the sidecar) and by the sidecar (calls to its cluster tier).

::

    closed --(failures consecutive failures)--> open --(reset_s elapsed)--> half_open
      ^                                                                        |
      +------------------------- probe succeeds -------------------------------+
                                 probe fails  --> open (timer restarts)

In ``half_open`` exactly one call (the probe) is let through; if its outcome
is never reported (the caller was cancelled), another probe is allowed after
``reset_s``. Not thread-safe: each user drives it from one event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

__all__ = ["BreakerState", "CircuitBreaker"]

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Counts consecutive failures; ``allow()`` says whether to call at all.

    ``on_change(old, new)`` is called on every state change (for logging);
    ``clock`` is injectable for tests.
    """

    def __init__(self, failures: int, reset_s: float, *, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[BreakerState, BreakerState], None] | None = None) -> None:
        if failures < 1:
            raise ValueError("failures must be >= 1")
        if reset_s <= 0:
            raise ValueError("reset_s must be > 0")
        self.failures = failures
        self.reset_s = reset_s
        self._clock = clock
        self._on_change = on_change
        self._state: BreakerState = "closed"
        self._consecutive = 0
        self._opened_at = 0.0
        self._probe_at: float | None = None  # when the in-flight half-open probe was let through
        self.opens = 0  # times the breaker went to open (a counter for metrics)

    @property
    def state(self) -> BreakerState:
        """The current state, moving open -> half_open if ``reset_s`` has passed."""
        if self._state == "open" and self._clock() - self._opened_at >= self.reset_s:
            self._set("half_open")
            self._probe_at = None
        return self._state

    def allow(self) -> bool:
        """True if a call may go out now; in half_open, True once (that call is the probe)."""
        state = self.state
        if state == "closed":
            return True
        if state == "open":
            return False
        now = self._clock()
        if self._probe_at is None or now - self._probe_at >= self.reset_s:
            self._probe_at = now
            return True
        return False

    def success(self) -> None:
        """A call succeeded: close (from any state) and forget past failures."""
        self._consecutive = 0
        self._probe_at = None
        if self._state != "closed":
            self._set("closed")

    def failure(self) -> None:
        """A call failed: count it; open at the threshold, or re-open after a failed probe."""
        self._consecutive += 1
        if self._state == "half_open" or (self._state == "closed" and self._consecutive >= self.failures):
            self._open()

    def _open(self) -> None:
        self._opened_at = self._clock()
        self._probe_at = None
        self.opens += 1
        self._set("open")

    def _set(self, new: BreakerState) -> None:
        old, self._state = self._state, new
        if old != new and self._on_change is not None:
            self._on_change(old, new)
