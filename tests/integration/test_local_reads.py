"""Reads in the caller's process, against a real sidecar: no RPC on a hit, same ids, clean fallbacks.

Each test starts the real ``tokcache-sidecar`` on a unix socket and uses the real client.
"In-process" is observed three ways: ``TokenizeResult.served_by``, the client's
``stats()``, and the sidecar's own Tokenize counter on its Prometheus port (which must
not move while the client reads locally).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from sidecar_client import AsyncSidecarClient, SidecarClient
from sidecar_client._local import MIN_FIRST_WRITE_BYTES, MIN_WRITE_BYTES, LocalModel
from tests.integration.sidecar_proc import SidecarProcess

TURN = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tokenize_rpcs(port: int) -> float:
    """The sidecar's count of Tokenize RPCs (all codes), from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in
               re.finditer(r'^tokcache_rpc_requests_total\{[^}]*method="Tokenize"[^}]*\} ([0-9.e+]+)$', text, re.M))


def _metric(port: int, series: str) -> float:
    """One series' value from the sidecar's /metrics (``name{labels}`` as exposed)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} is not exposed")


def _hold_opens(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make every LocalModel.open from now on set the first event, then wait (at most 30 s) for
    the second before opening: (entered, release)."""
    from sidecar_client import _local

    real_open = _local.LocalModel.open
    entered, release = threading.Event(), threading.Event()

    def held_open(*args: object, **kwargs: object) -> _local.LocalModel:
        entered.set()
        assert release.wait(30)
        return real_open(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_local.LocalModel, "open", staticmethod(held_open))
    return entered, release


def _conversation(turns: int) -> list[str]:
    text, out = "<|im_start|>system\nYou are terse.<|im_end|>\n", []
    for k in range(turns):
        text += TURN.format(q=f"question {k}: " + "word " * (k * 7))
        out.append(text)
        text += f"answer {k}\n\n  with spaces\t{k}<|im_end|>\n"
    return out


@pytest.fixture
def sidecar(tmp_path: Path, qwen3_path: Path, shm_prefix: str) -> Iterator[tuple[SidecarProcess, int]]:
    port = _free_port()
    proc = SidecarProcess(tmp_path, {"qwen3": qwen3_path}, shm_prefix, "--metrics-port", str(port)).start()
    try:
        yield proc, port
    finally:
        proc.stop()


def test_a_conversation_is_read_in_process_with_no_rpc_and_the_rpc_ids(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    proc, port = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = _conversation(8)
    # min_write_bytes=0: every read stores what it learned (these turns are short).
    with SidecarClient(proc.address, min_write_bytes=0) as local, SidecarClient(proc.address, zero_rpc=False) as rpc:
        local.tokenize("qwen3", text="warm up")  # one ListModels, then the segment is mapped
        before = _tokenize_rpcs(port)
        results = []
        for text in texts:
            r = local.tokenize("qwen3", text=text, add_special_tokens=False)
            assert r.served_by == "local"
            assert r.token_ids == ref.encode(text, add_special_tokens=False).ids
            results.append(r)
        assert _tokenize_rpcs(port) == before  # not one RPC for eight requests
        assert [r.decision.source for r in results[1:]] == ["l1"] * 7  # each turn found the one before
        assert local.flush(10)
        # What the reads learned is in the segment: the RPC path finds it, with the same ids.
        # Each turn's write held its turn before's entries (the turns came faster than HOLD_S):
        # the first turn (nothing cached: never held) and the last are found whole, the others
        # by prefix.
        for text, r in zip(texts, results, strict=True):
            again = rpc.tokenize("qwen3", text=text, add_special_tokens=False)
            assert again.served_by == "sidecar" and again.token_ids == r.token_ids
            assert again.decision.source == ("l0" if text is texts[0] or text is texts[-1] else "l1")
            assert again.decision.cached_chars >= len(text) - 2048  # at most a key's spacing encoded
        stats = local.stats()
        assert stats["tokenize"] == {"miss": 2, "l1": 7}
        # Stored: the warm-up's, the first turn's (nothing cached: never held) and the last turn's.
        assert stats["writes"] == {"stored": 3, "superseded": 6}
        # Every turn after the first extended the one before: the native fast path served it.
        assert stats["paths"] == {"python": 2, "native": 7}
        assert stats["declines"] == {"no_base": 2}  # the warm-up and the first turn extend nothing read here


def test_a_conversations_write_is_held_superseded_by_its_next_turn_and_stored_once_it_pauses(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """Turns of one conversation faster than HOLD_S: each turn's write replaces the one before
    (it holds its entries), and the last one is stored HOLD_S after it without a flush, by
    the background thread. Another client (the RPC path) then finds every turn with the ids
    this process served; a text whose write was superseded is found by prefix."""
    from sidecar_client._local import HOLD_S

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = _conversation(5)
    with SidecarClient(proc.address, min_write_bytes=0) as local, SidecarClient(proc.address, zero_rpc=False) as rpc:
        results = [local.tokenize("qwen3", text=t, add_special_tokens=False) for t in texts]
        assert all(r.served_by == "local" for r in results)
        # The last turn's write lands without a flush, HOLD_S after its read was settled (in
        # the pause after it) and a writer tick at most.
        deadline = time.monotonic() + HOLD_S + 5
        while local.stats()["writes"].get("stored", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        # Stored: the first turn's and the last's; superseded: turns 2-4's, each by the turn after.
        assert local.stats()["writes"] == {"stored": 2, "superseded": 3}
        for text, r in zip(texts, results, strict=True):
            again = rpc.tokenize("qwen3", text=text, add_special_tokens=False)
            assert again.token_ids == r.token_ids == ref.encode(text, add_special_tokens=False).ids
            assert again.decision.source == ("l0" if text is texts[0] or text is texts[-1] else "l1")


def test_async_client_reads_in_process_too(sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    import asyncio

    proc, port = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))

    async def main() -> None:
        async with AsyncSidecarClient(proc.address) as c:
            await c.tokenize("qwen3", text="warm up")
            before = _tokenize_rpcs(port)
            for text in _conversation(5):
                r = await c.tokenize("qwen3", text=text, add_special_tokens=False)
                assert r.served_by == "local" and r.token_ids == ref.encode(text, add_special_tokens=False).ids
            assert _tokenize_rpcs(port) == before

    asyncio.run(main())


def test_chat_messages_and_prompt_text_still_go_to_the_sidecar(sidecar: tuple[SidecarProcess, int]) -> None:
    proc, _ = sidecar
    with SidecarClient(proc.address) as c:
        r = c.tokenize("qwen3", messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True,
                       return_prompt_text=True)
        assert r.served_by == "sidecar" and r.prompt_text and r.prompt_text.endswith("assistant\n")
        assert c.tokenize("qwen3", text=r.prompt_text, add_special_tokens=False).token_ids == r.token_ids


def test_a_replaced_segment_is_noticed_and_mapped_again(tmp_path: Path, qwen3_path: Path, shm_prefix: str) -> None:
    """A sidecar restarted with another --shm-size replaces the segment; the client follows."""
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = _conversation(6)
    first = SidecarProcess(tmp_path / "a", {"qwen3": qwen3_path}, shm_prefix)
    (tmp_path / "a").mkdir()
    first.start()
    with SidecarClient(first.address) as c:
        r0 = c.tokenize("qwen3", text=texts[0], add_special_tokens=False)
        old = c._local.get("qwen3") if c._local is not None else None
        assert r0.served_by == "local" and old is not None
        first.stop()
        second = SidecarProcess(tmp_path / "a", {"qwen3": qwen3_path}, shm_prefix)
        second.cmd[second.cmd.index("--shm-size") + 1] = "48MiB"  # another size: the segment is replaced
        second.start()
        try:
            assert old.stale  # retired by the new sidecar: never read again
            for text in texts[1:]:
                r = c.tokenize("qwen3", text=text, add_special_tokens=False)
                assert r.token_ids == ref.encode(text, add_special_tokens=False).ids
            new = c._local.get("qwen3") if c._local is not None else None
            assert new is not None and new is not old and new.reader.size == 48 << 20
            assert r.served_by == "local"
        finally:
            second.stop()


def test_a_process_that_cannot_map_the_segment_uses_rpc_logged_once(
        sidecar: tuple[SidecarProcess, int], tmp_path: Path) -> None:
    """Another mount namespace with its own /dev/shm (as a container without a shared one)."""
    proc, _ = sidecar
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --mount is not permitted here")
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import json, logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        from sidecar_client import SidecarClient
        with SidecarClient({proc.address!r}) as c:
            served = [c.tokenize("qwen3", text="hello " * k).served_by for k in range(1, 6)]
            print(json.dumps({{"served": served, "stats": c.stats()}}))
    """))
    cmd = ["unshare", "--mount", "sh", "-c",
           f"mount -t tmpfs -o size=8m tmpfs /dev/shm && exec {sys.executable} {script}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path.cwd(),
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["served"] == ["sidecar"] * 5
    assert got["stats"]["fallbacks"].get("no_segment") == 5
    assert out.stderr.count("in-process reads off for model 'qwen3' (no_segment)") == 1


def test_without_a_local_tokenizer_the_rpc_path_serves(tmp_path: Path, qwen3_path: Path, shm_prefix: str) -> None:
    """The sidecar's model directory is not reachable from the client (as in another container)."""
    model = tmp_path / "model"
    shutil.copytree(qwen3_path, model)
    proc = SidecarProcess(tmp_path, {"qwen3": model}, shm_prefix).start()
    try:
        shutil.rmtree(model)  # loaded by the sidecar; gone for the client
        with SidecarClient(proc.address) as c:
            r = c.tokenize("qwen3", text="hello there")
            assert r.served_by == "sidecar" and c.stats()["fallbacks"] == {"no_tokenizer": 1}
        # Told where a copy is, the client reads in-process again.
        with SidecarClient(proc.address, tokenizers={"qwen3": qwen3_path}) as c:
            assert c.tokenize("qwen3", text="hello there").served_by == "local"
    finally:
        proc.stop()


def test_another_tokenizer_file_is_refused_by_fingerprint(sidecar: tuple[SidecarProcess, int],
                                                          llama32_path: Path) -> None:
    proc, _ = sidecar
    with SidecarClient(proc.address, tokenizers={"qwen3": llama32_path}) as c:
        r = c.tokenize("qwen3", text="hello there", add_special_tokens=False)
        assert r.served_by == "sidecar" and c.stats()["fallbacks"] == {"manifest": 1}


def test_a_segment_the_client_may_not_write_is_read_and_learned_through_the_sidecar(
        sidecar: tuple[SidecarProcess, int], tmp_path: Path, qwen3_path: Path) -> None:
    """A client that may read the segment but not write it: reads in-process, learns via RPC.

    The segment is handed to another owner with mode 0644 and the client runs without the
    capabilities that let root ignore file modes (``setpriv``), so opening it for writing
    fails as it would for a container running as another user.
    """
    proc, _ = sidecar
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    prefix = proc.cmd[proc.cmd.index("--shm-prefix") + 1]
    shm = next(p for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix) and "." not in p.name)
    os.chown(shm, 65534, 65534)
    os.chmod(shm, 0o644)
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from sidecar_client import SidecarClient
        texts = {_conversation(4)!r}
        with SidecarClient({proc.address!r}, min_write_bytes=0) as c:
            served = [c.tokenize("qwen3", text=t, add_special_tokens=False).served_by for t in texts]
            c.flush(10)
            print(json.dumps({{"served": served, "stats": c.stats()}}))
    """))
    cmd = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--", sys.executable, str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["served"] == ["local"] * 4
    assert got["stats"]["writes"].get("learned") == 4 and "stored" not in got["stats"]["writes"]
    # The sidecar stored what the read-only client learned (the learn RPCs are fire-and-forget).
    with SidecarClient(proc.address, zero_rpc=False) as c:
        last = _conversation(4)[-1]
        import time

        for _ in range(50):
            if c.tokenize("qwen3", text=last, add_special_tokens=False).decision.source == "l0":
                break
            time.sleep(0.1)
        else:
            pytest.fail("the sidecar never stored what the client learned")


def test_while_one_thread_opens_the_segment_other_requests_use_rpc(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening (map + load the encoder, ~1 s) holds no lock callers wait on: a request that
    arrives meanwhile is answered over RPC at once (fallback 'opening'); the opener's
    result then serves in-process. A client closed during an open keeps nothing mapped."""
    import threading
    import time


    proc, _ = sidecar
    entered, release = _hold_opens(monkeypatch)
    with SidecarClient(proc.address) as c:
        c._local.set_models(c.list_models())  # type: ignore[union-attr]
        opener = threading.Thread(target=c._local.get, args=("qwen3",))  # type: ignore[union-attr]
        opener.start()
        assert entered.wait(30)
        t0 = time.monotonic()
        r = c.tokenize("qwen3", text="while the segment is being opened", add_special_tokens=False)
        assert r.served_by == "sidecar" and time.monotonic() - t0 < 5
        assert c.stats()["fallbacks"] == {"opening": 1}
        release.set()
        opener.join(30)
        assert c.tokenize("qwen3", text="after it opened", add_special_tokens=False).served_by == "local"

    entered.clear()
    release.clear()
    c = SidecarClient(proc.address)
    c._local.set_models(c.list_models())  # type: ignore[union-attr]
    got: list[object] = []
    opener = threading.Thread(target=lambda: got.append(c._local.get("qwen3")))  # type: ignore[union-attr]
    opener.start()
    assert entered.wait(30)
    c.close()
    release.set()
    opener.join(30)
    assert got == [None]  # the model it opened was closed at once, not left mapped
    assert not c._local._models  # type: ignore[union-attr]


def test_the_async_client_opens_the_segment_off_its_event_loop(
        sidecar: tuple[SidecarProcess, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The first request of an AsyncSidecarClient waits for the open (map + load the encoder,
    ~1 s) in a worker thread: the event loop keeps running meanwhile, and a request that
    arrives then is answered over RPC; the first is then read in-process."""
    import asyncio
    import time


    proc, _ = sidecar
    entered, release = _hold_opens(monkeypatch)

    async def main() -> None:
        async with AsyncSidecarClient(proc.address) as c:
            first = asyncio.create_task(c.tokenize("qwen3", text="the first request", add_special_tokens=False))
            while not entered.is_set():  # the loop runs while the open has begun in a thread
                await asyncio.sleep(0.005)
            t0 = time.monotonic()
            other = await c.tokenize("qwen3", text="while the segment is being opened", add_special_tokens=False)
            assert other.served_by == "sidecar" and time.monotonic() - t0 < 5
            assert not first.done()
            release.set()
            r = await asyncio.wait_for(first, 30)
            assert r.served_by == "local"
            assert c.stats()["fallbacks"] == {"opening": 1}
            again = await c.tokenize("qwen3", text="after it opened", add_special_tokens=False)
            assert again.served_by == "local"

    asyncio.run(main())


def test_an_async_read_whose_loop_cannot_run_the_open_goes_over_rpc_and_opens_later(
        sidecar: tuple[SidecarProcess, int]) -> None:
    """An event loop whose executor was shut down (an application exiting) cannot run the
    open: the request is answered over RPC and the claim given back, so once the loop has an
    executor again the model is opened and read in-process (not "being opened" for good)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    proc, _ = sidecar

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gone = ThreadPoolExecutor(1)
        gone.shutdown()
        loop.set_default_executor(gone)
        async with AsyncSidecarClient(proc.address) as c:
            r = await c.tokenize("qwen3", text="no executor to open the segment on", add_special_tokens=False)
            assert r.served_by == "sidecar" and r.token_ids
            loop.set_default_executor(ThreadPoolExecutor(2))
            again = await c.tokenize("qwen3", text="an executor again", add_special_tokens=False)
            assert again.served_by == "local"

    asyncio.run(main())


def test_the_plugin_opens_the_segment_during_its_handshake(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """vLLM's first prompt does not pay for mapping the segment and loading the encoder on
    the event loop: the handshake starts that on a worker thread, and once it is done the
    first prompt is read in-process."""
    import asyncio

    from sidecar_client.vllm._config import PluginConfig
    from sidecar_client.vllm._link import Served, SidecarLink
    from sidecar_client.vllm._stats import PluginStats
    from tokcache.engine.tokenizer import fingerprint_of

    proc, _ = sidecar
    tj = qwen3_path / "tokenizer.json"

    async def main() -> None:
        link = SidecarLink(PluginConfig(address=proc.address, timeout_s=5.0), fingerprint_of(tj), PluginStats(),
                           tokenizer_file=str(tj))
        task = link._maybe_start_handshake()
        assert task is not None
        await task
        assert link.ready and link._opening is not None
        local = await link._opening  # no prompt has been tokenized yet
        assert local is not None and link.client().local is not None
        assert link.client().local._models == {"qwen3": local}  # type: ignore[union-attr]
        out = await link.tokenize("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False, cache_salt=None)
        assert isinstance(out, Served) and out.served_by == "local"
        # The client counts its read paths into the plugin's own counter (tokcache_vllm_read_path):
        # a first read takes the Python path; a turn that extends a stored one, the native path.
        assert link.stats.paths == {"python": 1}
        assert link.client().local.stats.paths is link.stats.paths  # type: ignore[union-attr]
        turn = "<|im_start|>user\n" + "Summarise the log above, line by line. " * 200 + "<|im_end|>\n"
        for text in (turn, turn + "<|im_start|>assistant\nDone.<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"):
            out = await link.tokenize(text, add_special_tokens=False, cache_salt=None)
            assert isinstance(out, Served) and out.served_by == "local"
        assert link.stats.paths == {"python": 2, "native": 1}
        # Why: neither Python-path read extended a text this process had read
        # (tokcache_vllm_native_declines).
        assert link.stats.declines == {"no_base": 2}
        assert link.client().local.stats.declines is link.stats.declines  # type: ignore[union-attr]
        await link.close()

    asyncio.run(main())


def test_the_plugin_whose_loop_cannot_run_the_open_reads_over_rpc_and_opens_later(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """vLLM's loop with its executor shut down (the server exiting): the handshake cannot
    start the open, prompts are answered by the sidecar, and the claim is given back, so
    with an executor again the next prompt starts the open and later ones are read
    in-process."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from sidecar_client.vllm._config import PluginConfig
    from sidecar_client.vllm._link import Served, SidecarLink
    from sidecar_client.vllm._stats import PluginStats
    from tokcache.engine.tokenizer import fingerprint_of

    proc, _ = sidecar
    tj = qwen3_path / "tokenizer.json"
    prompt = "<|im_start|>user\nhi<|im_end|>\n"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gone = ThreadPoolExecutor(1)
        gone.shutdown()
        loop.set_default_executor(gone)
        link = SidecarLink(PluginConfig(address=proc.address, timeout_s=5.0), fingerprint_of(tj), PluginStats(),
                           tokenizer_file=str(tj))
        task = link._maybe_start_handshake()
        assert task is not None
        await task
        assert link.ready and link._opening is None
        out = await link.tokenize(prompt, add_special_tokens=False, cache_salt=None)
        assert isinstance(out, Served) and out.served_by == "sidecar"
        loop.set_default_executor(ThreadPoolExecutor(2))
        out = await link.tokenize(prompt, add_special_tokens=False, cache_salt=None)
        assert isinstance(out, Served)  # its open started on a worker thread
        assert link._opening is not None and await link._opening is not None
        out = await link.tokenize(prompt, add_special_tokens=False, cache_salt=None)
        assert isinstance(out, Served) and out.served_by == "local"
        await link.close()

    asyncio.run(main())


def test_the_plugin_maps_a_replaced_segment_again_off_its_event_loop(
        tmp_path: Path, qwen3_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sidecar restart replaces the segment: the plugin's next prompts are answered by the
    sidecar at once while a worker thread maps the new segment and loads the encoder (it
    used to do that inside the prompt, on vLLM's event loop: ~1-3 s of every request of the
    API server stalled), then are read in-process again, with the reference's ids."""
    import asyncio
    import time

    from sidecar_client.vllm._config import PluginConfig
    from sidecar_client.vllm._link import Served, SidecarLink
    from sidecar_client.vllm._stats import PluginStats
    from tokcache.engine.tokenizer import fingerprint_of

    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    tj = qwen3_path / "tokenizer.json"
    texts = _conversation(6)
    (tmp_path / "a").mkdir()
    first = SidecarProcess(tmp_path / "a", {"qwen3": qwen3_path}, shm_prefix).start()
    second = SidecarProcess(tmp_path / "a", {"qwen3": qwen3_path}, shm_prefix)
    second.cmd[second.cmd.index("--shm-size") + 1] = "48MiB"  # another size: the segment is replaced
    entered, release = _hold_opens(monkeypatch)
    release.set()  # the handshake's open goes through; the open after the restart is held

    async def main() -> None:
        link = SidecarLink(PluginConfig(address=first.address, timeout_s=5.0), fingerprint_of(tj), PluginStats(),
                           tokenizer_file=str(tj))
        task = link._maybe_start_handshake()
        assert task is not None
        await task
        assert link._opening is not None and await link._opening is not None
        out = await link.tokenize(texts[0], add_special_tokens=False, cache_salt=None)
        assert isinstance(out, Served) and out.served_by == "local"
        first.stop()
        second.start()
        entered.clear()
        release.clear()
        served: list[Served] = []
        deadline = time.monotonic() + 60
        for text in texts[1:3]:  # while the new segment's open is held: the sidecar answers
            while True:
                t0 = time.monotonic()
                got = await link.tokenize(text, add_special_tokens=False, cache_salt=None)
                assert time.monotonic() - t0 < 5.5  # one deadline at most, never the open
                if isinstance(got, Served):
                    break
                assert time.monotonic() < deadline, got  # the restarted sidecar is found again
                await asyncio.sleep(0.05)
            assert got.served_by == "sidecar" and got.token_ids == ref.encode(text, add_special_tokens=False).ids
            served.append(got)
        assert entered.is_set() and link._opening is not None and not link._opening.done()
        release.set()
        assert await link._opening is not None
        for text in texts[3:]:
            got = await link.tokenize(text, add_special_tokens=False, cache_salt=None)
            assert isinstance(got, Served) and got.served_by == "local"
            assert got.token_ids == ref.encode(text, add_special_tokens=False).ids
        await link.close()

    try:
        asyncio.run(main())
    finally:
        release.set()
        first.stop()
        if second.proc is not None:
            second.stop()


def test_an_open_breaker_keeps_in_process_reads_and_stops_their_rpc_fallbacks(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the plugin's breaker open, prompts read in-process are still served; a prompt the
    in-process path hands to the sidecar (a cluster-tier candidate, a re-mapped segment) falls
    back to vLLM at once instead of calling the sidecar."""
    import asyncio

    from sidecar_client._local import LocalPaths
    from sidecar_client.vllm._config import PluginConfig
    from sidecar_client.vllm._link import Served, SidecarLink
    from sidecar_client.vllm._stats import PluginStats
    from tokcache.engine.tokenizer import fingerprint_of

    proc, port = sidecar
    tj = qwen3_path / "tokenizer.json"

    async def main() -> None:
        link = SidecarLink(PluginConfig(address=proc.address, timeout_s=5.0, breaker_failures=2), fingerprint_of(tj),
                           PluginStats(), tokenizer_file=str(tj))
        task = link._maybe_start_handshake()
        assert task is not None
        await task
        assert link._opening is not None and await link._opening is not None
        link.breaker.failure()
        link.breaker.failure()
        assert link.breaker.state == "open"
        out = await link.tokenize("<|im_start|>user\nstill local<|im_end|>\n", add_special_tokens=False,
                                  cache_salt=None)
        assert isinstance(out, Served) and out.served_by == "local"
        monkeypatch.setattr(LocalPaths, "tokenize", lambda *a, **k: None)  # as for a tier candidate
        before = _tokenize_rpcs(port)
        assert await link.tokenize("needs the sidecar", add_special_tokens=False, cache_salt=None) == "breaker_open"
        assert _tokenize_rpcs(port) == before
        await link.close()

    asyncio.run(main())


def _opened(c: SidecarClient) -> LocalModel:
    """The model ``c`` reads "qwen3" with in this process, once it does (warm-up calls until then)."""
    while c.tokenize("qwen3", text="warm up").served_by != "local":
        pass
    local = c._local.get("qwen3") if c._local is not None else None
    assert local is not None
    return local


def _opened_with_writer(c: SidecarClient) -> LocalModel:
    """:func:`_opened`, then the background thread started by a first write and waiting for its next
    look (a test that sets WRITER_TICK_S to a minute keeps it away from what follows)."""
    local = _opened(c)
    c.tokenize("qwen3", text="warm up: start the background thread")
    assert c.flush(5)
    time.sleep(0.5)
    return local


@contextlib.contextmanager
def _no_thread_switches() -> Iterator[None]:
    """A switch interval of seconds: another thread of this process (the write-behind's) gets the
    GIL only where this one blocks or releases it, not between two of its statements, however
    the process is scheduled."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def _agent_turns(turns: int, size: int) -> list[str]:
    """A conversation whose turns each append ~``size`` bytes (an answer and a tool result)."""
    text, out = "<|im_start|>system\nYou are an agent.<|im_end|>\n", []
    for k in range(turns):
        body = " ".join(f"line {k}.{i}: {'x' * (i % 13)} 你好" for i in range(size // 28))
        text += f"<|im_start|>user\ntool result {k}:\n{body}<|im_end|>\n<|im_start|>assistant\n"
        out.append(text)
        text += f"step {k} done.<|im_end|>\n"
    return out


def test_the_next_turn_stores_the_previous_turns_write_in_its_own_thread(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Back to back, a conversation's first write (nothing was cached: never held, see HOLD_S)
    is stored by the conversation's next request, in the caller's thread, before its lookup:
    that lookup then finds it (read your writes) with no thread switch. The writes of the turns
    after it are held, each superseded by the next turn's, the last stored by the flush. (The
    background thread is kept away: it would look only once a minute.)"""
    import threading

    from sidecar_client import _local

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    monkeypatch.setattr(_local, "WRITER_TICK_S", 60.0)
    monkeypatch.setattr(_local, "HOLD_S", 60.0)
    stored_by: list[str] = []
    real_commit = _local.commit

    def commit(*args: object, **kwargs: object) -> object:
        stored_by.append(threading.current_thread().name)
        return real_commit(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_local, "commit", commit)
    texts = _agent_turns(6, 900)
    with SidecarClient(proc.address, min_write_bytes=0) as c:
        _opened_with_writer(c)
        stored_by.clear()
        before = c.stats()["writes"]["stored"]
        results = [c.tokenize("qwen3", text=t, add_special_tokens=False) for t in texts]
        assert [r.token_ids for r in results] == [ref.encode(t, add_special_tokens=False).ids for t in texts]
        # Every later turn found the first turn's entries: cached up to a keyed cut of its text.
        for r in results[1:]:
            assert r.decision.source == "l1" and r.decision.cached_chars >= len(texts[0]) - 2048
        assert stored_by == [threading.main_thread().name]  # the first turn's, by the second
        assert c.flush(5)
        writes = c.stats()["writes"]
        assert (writes["stored"] - before, writes["superseded"]) == (2, 4)  # + the last turn's


def test_a_busy_writer_lock_holds_a_request_for_an_inline_lock_wait_at_most(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that finds its conversation's previous write queued tries to store it first,
    waiting INLINE_LOCK_S for the writer lock; while another holder keeps the lock (a process
    waiting for a core, at 16 processes on 2 cores), it gives up and is served, and the write
    stays queued. It counted a busy lock as stored and tried again, for as long as the lock
    stayed busy. (The lock is held here by this process's main thread, which the semaphore
    blocks like any other; a timer lets it go after 5 s, so a regression fails, never hangs.)"""
    import threading

    from sidecar_client import _local

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    monkeypatch.setattr(_local, "WRITER_TICK_S", 60.0)  # the background thread keeps away
    texts = _agent_turns(3, 900)
    with SidecarClient(proc.address, min_write_bytes=0) as c:
        local = _opened_with_writer(c)
        store = local.writer._store
        assert store is not None
        first = c.tokenize("qwen3", text=texts[0], add_special_tokens=False)
        assert not local.writer.idle  # its write waits for the next request (or a flush)
        held = threading.Lock()  # taken by whoever releases the writer lock: the test or the timer
        store._lock.acquire()

        def release() -> None:
            if held.acquire(blocking=False):
                store._lock.release()

        timer = threading.Timer(5.0, release)
        timer.start()
        try:
            t0 = time.monotonic()
            second = c.tokenize("qwen3", text=texts[1], add_special_tokens=False)
            took = time.monotonic() - t0
        finally:
            timer.cancel()
            release()
        assert took < 1.0, took
        assert not local.writer.idle  # still queued: stored once the lock is free
        assert [first.token_ids, second.token_ids] == [ref.encode(t, add_special_tokens=False).ids
                                                       for t in texts[:2]]
        assert c.flush(5) and local.writer.idle
        assert c.stats()["writes"].get("stored", 0) >= 2
        third = c.tokenize("qwen3", text=texts[2], add_special_tokens=False)
        assert third.token_ids == ref.encode(texts[2], add_special_tokens=False).ids
        assert third.decision.cached_chars >= len(texts[1]) - 2048  # the stored writes serve it


def test_closing_while_the_write_behind_waits_for_the_writer_lock_unmaps_once_it_is_done(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """A client closed while its background thread waits for a writer lock held elsewhere (a
    store's lock timeout outlasts close's own waits) keeps the segment mapped and its
    semaphore open until the thread is done: unmapping under it faulted (SIGSEGV in sem_wait,
    found by the test above). Once the lock is free the thread stores the write and the
    segment is unmapped."""
    import threading

    proc, _ = sidecar
    texts = _agent_turns(1, 900)
    c = SidecarClient(proc.address, min_write_bytes=0)
    try:
        local = _opened_with_writer(c)
        store = local.writer._store
        assert store is not None
        store._lock._timeout = 60.0  # the background thread's wait outlasts close()
        held = threading.Lock()

        def release() -> None:
            if held.acquire(blocking=False):
                store._lock.release()

        store._lock.acquire()
        timer = threading.Timer(30.0, release)  # a regression fails, never hangs
        timer.start()
        try:
            c.tokenize("qwen3", text=texts[0], add_special_tokens=False)  # its write: for the thread
            deadline = time.monotonic() + 10
            while not any(i.state == 1 for i in local.writer._items) and time.monotonic() < deadline:
                time.sleep(0.01)  # the thread takes it and waits for the lock
            assert any(i.state == 1 for i in local.writer._items)
            c.close()  # ~4 s: its flush and its join wait for the thread, which still waits
            assert not local.reader._closed and store._mm is not None  # still mapped: the thread waits
        finally:
            timer.cancel()
            release()
        deadline = time.monotonic() + 10
        while not local.reader._closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert local.reader._closed and store._mm is None  # unmapped by the thread as it ended
        assert local.writer.idle and c.stats()["writes"].get("stored", 0) >= 1
    finally:
        c.close()


def test_writes_no_later_turn_extends_do_not_pile_up_under_load(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Back to back, a process never pauses and its background thread stores next to nothing; the
    writes no later request of the process extends (here: every one, each request a new
    conversation's first turn) are stored by the requests once more than QUEUE_SOFT are queued, so
    the queue stays short (each request compares its text with every queued one) and none is
    dropped. Before, they piled up until the queue was full. (The background thread is kept
    away: it looks once a minute here.)"""
    from sidecar_client import _local

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    monkeypatch.setattr(_local, "WRITER_TICK_S", 60.0)
    first = _agent_turns(1, 600)[0]
    texts = [f"<|im_start|>system\nAgent {k}.<|im_end|>\n" + first for k in range(3 * _local.QUEUE_SOFT)]
    with SidecarClient(proc.address, min_write_bytes=0) as c:
        local = _opened_with_writer(c)
        queued = []
        for t in texts:
            r = c.tokenize("qwen3", text=t, add_special_tokens=False)
            assert r.token_ids == ref.encode(t, add_special_tokens=False).ids
            queued.append(len(local.writer._items))
        assert max(queued) <= _local.QUEUE_SOFT + 1, queued
        assert c.flush(5)
        writes = c.stats()["writes"]
        assert writes["stored"] >= len(texts) and "dropped" not in writes, writes


def test_a_short_uncached_tail_stores_nothing_and_costs_no_re_encoding(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """min_write_bytes: a read whose uncached tail is shorter stores nothing, so the next turns
    hit the last stored cut and their uncached tails grow until one is stored; meanwhile each
    turn encodes only what it appended (the rest comes from what this process encoded), and
    every turn's ids are the reference's."""
    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = _agent_turns(9, 700)
    with SidecarClient(proc.address, min_write_bytes=2500) as c:
        c.tokenize("qwen3", text="warm up")
        local = c._local.get("qwen3") if c._local is not None else None
        assert local is not None
        encoded: list[int] = []
        real = local.model.encoder.encode
        monkeypatch.setattr(local.model.encoder, "encode", lambda t: (encoded.append(len(t)), real(t))[1])
        uncached, sizes = [], []
        for prev, text in zip([""] + texts, texts, strict=False):
            encoded.clear()
            r = c.tokenize("qwen3", text=text, add_special_tokens=False)
            c.flush(5)
            assert r.token_ids == ref.encode(text, add_special_tokens=False).ids
            uncached.append(r.decision.encoded_chars)
            sizes.append(sum(encoded))
            if prev and r.decision.encoded_chars > len(text) - len(prev) + 64:
                assert sum(encoded) <= len(text) - len(prev) + 64, (r.decision, encoded)
        writes = c.stats()["writes"]
        assert writes["stored"] >= 2 and writes["skipped"] >= 2, writes
        # Uncached tails grew over turns between stores (past one turn's), and shrank after each.
        assert max(uncached[1:]) > 1.5 * min(uncached[1:]), uncached
        assert any(b < a for a, b in zip(uncached, uncached[1:], strict=False)), uncached


def test_a_first_read_stores_from_4_kb_later_ones_from_min_write_bytes(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """MIN_FIRST_WRITE_BYTES: with the default min_write_bytes (16 KB), a conversation's first
    read (nothing cached, >= 4 KB) is stored, so its next turns hit it (L1); their own short
    tails are not stored until they reach min_write_bytes. Ids are the reference's throughout."""
    proc, _ = sidecar
    assert MIN_FIRST_WRITE_BYTES < MIN_WRITE_BYTES
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = _agent_turns(10, 4600)  # ~4.2 KB a turn
    assert len(texts[0].encode()) >= MIN_FIRST_WRITE_BYTES
    assert 2 * (len(texts[1].encode()) - len(texts[0].encode())) < MIN_WRITE_BYTES
    with SidecarClient(proc.address) as c:
        c.tokenize("qwen3", text="warm up")
        stored: list[int] = []
        sources: list[str] = []
        for text in texts:
            before = c.stats()["writes"].get("stored", 0)
            r = c.tokenize("qwen3", text=text, add_special_tokens=False)
            assert c.flush(5)
            assert r.token_ids == ref.encode(text, add_special_tokens=False).ids
            stored.append(c.stats()["writes"].get("stored", 0) - before)
            sources.append(r.decision.source)
    assert stored[0] == 1 and sources[0] == "miss", (stored, sources)
    assert sources[1:] == ["l1"] * (len(texts) - 1), sources
    # Later reads store only once their uncached tail reaches min_write_bytes (16 KB here: a
    # few turns of ~4.5 KB), not every turn.
    assert 1 <= sum(stored[1:]) < len(texts) - 2, stored


def test_heads_built_after_the_reply_serve_the_next_turn_and_are_the_callers(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tokcache.engine.heads: a turn's ids up to its last stable cut are copied after the reply
    (here by flush, as the write-behind does between turns) and the next turn hands that
    list, extended, to its caller; the caller may change it. Back to back, a request never
    builds a head (the next turn copies its ids itself), and the ids are the same."""
    import threading

    from sidecar_client import _local
    from tokcache.engine.heads import Heads

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    monkeypatch.setattr(_local, "WRITER_TICK_S", 60.0)  # the background thread looks once a minute
    built_by: list[str] = []
    real_build = Heads.build

    def build(self: Heads[Any, Any], ready: Any) -> None:
        built_by.append(threading.current_thread().name)
        real_build(self, ready)

    monkeypatch.setattr(Heads, "build", build)
    for between in (True, False):
        texts = _agent_turns(8, 700 + between)  # two conversations
        with SidecarClient(proc.address) as c:
            local = _opened(c)
            assert c.flush(5)
            heads = local.lookup.heads
            used = heads.used
            built_by.clear()
            for text in texts:
                r = c.tokenize("qwen3", text=text, add_special_tokens=False)
                assert r.served_by == "local"
                assert r.token_ids == ref.encode(text, add_special_tokens=False).ids
                r.token_ids[:] = [-1]  # the caller's own list
                if between:
                    assert c.flush(5)
            if between:
                assert heads.used - used >= len(texts) - 2, (heads.built, heads.used)
            else:
                assert threading.main_thread().name not in built_by, built_by
            assert c.flush(5)


def test_the_background_thread_builds_the_head_between_turns(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """Nobody flushes: once requests pause (HEADS_QUIET_S), the write-behind thread settles the
    read and builds the head on its own, and the next turn uses it."""
    import time

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = _agent_turns(4, 800)
    with SidecarClient(proc.address) as c:
        local = _opened(c)
        heads = local.lookup.heads
        used = heads.used
        for text in texts:
            r = c.tokenize("qwen3", text=text, add_special_tokens=False)
            assert r.token_ids == ref.encode(text, add_special_tokens=False).ids
            deadline = time.monotonic() + 5
            # The model "generates": the thread settles the read (which offers its head), then builds the head.
            while (local.settler.pending or heads.pending) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not local.settler.pending and not heads.pending
        assert heads.used - used >= len(texts) - 1, (heads.built, heads.used)


def test_the_background_thread_looks_rarely_while_requests_keep_coming(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """Back to back, every request settles its predecessor's bookkeeping itself; a look by the
    write-behind thread would only cost the caller a GIL hand-off. So while requests keep coming
    (one begins within HEADS_QUIET_S of the last) the thread looks twice as late each time (up
    to BUSY_LOOK_S), not every HEADS_QUIET_S (~80 looks a second before: as often as the GIL
    let it; 43 in CI when a pause was judged by heads offered, which not every request makes);
    once they pause it still settles the last read and builds its head, and the ids are right
    throughout."""
    import time

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))

    class CountingCondition:
        def __init__(self, cond: threading.Condition) -> None:
            self.cond, self.waits = cond, 0

        def wait(self, timeout: float | None = None) -> bool:
            self.waits += 1
            return self.cond.wait(timeout)

        def notify(self, n: int = 1) -> None:
            self.cond.notify(n)

        def notify_all(self) -> None:
            self.cond.notify_all()

    texts = [t for seed in range(6) for t in _agent_turns(12, 600 + seed)]
    want = {t: ref.encode(t, add_special_tokens=False).ids for t in texts}
    with SidecarClient(proc.address) as c:
        local = _opened(c)
        assert c.flush(5)
        counting = CountingCondition(local.writer._work)
        local.writer._work = counting  # type: ignore[assignment]
        burst, n, t0 = 1.0, 0, time.monotonic()
        while time.monotonic() - t0 < burst:
            text = texts[n % len(texts)]
            assert c.tokenize("qwen3", text=text, add_special_tokens=False).token_ids == want[text], n
            n += 1
        elapsed = time.monotonic() - t0
        looks = counting.waits
        assert n >= 100, n  # requests did keep coming
        assert looks * 0.025 < elapsed, (looks, n, elapsed)  # ~16 looks in 1 s (~80 before)
        deadline = time.monotonic() + 5
        while (local.settler.pending or local.lookup.heads.pending) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not local.settler.pending and not local.lookup.heads.pending


def test_paced_requests_are_settled_in_the_pause_after_each_and_back_to_back_ones_wake_nothing(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests a few tens of ms apart, nobody flushing: once the write-behind thread settled one
    read in a pause, each request wakes it, and it settles that request's read in the pause after
    it rather than leaving it to the next request (before, a thread not parked looked only at its
    tick, and most reads were settled inline by the next request). Here the tick is a minute, so
    only the wake can settle them. Back to back, a request that finds its predecessor unsettled
    settles it and the requests after wake the thread no more."""
    from sidecar_client import _local

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = _agent_turns(8, 700)
    want = {t: ref.encode(t, add_special_tokens=False).ids for t in texts}

    def settled_within(local: LocalModel, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while local.settler.pending and time.monotonic() < deadline:
            time.sleep(0.002)
        return not local.settler.pending

    with SidecarClient(proc.address) as c:
        monkeypatch.setattr(_local, "WRITER_TICK_S", 0.05)
        local = _opened_with_writer(c)
        assert c.tokenize("qwen3", text=texts[0], add_special_tokens=False).token_ids == want[texts[0]]
        assert settled_within(local, 5)  # by the thread's own look (its tick): a pause found
        monkeypatch.setattr(_local, "WRITER_TICK_S", 60.0)
        time.sleep(0.3)  # the thread's next wait is a minute long
        for text in texts[1:5]:
            assert c.tokenize("qwen3", text=text, add_special_tokens=False).token_ids == want[text]
            assert settled_within(local, 5), "a paced request's read was left for the next request"
        notified = []
        work = local.writer._work
        monkeypatch.setattr(work, "notify", lambda n=1: (notified.append(n), type(work).notify(work, n))[1])
        # Back to back: the second request finds the first unsettled, however this process is
        # scheduled (see _no_thread_switches).
        with _no_thread_switches():
            got = [c.tokenize("qwen3", text=text, add_special_tokens=False).token_ids for text in texts[5:]]
        assert got == [want[t] for t in texts[5:]]
        assert len(notified) <= 1, notified  # the first request's wake only
        assert c.flush(5)


def test_a_request_still_being_served_is_no_pause(sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """A process that waits for a core in the middle of a request (16 busy processes on 2 cores
    wait tens of ms at a time) has not paused: the write-behind thread leaves the bookkeeping of
    the read before it queued until the request ended (before, it took each such wait for a
    pause and took the GIL from the request), then settles it on its own."""
    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    text = _agent_turns(2, 950)[-1]
    want = ref.encode(text, add_special_tokens=False).ids
    with SidecarClient(proc.address) as c:
        local = _opened(c)
        assert c.flush(5)
        writer = local.writer
        # From the read's end to the next request's start there is no pause, however this
        # process is scheduled: with a switch interval of seconds the write-behind thread gets
        # no GIL in between (this thread blocks on nothing there). Before, a stall of this
        # thread longer than HEADS_QUIET_S (2 ms) on a busy CI machine was a pause, and the
        # thread settled the read before the first assertion below.
        with _no_thread_switches():
            got = c.tokenize("qwen3", text=text, add_special_tokens=False).token_ids
            pending = local.settler.pending  # settled by the next request, or by the thread at a pause
            writer.note_request()  # the next request begins, and its process waits for a core
        assert got == want
        assert pending
        stall = time.monotonic() + 0.3  # three times the longest the thread sleeps (WRITER_TICK_S)
        while time.monotonic() < stall:
            assert local.settler.pending
            time.sleep(0.005)
        writer.note_done()
        deadline = time.monotonic() + 5
        while local.settler.pending and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not local.settler.pending  # the pause after it came: settled by the thread
        assert c.flush(5)


_READER = textwrap.dedent("""
    import json, sys, time
    from sidecar_client import SidecarClient
    address, text = sys.argv[1], sys.stdin.read()
    with SidecarClient(address) as client:
        client.tokenize("qwen3", text="warm up: map the segment, load the encoder")
        print("ready", flush=True)
        t0 = time.monotonic()
        r = client.tokenize("qwen3", text=text, add_special_tokens=False)
        print(json.dumps({"ids": r.token_ids, "source": r.decision.source, "served_by": r.served_by,
                          "seconds": time.monotonic() - t0, "stats": client.stats()}), flush=True)
""")


def _records_here(c: Any, ref: tokenizers.Tokenizer) -> Any:
    """Record one output through ``c`` (a sync client; an async one: returns its awaitable),
    so its process keeps short prompts' writes for their records from then on (see
    KEPT_FOR_RECORD: a process whose outputs are never recorded keeps none)."""
    prompt = "<|im_start|>system\nwarm up<|im_end|>\n" + TURN.format(q="hi")
    output = "Hello."
    out_ids = _generated(ref, output)

    def record(ids: list[int]) -> Any:
        return c.record_output("qwen3", prompt_text=prompt, prompt_token_ids=ids, output_text=output,
                               output_token_ids=out_ids)

    got = c.tokenize("qwen3", text=prompt, add_special_tokens=False)
    if not inspect.isawaitable(got):
        record(got.token_ids)
        assert c.flush(10)
        return None

    async def both() -> None:
        await record((await got).token_ids)
        assert await c.flush(10)
    return both()


def _generated(ref: tokenizers.Tokenizer, text: str) -> list[int]:
    """Ids a model could have generated for ``text``: every multi-character token split in two."""
    enc = ref.encode(text, add_special_tokens=False)
    out: list[int] = []
    for tid, (s, e) in zip(enc.ids, enc.offsets, strict=True):
        piece = text[s:e]
        if len(piece) >= 2:
            out += ref.encode(piece[:1], add_special_tokens=False).ids + ref.encode(piece[1:],
                                                                                   add_special_tokens=False).ids
        else:
            out.append(tid)
    assert ref.decode(out, skip_special_tokens=False) == text and out != enc.ids
    return out


def _chat(question: str, output: str, follow_up: str) -> tuple[str, str]:
    """(prompt, next turn's text) of a terse chat: ``question``, the model's ``output``, ``follow_up``."""
    prompt = "<|im_start|>system\nYou are terse.<|im_end|>\n" + TURN.format(q=question)
    return prompt, prompt + output + "<|im_end|>\n" + TURN.format(q=follow_up)


@pytest.mark.parametrize("marked", [True, False])
def test_a_turn_read_in_another_process_waits_for_a_record_marked_as_on_its_way(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, marked: bool) -> None:
    """The vLLM plugin releases a response whose record the sidecar has not answered in time
    (TOKCACHE_RECORD_WAIT_MS) after marking the record as pending: a reader in another process
    whose text continues that output waits for the record instead of re-encoding the output.
    Unmarked (the control), the same reader serves the re-encoded output at once."""
    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    output = "One,  two,   three.\n\nFour five six 789 — and 10, 11, 12!"
    prompt, follow = _chat("count to twelve, slowly", output, "and back?")
    out_ids = _generated(ref, output)
    with SidecarClient(proc.address) as writer:
        prompt_ids = writer.tokenize("qwen3", text=prompt, add_special_tokens=False).token_ids
        if marked:
            assert writer.mark_pending("qwen3", [(prompt, output, "")], 5.0) == 1
        reader = subprocess.Popen([sys.executable, "-c", _READER, proc.address], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert reader.stdin is not None and reader.stdout is not None
            reader.stdin.write(follow)
            reader.stdin.close()
            assert reader.stdout.readline().strip() == "ready"
            time.sleep(0.5)  # the reader is reading the next turn meanwhile
            writer.record_output("qwen3", prompt_text=prompt, prompt_token_ids=prompt_ids, output_text=output,
                                 output_token_ids=out_ids, finish_reason="length")
            got = json.loads(reader.stdout.readline())
        finally:
            reader.wait(30)
        if marked:
            assert writer.stats()["pending"] == {"marked": 1}
    assert got["served_by"] == "local"
    generated_prefix = prompt_ids + out_ids
    if marked:
        assert got["ids"][:len(generated_prefix)] == generated_prefix and got["source"] == "ar"
        assert got["seconds"] >= 0.4 and got["stats"]["pending"] == {"waited": 1}
    else:
        assert got["ids"][:len(generated_prefix)] != generated_prefix and got["source"] != "ar"
        assert got["seconds"] < 0.4 and got["stats"]["pending"] == {}
    assert got["ids"][:len(prompt_ids)] == prompt_ids


@pytest.mark.parametrize("marked", [True, False])
def test_a_turn_read_over_rpc_waits_in_the_sidecar_for_a_record_marked_as_on_its_way(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, marked: bool) -> None:
    """The same as a read in another process, for a reader that asks the sidecar (a remote client,
    a process that cannot map the segment): the sidecar's Tokenize waits for the marked record,
    which reaches it meanwhile, and splices the generated ids. Unmarked (the control), the sidecar
    answers at once with the output re-encoded."""
    import threading

    proc, port = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    output = "One two three,  four.\n\nFive six 789 — done, nine!"
    prompt, follow = _chat("count to nine, quickly", output, "and back?")
    out_ids = _generated(ref, output)
    got: dict[str, Any] = {}
    with SidecarClient(proc.address) as writer, SidecarClient(proc.address, zero_rpc=False) as reader:
        prompt_ids = writer.tokenize("qwen3", text=prompt, add_special_tokens=False).token_ids
        if marked:
            assert writer.mark_pending("qwen3", [(prompt, output, "")], 5.0) == 1

        def read() -> None:
            t0 = time.monotonic()
            r = reader.tokenize("qwen3", text=follow, add_special_tokens=False)
            got.update(ids=r.token_ids, source=r.decision.source, served_by=r.served_by,
                       seconds=time.monotonic() - t0)

        thread = threading.Thread(target=read)
        thread.start()
        time.sleep(0.5)  # the sidecar is answering the next turn meanwhile
        writer.record_output("qwen3", prompt_text=prompt, prompt_token_ids=prompt_ids, output_text=output,
                             output_token_ids=out_ids, finish_reason="length")
        thread.join(30)
    assert got["served_by"] == "sidecar"
    generated_prefix = prompt_ids + out_ids
    if marked:
        assert got["ids"][:len(generated_prefix)] == generated_prefix and got["source"] == "ar"
        assert 0.4 <= got["seconds"] < 2.0
        assert _metric(port, 'tokcache_pending_waits_total{model="qwen3",outcome="waited"}') == 1
    else:
        assert got["ids"][:len(generated_prefix)] != generated_prefix and got["source"] != "ar"
        assert got["seconds"] < 0.4
        assert _metric(port, 'tokcache_pending_waits_total{model="qwen3",outcome="waited"}') == 0
    assert got["ids"][:len(prompt_ids)] == prompt_ids


@pytest.mark.parametrize("zero_rpc", [True, False], ids=["in-process", "over-rpc"])
def test_a_mark_whose_record_never_comes_holds_a_reader_for_pending_wait_s_at_most(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, zero_rpc: bool) -> None:
    """A record marked as on its way that never reaches the sidecar (its sender died) holds
    the next turn's read for PENDING_WAIT_S, then the read is served without the output's ids,
    counted as given up (the client's stats; the sidecar's span says so)."""
    from tokcache.engine.lookup import PENDING_WAIT_S

    proc, port = sidecar
    output = "Bye, then."
    prompt, follow = _chat("say bye", output, "again?")
    with SidecarClient(proc.address) as writer, SidecarClient(proc.address, zero_rpc=zero_rpc) as reader:
        prompt_ids = writer.tokenize("qwen3", text=prompt, add_special_tokens=False).token_ids
        reader.tokenize("qwen3", text="warm up: map the segment, load the encoder")
        assert writer.mark_pending("qwen3", [(prompt, output, "")], 10.0) == 1
        t0 = time.monotonic()
        r = reader.tokenize("qwen3", text=follow, add_special_tokens=False)
        held = time.monotonic() - t0
        ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
        assert r.token_ids == ref.encode(follow, add_special_tokens=False).ids
        assert r.token_ids[:len(prompt_ids)] == prompt_ids
        assert PENDING_WAIT_S - 0.1 <= held < PENDING_WAIT_S + 1.5
        assert r.served_by == ("local" if zero_rpc else "sidecar")
        if zero_rpc:
            assert reader.stats()["pending"] == {"gave_up": 1}
        else:
            assert _metric(port, 'tokcache_pending_waits_total{model="qwen3",outcome="gave_up"}') == 1


def test_a_withdrawn_or_expired_mark_keeps_no_reader_waiting(sidecar: tuple[SidecarProcess, int],
                                                             qwen3_path: Path) -> None:
    proc, _ = sidecar
    prompt = "<|im_start|>system\nYou are terse.<|im_end|>\n" + TURN.format(q="say hi")
    texts = {name: prompt + f"Hi ({name})!<|im_end|>\n" + TURN.format(q="again") for name in ("withdrawn", "expired")}
    with SidecarClient(proc.address) as writer, SidecarClient(proc.address) as reader:
        writer.tokenize("qwen3", text=prompt, add_special_tokens=False)
        reader.tokenize("qwen3", text="warm up: map the segment, load the encoder")
        assert writer.mark_pending("qwen3", [(prompt, "Hi (withdrawn)!", "")], 30.0) == 1
        assert writer.mark_pending("qwen3", [(prompt, "Hi (withdrawn)!", "")], 0) == 1
        assert writer.mark_pending("qwen3", [(prompt, "Hi (expired)!", "")], 0.5) == 1
        time.sleep(2.1)  # marks expire on whole seconds
        for text in texts.values():
            t0 = time.monotonic()
            r = reader.tokenize("qwen3", text=text, add_special_tokens=False)
            assert time.monotonic() - t0 < 0.5 and r.served_by == "local"
        assert "pending" not in reader.stats() or reader.stats()["pending"] == {}
        assert writer.stats()["pending"] == {"marked": 2, "withdrawn": 1}


@pytest.mark.parametrize("wait_s", [0.3, 0.0], ids=["wait-ran-out", "no-wait"])
def test_the_plugin_marks_a_record_its_response_could_not_wait_for_and_another_api_server_waits_for_it(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, wait_s: float) -> None:
    """Two API server processes' plugin runtimes on one node (two runtimes here, each with its
    own client and mapping). The sidecar hangs (SIGSTOP) while runtime A's response waits for its
    record: after TOKCACHE_RECORD_WAIT_MS (or at once, when it is 0) the response goes, the record
    marked as on its way. The next turn reaches runtime B, which waits (the sidecar resumes 0.6 s
    later) and splices the generated ids rather than re-encoding the output; A withdraws the mark
    once answered."""
    import asyncio
    import signal

    from sidecar_client.vllm._config import PluginConfig
    from sidecar_client.vllm._runtime import PluginRuntime
    from tests.vllm.test_runtime import Out
    from tokcache.engine.tokenizer import fingerprint_of

    proc, _ = sidecar
    assert proc.proc is not None
    tj = qwen3_path / "tokenizer.json"
    ref = tokenizers.Tokenizer.from_file(str(tj))
    output = "One,  two,   three.\n\nFour five six 789 — and 10, 11, 12!"
    prompt, follow = _chat("count to twelve, slowly", output, "and back?")
    out_ids = _generated(ref, output)

    def runtime() -> PluginRuntime:
        config = PluginConfig(address=proc.address, timeout_s=2.0, record_wait_s=wait_s)
        return PluginRuntime(config, fingerprint_of(tj), tokenizer_file=tj,
                             decode=lambda ids: ref.decode(ids, skip_special_tokens=False))

    async def main() -> None:
        a, b = runtime(), runtime()
        for rt in (a, b):  # handshake, map the segment, load the encoder
            await rt.tokenize("warm up", add_special_tokens=False, cache_salt=None)
            if rt.link._opening is not None:
                await rt.link._opening
        local_reads = a.stats.served["local"]
        ids = await a.tokenize(prompt, add_special_tokens=False, cache_salt=None)
        assert ids is not None and a.stats.served["local"] == local_reads + 1
        rec = a.start_request({"type": "token", "prompt": prompt, "prompt_token_ids": ids}, delta=False,
                              trace_headers=None)
        assert rec is not None
        os.kill(proc.proc.pid, signal.SIGSTOP)
        try:
            waits = rec.feed([Out(0, output, out_ids, "length")])
            t0 = time.monotonic()
            await a.wait_records(waits)  # the response would go now
            held = time.monotonic() - t0
            if wait_s:
                assert 0.25 < held < 1.0 and a.stats.response_wait_timeouts == 1
            else:  # not held at all, nor counted as a wait
                assert held < 0.2 and a.stats.response_wait_timeouts == 0
            assert a.stats.pending["marked"] == 1
            asyncio.get_running_loop().call_later(0.6, os.kill, proc.proc.pid, signal.SIGCONT)
            t1 = time.monotonic()
            got = await b.tokenize(follow, add_special_tokens=False, cache_salt=None)
            waited = time.monotonic() - t1
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
        assert got is not None and got[:len(ids) + len(out_ids)] == ids + out_ids
        assert waited > 0.5 and b.stats.pending["waited"] == 1 and b.stats.tokenize["ar"] == 1
        for _ in range(100):  # A's record was answered: its mark is withdrawn
            if a.stats.pending["withdrawn"]:
                break
            await asyncio.sleep(0.05)
        assert a.stats.pending["withdrawn"] == 1 and a.stats.records["recorded"] == 1
        await a.recorder.aclose()
        await a.link.close()
        await b.link.close()

    asyncio.run(main())


@pytest.mark.parametrize("api", ["sync", "async"])
@pytest.mark.parametrize("batch", [False, True], ids=["record_output", "record_outputs"])
def test_a_recorded_prompt_is_stored_by_its_reader_and_its_next_turn_takes_the_native_path(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch, batch: bool,
        api: str) -> None:
    """A turn's write skipped for its size (min_write_bytes) is kept until its output is recorded:
    the RecordOutput chains to the prompt's entries, so the reader stores them then, in the
    recording thread (counted as ``for_record``), rather than the sidecar tokenizing the prompt
    again; the reader then holds the chain its next turn hits, and that turn is served by the
    native path (``extend``) with the recorded output's ids (a prefix AR hit), every turn
    extending prompt + output exactly. The record's own chain is read into the memo, and copied
    into a head, by the write-behind once the sidecar stored it (``records_held``), so the next
    turn reads nothing from the segment but index slots and copies only its tail. The same with
    the async client (vLLM's plugin records through it)."""
    import asyncio
    import inspect

    from tokcache.engine import lookup as lookup_mod
    from tokcache.store._log import Log

    if lookup_mod._native is None:
        pytest.skip("the native extension is not built")
    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    native = lookup_mod._native
    served_ar = []

    class Counting:
        def extend(self, *args: Any) -> Any:
            got = native.extend(*args)
            served_ar.append(isinstance(got, tuple) and got[-1] >= 0)  # (declined: an int)
            return got

        def __getattr__(self, name: str) -> Any:
            return getattr(native, name)

    monkeypatch.setattr(lookup_mod, "_native", Counting())
    walk, walks = Log.walk_known, [0]

    def counting_walk(self: Log, *args: Any) -> Any:
        walks[0] += 1
        return walk(self, *args)

    monkeypatch.setattr(Log, "walk_known", counting_walk)

    async def done(value: Any) -> Any:
        return await value if inspect.isawaitable(value) else value

    async def main() -> tuple[list[str], dict[str, int], int]:
        c: Any = SidecarClient(proc.address) if api == "sync" else AsyncSidecarClient(proc.address)
        try:
            await done(_records_here(c, ref))
            before = dict(c.stats()["writes"])  # (the warm-up's record counted apart)
            text = "<|im_start|>system\nYou are terse.<|im_end|>\n" + TURN.format(q="count, slowly")
            prev: list[int] = []
            sources = []
            for k in range(6):
                walks[0] = 0
                r = await done(c.tokenize("qwen3", text=text, add_special_tokens=False))
                if k >= 2:
                    assert walks[0] == 0, k  # every chain it needs is held: no record read in the request
                assert r.served_by == "local"
                assert r.token_ids[:len(prev)] == prev, k  # this turn extends the last prompt + its output
                sources.append(r.decision.source)
                output = f"{k}, {k + 1},  {k + 2}.\n\nAnd — {k * 11} more!"
                out_ids = _generated(ref, output) + ref.encode("<|im_end|>", add_special_tokens=False).ids
                record = {"prompt_text": text, "prompt_token_ids": r.token_ids, "output_text": output,
                          "output_token_ids": out_ids}
                if batch:
                    assert (await done(c.record_outputs("qwen3", [record]))).recorded == 1
                else:
                    assert (await done(c.record_output("qwen3", **record))).recorded_tokens > 0
                prev = r.token_ids + out_ids
                # The gap before the next turn, in which the write-behind builds the head.
                assert await done(c.flush(10))
                heads = (c._local if api == "sync" else c.local).get("qwen3").lookup.heads
                deadline = time.monotonic() + 10
                while heads.pending and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                text += output + "<|im_end|>\n" + TURN.format(q=f"and then {k}?")
            paths = c._local if api == "sync" else c.local
            local = paths.get("qwen3") if paths is not None else None
            assert local is not None
            writes = c.stats()["writes"]
            return sources, {k: v - before.get(k, 0) for k, v in writes.items()}, local.lookup.heads.used
        finally:
            await done(c.close())

    sources, writes, heads_used = asyncio.run(main())
    assert sources[1:] == ["ar"] * 5, sources
    # Every prompt was short (skipped), and stored for its record by this process.
    assert writes.get("for_record") == 6 and writes.get("stored", 0) >= 6, writes
    # Each record's chain was offered for the write-behind to read once it was stored.
    assert writes.get("records_held") == 6, writes
    assert heads_used >= 4  # the reply lists were built between turns
    assert sum(served_ar) >= 4, served_ar  # the native path served the turns after the first ones


def test_a_kept_write_is_stored_for_its_own_text_only(sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """Kept writes are filed under their text's length and last characters, not the whole
    text (hashing it cost every request ~20 us at 57 KB): two prompts that share both replace
    each other, and a record stores a kept write only for the very text it was made for. The
    prompt whose write was replaced is stored by the sidecar instead; both next turns extend
    prompt + output exactly."""
    from sidecar_client._local import KEPT_KEY_CHARS

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    tail = TURN.format(q="what comes next? " * (KEPT_KEY_CHARS // 16))
    a = "<|im_start|>system\nYou are terse.<|im_end|>\n" + tail
    b = "<|im_start|>system\nYou are brief.<|im_end|>\n" + tail  # same length, same last characters
    assert len(a) == len(b) and a[-KEPT_KEY_CHARS:] == b[-KEPT_KEY_CHARS:] and a != b
    with SidecarClient(proc.address) as c:
        _records_here(c, ref)
        ids = {t: c.tokenize("qwen3", text=t, add_special_tokens=False).token_ids for t in (a, b)}
        assert c.flush(10)
        for t in (a, b):
            assert ids[t] == ref.encode(t, add_special_tokens=False).ids
        before = c.stats()["writes"].get("for_record", 0)
        output = "Then 1, 2,  3.\n\nDone!"
        out_ids = _generated(ref, output) + ref.encode("<|im_end|>", add_special_tokens=False).ids
        for t in (a, b):
            assert c.record_output("qwen3", prompt_text=t, prompt_token_ids=ids[t], output_text=output,
                                   output_token_ids=out_ids).recorded_tokens > 0
        # a's kept write was replaced by b's (one key): only b's was stored by this process
        assert c.stats()["writes"].get("for_record", 0) - before == 1
        assert c.flush(10)
        for t in (a, b):
            nxt = t + output + "<|im_end|>\n" + TURN.format(q="and then?")
            r = c.tokenize("qwen3", text=nxt, add_special_tokens=False)
            assert r.token_ids[:len(ids[t]) + len(out_ids)] == ids[t] + out_ids
            assert r.decision.source == "ar"
