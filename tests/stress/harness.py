"""Shared by the stress/fuzz tests and ``bench/{crash_cycles,soak,pressure_demo}.py``.

* :class:`SidecarProc`: ``tokcache-sidecar serve`` as a real child process (unix socket or
  ``HOST:PORT``, ``--workers``), readiness over raw gRPC, SIGKILL, RSS.
* :func:`channel`: a raw gRPC channel with its own connection (local subchannel pool), so
  client threads spread over ``--workers`` like separate processes would.
* :class:`Workload`: a fixed pool of requests — text (exact and kv-stable), chat, and
  recorded outputs (AR) — each with the ids it may legitimately return, computed with HF
  ``tokenizers``/``transformers`` (never with tokcache's own code).
* :func:`shm_usage`: the ``/dev/shm`` objects under a prefix (count, bytes allocated).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tokcache.sidecar.bundled import qwen3_dir
from tokcache.v1 import tokenizer_pb2 as pb
from tokcache.v1 import tokenizer_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
MAX_MESSAGE = 64 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def channel(address: str) -> grpc.Channel:
    """A channel with a connection of its own (no sharing through the global subchannel pool)."""
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.enable_http_proxy", 0),
        ],
    )


def stub(ch: grpc.Channel) -> Any:
    return pb_grpc.TokenizerStub(ch)


def unpack(data: bytes) -> list[int]:
    ids = array("I")
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tolist()


def pack(ids: Sequence[int]) -> bytes:
    out = array("I", ids)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def rss(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except OSError:
        return 0


@dataclass(frozen=True)
class ShmUsage:
    """The /dev/shm objects whose name contains a prefix."""

    count: int
    allocated: int  # bytes of tmpfs pages (st_blocks)
    names: tuple[str, ...]


def shm_usage(prefix: str) -> ShmUsage:
    names: list[str] = []
    allocated = 0
    for entry in SHM.iterdir():
        if prefix in entry.name:
            try:
                allocated += entry.stat().st_blocks * 512
            except FileNotFoundError:
                continue
            names.append(entry.name)
    return ShmUsage(len(names), allocated, tuple(sorted(names)))


def unlink_prefix(prefix: str) -> None:
    for entry in SHM.iterdir():
        if prefix in entry.name:
            entry.unlink(missing_ok=True)


class SidecarProc:
    """``tokcache-sidecar serve`` in a child process; logs to ``<tmp>/sidecar.log``."""

    def __init__(
        self,
        tmp: Path,
        prefix: str,
        *extra: str,
        shm_size: str = "8MiB",
        workers: int = 1,
        listen: str | None = None,
        models: dict[str, Path] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        if listen is None:
            listen = f"unix://{tmp / 'tokcache.sock'}" if workers == 1 else f"127.0.0.1:{free_port()}"
        self.listen = listen
        self.address = listen if listen.startswith("unix://") else listen
        self.log_path = tmp / "sidecar.log"
        self.prefix = prefix
        self.cmd = [sys.executable, "-m", "tokcache.sidecar.cli", "serve", "--listen", listen, "--shm-prefix", prefix,
                    "--shm-size", shm_size, "--workers", str(workers), "--log-format", "text", *extra]
        for name, path in (models or {"qwen3": qwen3_dir()}).items():
            self.cmd += ["--model", f"{name}={path}"]
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 120.0, model: str = "qwen3") -> SidecarProc:
        """Start and wait until a Tokenize succeeds (the models are loaded)."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=log, env=self.env, cwd=ROOT)
        deadline = time.monotonic() + timeout
        with channel(self.address) as ch:
            s = stub(ch)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sidecar exited {self.proc.returncode}:\n{self.log()}")
                try:
                    s.Tokenize(pb.TokenizeRequest(model=model, text="ready?"), timeout=2)
                    return self
                except grpc.RpcError:
                    time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"sidecar not ready in {timeout}s:\n{self.log()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, tail: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def worker_pids(self) -> list[int]:
        """Worker processes of a ``--workers`` supervisor (not its resource tracker)."""
        return [p for p in children(self.pid) if "spawn_main" in cmdline(p)]

    def server_pids(self) -> list[int]:
        """The processes serving RPCs: the workers, or the sidecar itself."""
        return self.worker_pids() or [self.pid]

    def total_rss(self) -> int:
        return sum(rss(p) for p in {self.pid, *self.worker_pids()})

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) and reap. A supervisor's workers die with it
        (PR_SET_PDEATHSIG); wait for them too, so no process outlives this call."""
        if self.proc is None:
            return
        workers = self.worker_pids() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait()
        deadline = time.monotonic() + 30
        for pid in workers:
            while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}") and "spawn_main" in cmdline(pid):
                time.sleep(0.02)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait (SIGKILL after ``timeout``); returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


# --- the workload -------------------------------------------------------------------------------

_WORDS = (
    "the of and to in is that for it as with was on be by at this from or an are not have you which "
    "tokenize cache prefix segment eviction pressure kernel page worker lock semaphore checksum record "
    "def return import class self None True False lambda yield async await 0 1 2 3 42 3.14 1e9 0x1F "
    "你好 世界 日本語 한국어 émigré naïve Zürich 🎉 👩‍💻 — … «» ' \" ( ) [ ] { } : ; , . ! ? \n \n\n \t"
).split(" ")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


@dataclass
class Item:
    """One request and the id sequences it may return (any of ``allowed``)."""

    kind: str  # "text" | "chat" | "record" | "ar-text"
    request: Any
    allowed: tuple[tuple[int, ...], ...] = ()
    size: int = 0  # bytes of text

    def check(self, response: Any) -> bool:
        if self.kind == "record":
            return True
        return tuple(unpack(response.token_ids)) in self.allowed


@dataclass
class Workload:
    """A fixed pool of requests with their references (see the module docstring).

    ``conversations`` x ``turns`` growing ChatML texts (so L1 prefixes hit), the same
    conversations as chat messages (rendered by the sidecar, checked against
    ``transformers.apply_chat_template``), and ``ar_pairs`` recorded outputs whose ids are
    deliberately *not* the canonical BPE (so a spliced answer is visible), each followed
    by a text that continues it: its answer is either the canonical ids or the spliced
    ones, nothing else.
    """

    model: str = "qwen3"
    path: Path = field(default_factory=qwen3_dir)
    conversations: int = 40
    turns: int = 6
    words: tuple[int, int] = (20, 120)
    ar_pairs: int = 20
    chats: bool = True
    seed: int = 1234
    salt: str = "stress"
    items: list[Item] = field(default_factory=list)

    def build(self) -> Workload:
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(self.path / "tokenizer.json"))
        rng = random.Random(self.seed)
        texts: list[str] = []
        chats: list[list[dict[str, str]]] = []
        for _c in range(self.conversations):
            msgs: list[dict[str, str]] = [{"role": "system", "content": _words(rng, rng.randint(5, 30))}]
            for _t in range(self.turns):
                msgs.append({"role": "user", "content": _words(rng, rng.randint(*self.words))})
                chats.append([dict(m) for m in msgs])
                texts.append(_chatml(msgs, generation_prompt=True))
                msgs.append({"role": "assistant", "content": _words(rng, rng.randint(*self.words))})
        encoded = tok.encode_batch(texts, add_special_tokens=False)
        for i, (text, enc) in enumerate(zip(texts, encoded, strict=True)):
            exact = i % 2 == 0
            request = pb.TokenizeRequest(
                model=self.model, text=text, add_special_tokens=False, cache_salt=self.salt,
                mode=pb.TOKENIZE_MODE_EXACT if exact else pb.TOKENIZE_MODE_KV_STABLE)
            self.items.append(Item("text", request, (tuple(enc.ids),), len(text.encode())))
        if self.chats:
            self._add_chats(chats)
        self._add_ar(tok, rng)
        return self

    def _add_chats(self, chats: list[list[dict[str, str]]]) -> None:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(self.path))
        for msgs in chats[:: max(1, len(chats) // 60)]:
            want: Any = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
            chat = pb.ChatInput(
                messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in msgs],
                add_generation_prompt=True)
            request = pb.TokenizeRequest(model=self.model, chat=chat, cache_salt=self.salt)
            self.items.append(Item("chat", request, (tuple(want),), sum(len(m["content"]) for m in msgs)))

    def _add_ar(self, tok: Any, rng: random.Random) -> None:
        vocab = tok.get_vocab(with_added_tokens=False)
        salt = self.salt + "-ar"
        for k in range(self.ar_pairs):
            prompt = _chatml([{"role": "user", "content": f"question {k}: " + _words(rng, 30)}], generation_prompt=True)
            output = f"Answer {k}:\n\n" + _words(rng, 40) + "\n\nDone."
            canonical_out = tok.encode(output, add_special_tokens=False).ids
            generated = _split_tokens(tok, vocab, canonical_out)
            if generated is None or tok.decode(generated, skip_special_tokens=False) != output:
                continue
            prompt_ids = tok.encode(prompt, add_special_tokens=False).ids
            record = pb.RecordOutputRequest(
                model=self.model, cache_salt=salt, prompt_text=prompt, prompt_token_ids=pack(prompt_ids),
                output_text=output, output_token_ids=pack(generated), finish_reason="stop")
            self.items.append(Item("record", record, (), len(prompt) + len(output)))
            rest = "<|im_end|>\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n"
            follow = prompt + output + rest
            canonical = tuple(tok.encode(follow, add_special_tokens=False).ids)
            spliced = tuple(prompt_ids + generated + tok.encode(rest, add_special_tokens=False).ids)
            request = pb.TokenizeRequest(model=self.model, text=follow, add_special_tokens=False, cache_salt=salt,
                                         mode=pb.TOKENIZE_MODE_KV_STABLE)
            self.items.append(Item("ar-text", request, (canonical, spliced), len(follow)))

    @property
    def text_bytes(self) -> int:
        return sum(item.size for item in self.items)

    def call(self, s: Any, item: Item, timeout: float) -> Any:
        method: Callable[..., Any] = s.RecordOutput if item.kind == "record" else s.Tokenize
        return method(item.request, timeout=timeout)


def _chatml(msgs: list[dict[str, str]], generation_prompt: bool) -> str:
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
    return out + ("<|im_start|>assistant\n" if generation_prompt else "")


def _split_tokens(tok: Any, vocab: dict[str, int], ids: list[int]) -> list[int] | None:
    """``ids`` with every multi-character token split in two vocabulary tokens where
    possible (the ids decode to the same text but are not its BPE)."""
    out: list[int] = []
    changed = False
    for i in ids:
        piece = tok.id_to_token(i)
        split = None
        if piece is not None and len(piece) >= 2:
            for k in range(1, len(piece)):
                a, b = vocab.get(piece[:k]), vocab.get(piece[k:])
                if a is not None and b is not None:
                    split = [a, b]
                    break
        if split is None:
            out.append(i)
        else:
            out += split
            changed = True
    return out if changed else None
