"""SIGTERM during load: health goes NOT_SERVING, in-flight requests finish, no accepted request is lost."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from pathlib import Path

import tokenizers

from sidecar_client import SidecarClient, SidecarUnavailable, TokcacheError
from tests.integration.sidecar_proc import SidecarProcess


def test_sigterm_under_load_loses_no_accepted_request(tmp_path: Path, qwen3_path: Path, shm_prefix: str) -> None:
    proc = SidecarProcess(tmp_path, {"qwen3": qwen3_path}, shm_prefix, "--grace-seconds", "10").start()
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    ok: list[tuple[str, list[int]]] = []
    refused: list[str] = []
    other: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def worker(n: int) -> None:
        with SidecarClient(proc.address, timeout=20, zero_rpc=False) as c:  # drain is about RPCs
            i = 0
            while not stop.is_set() and i < 5000:
                text = f"<|im_start|>user\nworker {n} request {i} {uuid.uuid4().hex} " + "long text " * 300
                i += 1
                try:
                    r = c.tokenize("qwen3", text=text)
                except SidecarUnavailable as exc:
                    with lock:
                        refused.append(exc.details)
                    return
                except TokcacheError as exc:
                    with lock:
                        other.append(f"{type(exc).__name__}: {exc.details}")
                    return
                with lock:
                    ok.append((text, r.token_ids))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    accepted_before = len(ok)
    code = proc.stop(signal.SIGTERM, timeout=30)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert code == 0, proc.log()
    assert accepted_before > 10
    # Every request either completed correctly or was refused as UNAVAILABLE before being accepted.
    assert other == [], other[:3]
    for text, ids in ok:
        assert ids == ref.encode(text).ids
    assert "draining" in proc.log()
