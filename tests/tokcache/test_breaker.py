"""The circuit breaker's state machine, on a fake clock."""

from __future__ import annotations

import pytest

from tokcache.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(failures: int = 3, reset_s: float = 5.0) -> tuple[CircuitBreaker, Clock, list[tuple[str, str]]]:
    clock = Clock()
    changes: list[tuple[str, str]] = []
    breaker = CircuitBreaker(failures, reset_s, clock=clock, on_change=lambda a, b: changes.append((a, b)))
    return breaker, clock, changes


def test_closed_allows_and_opens_after_consecutive_failures() -> None:
    b, _, changes = make(failures=3)
    assert b.state == "closed" and b.allow()
    b.failure()
    b.failure()
    assert b.state == "closed" and b.allow()
    b.failure()
    assert b.state == "open" and not b.allow()
    assert changes == [("closed", "open")] and b.opens == 1


def test_a_success_resets_the_failure_count() -> None:
    b, _, _ = make(failures=3)
    b.failure()
    b.failure()
    b.success()
    b.failure()
    b.failure()
    assert b.state == "closed"


def test_open_becomes_half_open_after_reset_and_lets_one_probe_through() -> None:
    b, clock, _ = make(failures=1, reset_s=5)
    b.failure()
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.1
    assert b.state == "half_open"
    assert b.allow()  # the probe
    assert not b.allow()  # everyone else waits for its outcome
    assert not b.allow()


def test_successful_probe_closes() -> None:
    b, clock, changes = make(failures=1, reset_s=1)
    b.failure()
    clock.now += 1
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.allow()
    assert changes == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]


def test_failed_probe_reopens_and_restarts_the_timer() -> None:
    b, clock, _ = make(failures=2, reset_s=1)
    b.failure()
    b.failure()
    clock.now += 1
    assert b.allow()
    b.failure()  # one failure is enough in half-open
    assert b.state == "open" and b.opens == 2
    clock.now += 0.5
    assert not b.allow()
    clock.now += 0.5
    assert b.allow()


def test_a_probe_whose_outcome_never_comes_is_replaced_after_reset() -> None:
    b, clock, _ = make(failures=1, reset_s=2)
    b.failure()
    clock.now += 2
    assert b.allow()  # probe, then its caller is cancelled: no success/failure reported
    clock.now += 1
    assert not b.allow()
    clock.now += 1
    assert b.allow()


def test_invalid_parameters() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(0, 1)
    with pytest.raises(ValueError):
        CircuitBreaker(1, 0)
