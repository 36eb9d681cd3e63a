"""The sync stream's alarm thread survives a deadline years away (a huge timeout is valid
input: a lock wait that long raises OverflowError, which ended the thread and with it every
later deadline on the stream — seen in CI's fresh-clone run on 3.10), and a call's time left."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from sidecar_client._tokenize_stream import _Alarm, _left
from sidecar_client.errors import DeadlineExceeded


class _Call:
    """What the alarm needs of a gRPC call: ``cancel()``."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


def test_a_far_deadline_keeps_the_alarm_alive_for_the_next_call() -> None:
    alarm = _Alarm()
    try:
        far = _Call()
        alarm.arm(far, time.monotonic() + 1e300)
        time.sleep(0.1)  # the thread waits on the far deadline now
        assert alarm._thread is not None and alarm._thread.is_alive()
        assert not alarm.disarm() and not far.cancelled.is_set()
        near = _Call()
        alarm.arm(near, time.monotonic() + 0.05)
        assert near.cancelled.wait(5), "the alarm did not fire: its thread is gone"
        assert alarm.disarm()
    finally:
        alarm.close()


def test_the_time_left_of_a_call_s_deadline() -> None:
    """What a stream call has left of its deadline: nothing to wait for without one, the
    seconds of a far one (the alarm caps its own wait, see above), DeadlineExceeded once it
    has passed (before anything is sent)."""
    assert _left(None) is None
    assert _left(time.monotonic() + 1e300) > 1e299
    assert 9.0 < (_left(time.monotonic() + 10) or 0) <= 10
    with pytest.raises(DeadlineExceeded) as exc:
        _left(time.monotonic() - 1)
    assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
