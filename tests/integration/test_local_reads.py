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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from sidecar_client import AsyncSidecarClient, InvalidArgumentError, SidecarClient
from sidecar_client._local import MIN_FIRST_WRITE_BYTES, MIN_WRITE_BYTES, LocalModel
from tests.integration.sidecar_proc import SidecarProcess
from tokcache.store.keys import l0_key

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
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight turns read in this process: no Tokenize RPC, the reference's ids, each turn found the
    one before (the native path served it). A process that records no outputs stores each
    read's entries in the request, in the caller's thread (min_write_bytes=0: these turns are
    short): the sidecar then finds every text whole, with the ids this process served, and
    no flush is needed. The caller's list is its own: changing it changes nothing kept."""
    from sidecar_client import _local

    proc, port = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = _conversation(8)
    stored_by: list[str] = []
    real_commit = _local.commit

    def commit(*args: Any, **kwargs: Any) -> Any:
        stored_by.append(threading.current_thread().name)
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(_local, "commit", commit)
    with SidecarClient(proc.address, min_write_bytes=0) as local, SidecarClient(proc.address, zero_rpc=False) as rpc:
        local.tokenize("qwen3", text="warm up")  # one ListModels, then the segment is mapped
        before = _tokenize_rpcs(port)
        results, served = [], []
        for text in texts:
            r = local.tokenize("qwen3", text=text, add_special_tokens=False)
            assert r.served_by == "local"
            assert r.token_ids == ref.encode(text, add_special_tokens=False).ids
            results.append(r)
            served.append(list(r.token_ids))
            r.token_ids[:] = [-1]  # the caller's own list
        assert _tokenize_rpcs(port) == before  # not one RPC for eight requests
        assert [r.decision.source for r in results[1:]] == ["l1"] * 7  # each turn found the one before
        assert stored_by == [threading.current_thread().name] * 9  # the warm-up and each turn, in the request
        for text, ids in zip(texts, served, strict=True):
            again = rpc.tokenize("qwen3", text=text, add_special_tokens=False)
            assert again.served_by == "sidecar" and again.token_ids == ids and again.decision.source == "l0"
        stats = local.stats()
        assert stats["tokenize"] == {"miss": 2, "l1": 7}
        assert stats["writes"] == {"stored": 9}
        # Every turn after the first extended the one before: the native fast path served it.
        assert stats["paths"] == {"python": 2, "native": 7}
        # The warm-up (a text without boundaries) and the first turn (nothing cached where the
        # native path probes) were read by the Python path.
        assert stats["declines"] == {"unstable": 1, "no_window_hit": 1}


def test_a_recording_process_leaves_its_reads_to_their_records_and_flush_stores_the_rest(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """Once a process has recorded an output, its kv-stable reads store nothing themselves
    (``deferred``): a record stores its prompt's entries with the output, in one chain. Prompts
    whose records never come (aborted requests) are stored by ``flush``, as the reads' own
    writes would have been; the sidecar then finds them whole with the ids served here. An
    exact-mode read (no record can follow it) stores its entries in the request."""
    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = [t.replace("You are terse.", "You are careful.") for t in _conversation(3)]
    with SidecarClient(proc.address, min_write_bytes=0) as c, SidecarClient(proc.address, zero_rpc=False) as rpc:
        _records_here(c, ref)
        local = c._local.get("qwen3") if c._local is not None else None
        assert local is not None
        before = dict(c.stats()["writes"])

        def writes() -> dict[str, int]:
            return _delta(before, c.stats()["writes"])

        served = {t: c.tokenize("qwen3", text=t, add_special_tokens=False).token_ids for t in texts}
        assert writes() == {"deferred": 3}
        assert not any(local.reader.probe(l0_key(t)) for t in texts)  # left to their records
        exact = "<|im_start|>user\nexact, please<|im_end|>\n"
        c.tokenize("qwen3", text=exact, add_special_tokens=False, mode="exact")
        assert writes() == {"deferred": 3, "stored": 1} and local.reader.probe(l0_key(exact, mode="exact"))
        assert c.flush()
        assert writes() == {"deferred": 3, "stored": 4}
        for t in texts:
            assert local.reader.probe(l0_key(t))
            again = rpc.tokenize("qwen3", text=t, add_special_tokens=False)
            assert again.decision.source == "l0" and again.token_ids == served[t]
            assert served[t] == ref.encode(t, add_special_tokens=False).ids


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
    """A client that may read the segment but not write it: reads in-process, learns via RPC,
    and records over RPC (the sidecar stores the output; the client's next turn, read in its
    own process, extends prompt + output).

    The segment is handed to another owner with mode 0644 and the client runs without the
    capabilities that let root ignore file modes (``setpriv``), so opening it for writing
    fails as it would for a container running as another user.
    """
    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    output = "Fine,  thanks.\n\nDone."
    gen = _generated(ref, output) + ref.encode("<|im_end|>", add_special_tokens=False).ids
    follow = output + "<|im_end|>\n" + TURN.format(q="and?")
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
            results = [c.tokenize("qwen3", text=t, add_special_tokens=False) for t in texts]
            c.flush(10)
            stats = c.stats()
            rec = c.record_output("qwen3", prompt_text=texts[-1], prompt_token_ids=results[-1].token_ids,
                                  output_text={output!r}, output_token_ids={gen!r})
            nxt = c.tokenize("qwen3", text=texts[-1] + {follow!r},
                             add_special_tokens=False)
            print(json.dumps({{"served": [r.served_by for r in results], "stats": stats, "entries": rec.entries,
                              "records": c.stats()["records"], "prompt": results[-1].token_ids,
                              "next": [nxt.served_by, nxt.decision.source, nxt.token_ids]}}))
    """))
    cmd = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--", sys.executable, str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["served"] == ["local"] * 4
    assert got["stats"]["writes"].get("learned") == 4 and "stored" not in got["stats"]["writes"]
    # The record went to the sidecar (stored there, not in the client's process).
    assert got["entries"] > 0 and "recorded" not in got["records"]
    served_by, source, ids = got["next"]
    assert (served_by, source) == ("local", "ar") and ids[:len(got["prompt"]) + len(gen)] == got["prompt"] + gen
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
        # Why: neither Python-path read had a cached cut where the native path probes
        # (tokcache_vllm_native_declines).
        assert link.stats.declines == {"no_window_hit": 2}
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


def _agent_turns(turns: int, size: int) -> list[str]:
    """A conversation whose turns each append ~``size`` bytes (an answer and a tool result)."""
    text, out = "<|im_start|>system\nYou are an agent.<|im_end|>\n", []
    for k in range(turns):
        body = " ".join(f"line {k}.{i}: {'x' * (i % 13)} 你好" for i in range(size // 28))
        text += f"<|im_start|>user\ntool result {k}:\n{body}<|im_end|>\n<|im_start|>assistant\n"
        out.append(text)
        text += f"step {k} done.<|im_end|>\n"
    return out


def test_a_busy_writer_lock_costs_a_read_its_entries_never_its_time(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """A read stores its entries under the segment's writer lock, waiting READ_LOCK_S for it at
    most: while another holder keeps it (a process waiting for a core, on a busy node), the read
    is served at once with the reference's ids and its entries are left unstored (``busy``);
    the next read stores its own, which hold them. (The lock is held by this process's main
    thread, which the semaphore blocks like any other; a timer lets it go after 5 s, so a
    regression fails, never hangs.)"""
    from sidecar_client._local import READ_LOCK_S

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = _agent_turns(2, 900)
    with SidecarClient(proc.address, min_write_bytes=0) as c:
        local = _opened(c)
        store = local._writable
        assert store is not None
        with _writer_lock_held(store):
            t0 = time.monotonic()
            first = c.tokenize("qwen3", text=texts[0], add_special_tokens=False)
            took = time.monotonic() - t0
        assert took < READ_LOCK_S + 0.5, took
        assert first.token_ids == ref.encode(texts[0], add_special_tokens=False).ids
        assert c.stats()["writes"].get("busy") == 1 and not local.reader.probe(l0_key(texts[0]))
        second = c.tokenize("qwen3", text=texts[1], add_special_tokens=False)
        assert second.token_ids == ref.encode(texts[1], add_special_tokens=False).ids
        assert local.reader.probe(l0_key(texts[1]))
        with SidecarClient(proc.address, zero_rpc=False) as rpc:  # the first turn's ids, by prefix
            again = rpc.tokenize("qwen3", text=texts[0], add_special_tokens=False)
            assert again.token_ids == first.token_ids and again.decision.cached_chars >= len(texts[0]) - 2048


def test_a_record_whose_writer_lock_stays_busy_gives_up_within_record_lock_s(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """A record waits RECORD_LOCK_S for the writer lock (vLLM's response waits for the record):
    while another holder keeps it longer, the record stores nothing and reports no entries,
    failing no request, and returns within about RECORD_LOCK_S. Once the lock is free the same
    record is stored, and the next turn extends prompt + output."""
    from sidecar_client._local import RECORD_LOCK_S

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    output = "<think>\nLet me see: one, two.\n</think>\n\nOne, two,  three.\n\nDone — 42!"
    prompt, follow = _chat("count, with reasons", output, "more")
    gen = _generated(ref, output) + ref.encode("<|im_end|>", add_special_tokens=False).ids
    with SidecarClient(proc.address) as c:
        _records_here(c, ref)
        local = _opened(c)
        r = c.tokenize("qwen3", text=prompt, add_special_tokens=False)
        record = {"prompt_text": prompt, "prompt_token_ids": r.token_ids, "output_text": output,
                  "output_token_ids": gen}
        with _writer_lock_held(local._writable, timeout=15):
            t0 = time.monotonic()
            busy = c.record_output("qwen3", **record)
            took = time.monotonic() - t0
        assert (busy.entries, busy.recorded_tokens) == (0, 0)
        stored = c.record_output("qwen3", **record)
        assert stored.entries > 0 and stored.recorded_tokens == len(gen) - 1
        nxt = c.tokenize("qwen3", text=follow, add_special_tokens=False)
        assert nxt.decision.source == "ar" and nxt.token_ids[:len(r.token_ids) + len(gen)] == r.token_ids + gen
    assert took < RECORD_LOCK_S + 0.5, took


def test_a_read_whose_record_does_not_come_is_stored_without_it(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a process that records its outputs, a read's entries wait for the record of its
    output. A read whose record is refused stores them at once; one whose record never comes
    (a /tokenize request) is stored by this process's next read once RECORD_DEFER_S passed."""
    from sidecar_client import _local

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    filler = " ".join(f"entry{i}" for i in range(1500))
    refused, alone = (f"<|im_start|>user\n{name} {filler}<|im_end|>\n<|im_start|>assistant\n"
                      for name in ("refused", "alone"))
    with SidecarClient(proc.address) as c:
        _records_here(c, ref)
        local = _opened(c)
        got = c.tokenize("qwen3", text=refused, add_special_tokens=False)
        assert not local.reader.probe(l0_key(refused))  # left to its record
        with pytest.raises(InvalidArgumentError) as err:
            c.record_output("qwen3", prompt_text=refused, prompt_token_ids=got.token_ids, output_text="Hello.",
                            output_token_ids=ref.encode("Goodbye.", add_special_tokens=False).ids)
        assert err.value.field == "output_token_ids"
        assert local.reader.probe(l0_key(refused))

        c.tokenize("qwen3", text=alone, add_special_tokens=False)
        c.tokenize("qwen3", text="a short read", add_special_tokens=False)
        assert not local.reader.probe(l0_key(alone))  # its record may still come
        monkeypatch.setattr(_local, "RECORD_DEFER_S", 0.0)
        c.tokenize("qwen3", text="another short read", add_special_tokens=False)
        assert local.reader.probe(l0_key(alone))
        stats = c.stats()["writes"]
        assert stats["deferred"] >= 2 and stats["stored"] >= 2, stats


@contextlib.contextmanager
def _writer_lock_held(store: Any, timeout: float = 5.0) -> Iterator[None]:
    """``store``'s writer lock, taken by this thread until the block ends (or ``timeout``)."""
    held = threading.Lock()  # taken by whoever releases the writer lock: the block or the timer

    def release() -> None:
        if held.acquire(blocking=False):
            store._lock.release()

    store._lock.acquire()
    timer = threading.Timer(timeout, release)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        release()


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


def test_a_first_read_stores_from_1_kb_later_ones_from_min_write_bytes(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """MIN_FIRST_WRITE_BYTES: with the default min_write_bytes (4 KB), a conversation's first
    read (nothing cached, >= 1 KB) is stored, so its next turns hit it (L1); their own short
    tails are not stored until they reach min_write_bytes. Ids are the reference's throughout."""
    proc, _ = sidecar
    assert MIN_FIRST_WRITE_BYTES < MIN_WRITE_BYTES
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    texts = _agent_turns(10, 1200)  # ~1.1 KB a turn
    assert len(texts[0].encode()) >= MIN_FIRST_WRITE_BYTES
    assert 2 * (len(texts[1].encode()) - len(texts[0].encode())) < MIN_WRITE_BYTES
    with SidecarClient(proc.address) as c:
        c.tokenize("qwen3", text="warm up")
        stored: list[int] = []
        sources: list[str] = []
        for text in texts:
            before = c.stats()["writes"].get("stored", 0)
            r = c.tokenize("qwen3", text=text, add_special_tokens=False)
            assert r.token_ids == ref.encode(text, add_special_tokens=False).ids
            stored.append(c.stats()["writes"].get("stored", 0) - before)
            sources.append(r.decision.source)
    assert stored[0] == 1 and sources[0] == "miss", (stored, sources)
    assert sources[1:] == ["l1"] * (len(texts) - 1), sources
    # Later reads store only once their uncached tail reaches min_write_bytes (4 KB here: a
    # few turns of ~1.1 KB), not every turn.
    assert 1 <= sum(stored[1:]) < len(texts) - 2, stored


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
    so its process leaves its kv-stable reads' entries to their records from then on (a
    process whose outputs are never recorded stores its reads' entries itself)."""
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


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counts that moved from ``before`` to ``after`` (a stats() section), by how much."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


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
            recorded = writer.record_output("qwen3", prompt_text=prompt, prompt_token_ids=prompt_ids,
                                            output_text=output, output_token_ids=out_ids, finish_reason="length")
            assert recorded.entries > 0  # (none: the writer lock stayed busy for RECORD_LOCK_S)
            got = json.loads(reader.stdout.readline())
        finally:
            reader.wait(30)
        if marked:
            assert writer.stats()["pending"] == {"marked": 1}
    assert got["served_by"] == "local"
    generated_prefix = prompt_ids + out_ids
    if marked:
        assert got["ids"][:len(generated_prefix)] == generated_prefix and got["source"] == "ar", (
            got["source"], got["seconds"], got["stats"])
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


def test_the_plugin_records_in_its_process_and_another_api_server_extends_it_with_the_sidecar_stopped(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """Two API server processes' plugin runtimes on one node (two runtimes here, each with its
    own client and mapping). Runtime A records its response's output in its own process: with
    the sidecar hung (SIGSTOP) the response waits for nothing (no wait counted, nothing marked
    as pending), and the next turn, read by runtime B, splices the generated ids at once,
    without the sidecar."""
    import asyncio
    import signal

    from sidecar_client.vllm._config import PluginConfig
    from sidecar_client.vllm._runtime import PluginRuntime
    from tests.vllm.test_runtime import Out
    from tokcache.engine.tokenizer import fingerprint_of

    proc, _ = sidecar
    assert proc.proc is not None
    pid = proc.proc.pid
    tj = qwen3_path / "tokenizer.json"
    ref = tokenizers.Tokenizer.from_file(str(tj))
    output = "One,  two,   three.\n\nFour five six 789 — and 10, 11, 12!"
    prompt, follow = _chat("count to twelve, slowly", output, "and back?")
    out_ids = _generated(ref, output)

    def runtime() -> PluginRuntime:
        config = PluginConfig(address=proc.address, timeout_s=2.0, record_wait_s=0.3)
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
        os.kill(pid, signal.SIGSTOP)
        try:
            waits = rec.feed([Out(0, output, out_ids, "length")])
            t0 = time.monotonic()
            await a.wait_records(waits)  # the response would go now
            for _ in range(100):  # the record, on A's recorder task, in A's process
                if a.stats.records["recorded"]:
                    break
                await asyncio.sleep(0.01)
            held = time.monotonic() - t0
            t1 = time.monotonic()
            got = await b.tokenize(follow, add_special_tokens=False, cache_salt=None)
            waited = time.monotonic() - t1
        finally:
            os.kill(pid, signal.SIGCONT)
        assert a.stats.records["recorded"] == 1 and held < 0.25, held
        assert a.stats.response_wait_timeouts == 0 and not any(a.stats.pending.values())
        assert got is not None and got[:len(ids) + len(out_ids)] == ids + out_ids
        assert waited < 0.25 and b.stats.tokenize["ar"] == 1 and not any(b.stats.pending.values())
        await a.recorder.aclose()
        await a.link.close()
        await b.link.close()

    asyncio.run(main())


@pytest.mark.parametrize(("api", "batch"), [("sync", False), ("async", True)],
                         ids=["sync-record_output", "async-record_outputs"])
def test_a_recorded_prompt_is_stored_with_its_output_and_its_next_turn_takes_the_native_path(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch, batch: bool,
        api: str) -> None:
    """In a process that records its outputs, each read leaves its entries to the record of its
    output (``deferred``), which stores them with the output, in this process (``for_record``);
    the record's chain is remembered here, so the next turn reads no record from the segment
    (only index slots), is served by the native path (``extend``) with the recorded output's
    ids (a prefix AR hit), and extends prompt + output exactly. The same with the async client
    (vLLM's plugin records through it), one record at a time or as a batch."""
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

    async def main() -> tuple[list[str], dict[str, int], dict[str, int]]:
        c: Any = SidecarClient(proc.address) if api == "sync" else AsyncSidecarClient(proc.address)
        try:
            await done(_records_here(c, ref))
            before = {k: dict(v) for k, v in c.stats().items()}  # (the warm-up's record counted apart)
            text = "<|im_start|>system\nYou are terse.<|im_end|>\n" + TURN.format(q="count, slowly")
            prev: list[int] = []
            sources = []
            for k in range(6):
                walks[0] = 0
                r = await done(c.tokenize("qwen3", text=text, add_special_tokens=False))
                if k >= 1:
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
                text += output + "<|im_end|>\n" + TURN.format(q=f"and then {k}?")
            stats = c.stats()
            return sources, _delta(before["writes"], stats["writes"]), _delta(before["records"], stats["records"])
        finally:
            await done(c.close())

    sources, writes, records = asyncio.run(main())
    assert sources[1:] == ["ar"] * 5, sources
    # Every prompt's entries were left to its record, which stored them with the output.
    assert writes == {"deferred": 6, "for_record": 6}, writes
    assert records == {"recorded": 6}, records
    assert sum(served_ar) >= 4, served_ar  # the native path served the turns after the first ones


def test_a_served_prompt_is_taken_by_the_record_of_its_own_text_only(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """Served prompts are filed under their text's length and last characters, not the whole
    text (hashing it cost every request ~20 us at 57 KB): two prompts that share both replace
    each other, and a record takes a served prompt only for the very text it was served for.
    The record of the prompt that was replaced finds its ids by a lookup instead; both next
    turns extend prompt + output exactly."""
    from sidecar_client._local import SERVED_KEY_CHARS

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    tail = TURN.format(q="what comes next? " * (SERVED_KEY_CHARS // 16))
    a = "<|im_start|>system\nYou are terse.<|im_end|>\n" + tail
    b = "<|im_start|>system\nYou are brief.<|im_end|>\n" + tail  # same length, same last characters
    assert len(a) == len(b) and a[-SERVED_KEY_CHARS:] == b[-SERVED_KEY_CHARS:] and a != b
    with SidecarClient(proc.address) as c:
        _records_here(c, ref)
        ids = {t: c.tokenize("qwen3", text=t, add_special_tokens=False).token_ids for t in (a, b)}
        for t in (a, b):
            assert ids[t] == ref.encode(t, add_special_tokens=False).ids
        before = c.stats()["writes"].get("for_record", 0)
        output = "Then 1, 2,  3.\n\nDone!"
        out_ids = _generated(ref, output) + ref.encode("<|im_end|>", add_special_tokens=False).ids
        for t in (a, b):
            assert c.record_output("qwen3", prompt_text=t, prompt_token_ids=ids[t], output_text=output,
                                   output_token_ids=out_ids).recorded_tokens > 0
        # a's served prompt was replaced by b's (one key): only b's record took its read's entries
        assert c.stats()["writes"].get("for_record", 0) - before == 1
        for t in (a, b):
            nxt = t + output + "<|im_end|>\n" + TURN.format(q="and then?")
            r = c.tokenize("qwen3", text=nxt, add_special_tokens=False)
            assert r.token_ids[:len(ids[t]) + len(out_ids)] == ids[t] + out_ids
            assert r.decision.source == "ar"


def test_prompts_whose_records_never_come_are_stored_as_they_leave_the_bounded_table(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording process keeps what each read served for the record of its output in a
    bounded table (SERVED_MAX per model, 4 here). A prompt that leaves it with its entries
    unstored (its record never came: an aborted request) is stored then, as the read's own
    write would have been: memory stays bounded, nothing is lost, and the sidecar finds every
    prompt whole with the ids this process served."""
    from sidecar_client import _local

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    monkeypatch.setattr(_local, "SERVED_MAX", 4)
    texts = [f"<|im_start|>system\nAgent {k}.<|im_end|>\n" + TURN.format(q=f"task {k}: " + "step " * k)
             for k in range(12)]
    with SidecarClient(proc.address, min_write_bytes=0) as c, SidecarClient(proc.address, zero_rpc=False) as rpc:
        _records_here(c, ref)  # (its prompt, stored with its record, is the oldest in the table)
        local = c._local.get("qwen3") if c._local is not None else None
        assert local is not None
        before = c.stats()["writes"]
        served = {}
        for t in texts:
            served[t] = c.tokenize("qwen3", text=t, add_special_tokens=False).token_ids
            assert len(local._served) <= 4
        writes = _delta(before, c.stats()["writes"])
        assert writes == {"deferred": 12, "stored": 8}, writes
        assert [local.reader.probe(l0_key(t)) for t in texts] == [True] * 8 + [False] * 4
        assert c.flush()
        for t in texts:
            again = rpc.tokenize("qwen3", text=t, add_special_tokens=False)
            assert again.decision.source == "l0" and again.token_ids == served[t]
            assert served[t] == ref.encode(t, add_special_tokens=False).ids


def test_poisoned_records_through_the_local_writer_are_refused_by_field_and_store_nothing(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """This process's writer verifies a record as RecordOutput does: output ids that do not
    spell the output text or hold an id outside the vocabulary, a finish by a stop string,
    prompt ids that are not the ones served for the prompt text (another id, one id short, an
    id outside the vocabulary, the served list itself changed by the caller after tokenize)
    are refused here (``code`` None: no RPC) with InvalidArgumentError naming the field. The
    segment gets no record, and the next turn's ids are the canonical encoding: nothing
    recorded applies. ``record_outputs`` lists each refusal with the same field."""
    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    output = "Sure:\n\n  one,  two, three."
    im_end = ref.encode("<|im_end|>", add_special_tokens=False).ids
    gen = _generated(ref, output) + im_end
    outside = 200_000  # no Qwen3 id

    def change(ids: list[int], at: int) -> None:
        ids[at] = ids[at] + 1 if ids[at] + 1 < 150_000 else 13

    cases: list[tuple[str, Callable[[dict[str, Any], list[int]], None], str]] = [
        ("other_text", lambda rec, ids: rec.update(output_token_ids=ref.encode("Not that.").ids),
         "output_token_ids"),
        ("output_outside_vocab", lambda rec, ids: rec.update(output_token_ids=gen[:-1] + [outside]),
         "output_token_ids"),
        ("stop_string", lambda rec, ids: rec.update(stop_reason="STOP"), "stop_reason"),
        ("prompt_changed", lambda rec, ids: rec.update(prompt_token_ids=ids[:3] + [ids[3] + 1] + ids[4:]),
         "prompt_token_ids"),
        ("prompt_cut_short", lambda rec, ids: rec.update(prompt_token_ids=ids[:-1]), "prompt_token_ids"),
        ("prompt_outside_vocab", lambda rec, ids: rec.update(prompt_token_ids=[*ids, outside]), "prompt_token_ids"),
        ("served_list_changed", lambda rec, ids: change(ids, len(ids) // 2), "prompt_token_ids"),
    ]
    with SidecarClient(proc.address) as c:
        _records_here(c, ref)
        local = c._local.get("qwen3") if c._local is not None else None
        assert local is not None and local._writable is not None
        refused = c.stats()["records"].get("refused", 0)
        batch = []
        for name, poison, field in cases:
            prompt, follow = _chat(f"poison {name}", output, "more?")
            r = c.tokenize("qwen3", text=prompt, add_special_tokens=False)
            assert r.served_by == "local"
            record: dict[str, Any] = {"prompt_text": prompt, "prompt_token_ids": r.token_ids, "output_text": output,
                                      "output_token_ids": gen}
            poison(record, r.token_ids)  # (the last case changes the list tokenize returned)
            batch.append(dict(record))
            puts = local._writable.stats().puts
            with pytest.raises(InvalidArgumentError) as exc:
                c.record_output("qwen3", **record)
            assert (exc.value.field, exc.value.code) == (field, None), (name, str(exc.value))
            assert local._writable.stats().puts == puts, name  # nothing stored
            nxt = c.tokenize("qwen3", text=follow, add_special_tokens=False)
            assert nxt.decision.source != "ar", name
            assert nxt.token_ids == ref.encode(follow, add_special_tokens=False).ids, name
        assert c.stats()["records"]["refused"] - refused == len(cases)
        summary = c.record_outputs("qwen3", batch)
        assert (summary.recorded, summary.refused) == (0, len(cases))
        assert [reason.split(":")[0] for _, reason in summary.refusals] == [field for _, _, field in cases]


def _records_since(store: Any, lsn: int) -> list[tuple[int, list[bytes]]]:
    """(flags, keys) of each record of ``store``'s log from LSN ``lsn`` to its head."""
    from tokcache.store._layout import ENTRY, ENTRY_SIZE, MAGIC_SIZE, PAD_MAGIC, RECORD, RECORD_MAGIC_OFF, RECORD_SIZE

    log = store._log
    out: list[tuple[int, list[bytes]]] = []
    at, head = lsn, store.head()
    while at < head:
        pos = at % log.size
        if log.size - pos < RECORD_SIZE:  # padded to the arena's end
            at += log.size - pos
            continue
        magic, size = MAGIC_SIZE.unpack(log._read(log._off + pos + RECORD_MAGIC_OFF, MAGIC_SIZE.size))
        if magic != PAD_MAGIC:
            rec = log._read(log._off + pos, size)
            fields = RECORD.unpack_from(rec)
            out.append((fields[11], [ENTRY.unpack_from(rec, RECORD_SIZE + ENTRY_SIZE * e)[0]
                                     for e in range(fields[9])]))
        at += size
    return out


def test_a_record_stores_its_prompt_and_output_as_one_chain_another_process_extends(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """One chain: in a process that records, a turn's read stores nothing; the record of its
    output appends ONE record holding the prompt's new entries and the output (keyed at the
    prompt's cuts, its whole text, and prompt + output), besides the output's own segment
    records (F_SEGMENT, keyed on the output's text): the prompt is written once. A read of
    the next turn in another client process gets ids that extend prompt ids + output ids."""
    from tokcache.store import F_SEGMENT
    from tokcache.store.keys import MODE_KV_STABLE, output_key, segment_key

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    output = "Here it is:\n\n    first, second,  third.\n\nDone."
    question = "list the steps, " + "one by one, " * 60
    prompt, follow = _chat(question, output, "thanks")
    gen = _generated(ref, output) + ref.encode("<|im_end|>", add_special_tokens=False).ids
    with SidecarClient(proc.address) as c:
        _records_here(c, ref)
        local = c._local.get("qwen3") if c._local is not None else None
        assert local is not None and local._writable is not None
        store = local._writable
        head, puts = store.head(), store.stats().puts
        r = c.tokenize("qwen3", text=prompt, add_special_tokens=False)
        assert r.token_ids == ref.encode(prompt, add_special_tokens=False).ids
        assert (store.head(), store.stats().puts) == (head, puts)  # the read stored nothing
        result = c.record_output("qwen3", prompt_text=prompt, prompt_token_ids=r.token_ids, output_text=output,
                                 output_token_ids=gen)
        records = _records_since(store, head)
        assert store.stats().puts - puts == len(records)
        chain = [keys for flags, keys in records if not flags & F_SEGMENT]
        assert len(chain) == 1, records
        assert l0_key(prompt) in chain[0] and output_key(prompt, output) in chain[0]
        assert len(chain[0]) >= 3  # and the prompt's cuts past what was stored (L1)
        segments = [k for flags, keys in records if flags & F_SEGMENT for k in keys]
        assert segment_key("", MODE_KV_STABLE, output.encode()) in segments
        assert result.entries == sum(len(keys) for _, keys in records)
        assert result.stop_token_dropped and result.recorded_tokens == len(gen) - 1
    reader = subprocess.run([sys.executable, "-c", _READER, proc.address], input=follow, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert reader.returncode == 0, reader.stderr
    got = json.loads(reader.stdout.strip().splitlines()[-1])
    assert got["served_by"] == "local" and got["source"] == "ar"
    assert got["ids"][:len(r.token_ids) + len(gen)] == r.token_ids + gen


_READS = textwrap.dedent("""
    import json, sys
    from sidecar_client import SidecarClient
    reads = json.loads(sys.stdin.read())
    with SidecarClient(sys.argv[1]) as client:
        client.tokenize("qwen3", text="warm up: map the segment, load the encoder")
        out = []
        for text, salt in reads:
            r = client.tokenize("qwen3", text=text, add_special_tokens=False, cache_salt=salt)
            out.append({"ids": r.token_ids, "source": r.decision.source, "served_by": r.served_by})
        print(json.dumps(out), flush=True)
""")


def test_a_local_record_and_record_output_give_the_next_turns_the_same_ids(
        sidecar: tuple[SidecarProcess, int], qwen3_path: Path) -> None:
    """The same conversation recorded twice, under two salts (two caches that share nothing):
    by this client process's own writer, and by the sidecar (RecordOutput, from a client that
    never maps the segment). Every turn's prompt ids are the same under both, each extending
    the turn before's prompt + generated ids; the next turn's ids, read by another client
    process in its own process and by the sidecar's Tokenize, are the same four times over."""
    import uuid

    proc, _ = sidecar
    ref = tokenizers.Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))
    here, there = uuid.uuid4().hex, uuid.uuid4().hex
    im_end = ref.encode("<|im_end|>", add_special_tokens=False).ids
    outputs = ["Step one:\n\n    run `make`\n\n", "Result: 100 passed\n\n\n  ok", "完成了。\n\n🎉 Done."]
    text = "<|im_start|>system\nYou are an agent.<|im_end|>\n" + TURN.format(q="build it")
    prev: list[int] = []
    with SidecarClient(proc.address) as local, SidecarClient(proc.address, zero_rpc=False) as rpc:
        for k, output in enumerate(outputs):
            mine = local.tokenize("qwen3", text=text, add_special_tokens=False, cache_salt=here)
            theirs = rpc.tokenize("qwen3", text=text, add_special_tokens=False, cache_salt=there)
            assert (mine.served_by, theirs.served_by) == ("local", "sidecar")
            assert mine.token_ids == theirs.token_ids and mine.token_ids[:len(prev)] == prev, k
            gen = _generated(ref, output) + im_end
            for c, ids, salt in ((local, mine.token_ids, here), (rpc, theirs.token_ids, there)):
                assert c.record_output("qwen3", prompt_text=text, prompt_token_ids=ids, output_text=output,
                                       output_token_ids=gen, cache_salt=salt).recorded_tokens == len(gen) - 1
            prev = mine.token_ids + gen
            text += output + "<|im_end|>\n" + TURN.format(q=f"and then ({k})?")
        assert local.stats()["records"] == {"recorded": len(outputs)}  # in this process: no RPC
    reads = subprocess.run([sys.executable, "-c", _READS, proc.address], input=json.dumps([[text, here],
                                                                                          [text, there]]),
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert reads.returncode == 0, reads.stderr
    elsewhere = json.loads(reads.stdout.strip().splitlines()[-1])
    with SidecarClient(proc.address, zero_rpc=False) as rpc:
        by_sidecar = [rpc.tokenize("qwen3", text=text, add_special_tokens=False, cache_salt=salt)
                      for salt in (here, there)]
    assert [r["served_by"] for r in elsewhere] == ["local", "local"]
    assert [r.served_by for r in by_sidecar] == ["sidecar", "sidecar"]
    assert [r["source"] for r in elsewhere] + [r.decision.source for r in by_sidecar] == ["ar"] * 4
    ids = [r["ids"] for r in elsewhere] + [r.token_ids for r in by_sidecar]
    assert ids[0] == ids[1] == ids[2] == ids[3] and ids[0][:len(prev)] == prev
