"""LocalPaths' bookkeeping of when an in-process path may be opened (no sidecar needed)."""

from __future__ import annotations

import time
import types
from pathlib import Path

import pytest

from sidecar_client import _local
from sidecar_client._local import LocalPaths
from sidecar_client._models import ModelInfo


def _info(name: str, shm_name: str) -> ModelInfo:
    return ModelInfo(name=name, fingerprint="0" * 32, backend="fastokens", vocab_size=1, boundary_tokens=1,
                     l1_disabled_reason="", has_chat_template=False, shm_name=shm_name, model_dir="")


def test_an_open_is_claimed_once_and_not_again_within_a_failed_attempts_retry(
        qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that opens on a worker thread (an event loop) claims the open first: from then
    on no other caller starts one (get answers None: RPC meanwhile); a model the sidecar has
    not listed, or whose last attempt failed less than RETRY_S ago, gives nothing to run; once
    RETRY_S has passed it is tried again."""
    clock = [1000.0]
    # The module's clock only (a copy of the time module whose monotonic is this test's).
    fake_time = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    fake_time.monotonic = lambda: clock[0]
    monkeypatch.setattr(_local, "time", fake_time)
    paths = LocalPaths({"m": qwen3_path})
    assert paths.claim_open("m") is None  # not listed by the sidecar yet
    paths.set_models([_info("m", "tokcache-test-no-such-segment")])
    job = paths.claim_open("m")
    assert job is not None and not paths.is_open("m")
    assert paths.claim_open("m") is None and paths.get("m") is None  # claimed: being opened
    assert job() is None  # no such segment here: RPC for RETRY_S
    assert paths.claim_open("m") is None and paths.get("m") is None
    clock[0] += _local.RETRY_S
    again = paths.claim_open("m")
    assert again is not None and again() is None
    paths.close()
    clock[0] += _local.RETRY_S
    assert paths.claim_open("m") is None  # closed


def test_a_claimed_open_that_cannot_run_gives_its_claim_back(qwen3_path: Path) -> None:
    """An open claimed for a worker thread that never runs it (an executor already shut down)
    is cancelled: the model is no longer "being opened", so a later request can open it;
    without that, every request would go over RPC for the client's life."""
    paths = LocalPaths({"m": qwen3_path})
    paths.set_models([_info("m", "tokcache-test-no-such-segment")])
    job = paths.claim_open("m")
    assert job is not None
    assert paths.claim_open("m") is None  # claimed
    job.cancel()
    again = paths.claim_open("m")
    assert again is not None  # claimable again, at once (no failed attempt's RETRY_S)
    assert again() is None  # no such segment: a real attempt, which does start RETRY_S
    assert paths.claim_open("m") is None
    paths.close()
