"""Processes and HTTP for the e2e tests: a tokcache sidecar, a CPU vLLM server, a chat driver.

Stdlib only (runs in ``.venv-vllm``). Every process is started in its own
session so stopping it takes its children (vLLM's EngineCore and workers)
along; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32  # CPU attention needs a multiple of 32; small blocks show small reuse differences


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_group(proc: subprocess.Popen[bytes], sig: int, timeout: float) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _reap_group(pgid: int, timeout: float = 10.0) -> None:
    """SIGKILL whatever is left in the process group (vLLM children outliving the parent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Sidecar:
    """``python -m tokcache.sidecar.cli serve`` on a unix socket, in this interpreter's venv."""

    def __init__(self, workdir: Path, name: str, models: Mapping[str, Path], shm_prefix: str,
                 env: Mapping[str, str] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.sock = workdir / f"{name}.sock"
        self.address = f"unix://{self.sock}"
        self.log_path = workdir / f"{name}.log"
        self.cmd = [sys.executable, "-m", "tokcache.sidecar.cli", "serve", "--listen", self.address,
                    "--shm-prefix", shm_prefix, "--shm-size", "64MiB", "--log-level", "info"]
        for model, path in models.items():
            self.cmd += ["--model", f"{model}={path}"]
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("TOKCACHE_", "OTEL_"))}
        self.env = {**clean, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> Sidecar:
        from sidecar_client import SidecarClient, SidecarUnavailable

        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=log, env=self.env, cwd=ROOT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        with SidecarClient(self.address, timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sidecar exited {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.list_models():
                        return self
                except SidecarUnavailable:
                    pass
                time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"sidecar not ready in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: the sidecar dies mid-run, as on an OOM kill."""
        if self.proc is not None:
            _stop_group(self.proc, signal.SIGKILL, 10)

    def stop(self) -> None:
        if self.proc is not None:
            _stop_group(self.proc, signal.SIGTERM, 20)


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` (CPU) on the tiny model."""

    def __init__(self, workdir: Path, name: str, model_dir: Path, args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model_dir)
        self.log_path = workdir / f"vllm-{name}.log"
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                    "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "4096",
                    "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE), "--enforce-eager",
                    "--host", "127.0.0.1", "--port", str(self.port), *args]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKCACHE_")}
        self.env = {**clean, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
                    "PYTHONWARNINGS": "ignore::DeprecationWarning", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_s: float | None = None

    def launch(self) -> VllmServer:
        """Start without waiting (several servers start in parallel); then :meth:`wait_ready`."""
        self.started_at = time.monotonic()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=log, env=self.env, cwd=ROOT,
                                         start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 360.0) -> VllmServer:
        assert self.proc is not None, "launch() first"
        if self.ready_s is not None:
            return self
        deadline = self.started_at + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM {self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.ready_s = time.monotonic() - self.started_at
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM {self.name} not ready in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 8000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            pgid = self.proc.pid
            _stop_group(self.proc, signal.SIGTERM, 30)
            _reap_group(pgid)

    # -- HTTP ------------------------------------------------------------------------------
    def post(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None,
             timeout: float = 120) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stream(self, path: str, body: Mapping[str, Any], timeout: float = 120) -> Iterator[dict[str, Any]]:
        """Server-sent events of a streaming request, as dicts (``[DONE]`` ends)."""
        req = urllib.request.Request(self.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics summed over labels, plus ``name{labels}`` entries for tokcache ones."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$", text, re.M):
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            out[name] = out.get(name, 0.0) + value
            if name.startswith("tokcache_"):
                out[name + labels] = value
        return out


# Random weights sample the whole vocabulary, including template control tokens (which
# rewrite the history, e.g. "</think>") and ids past the tokenizer's vocabulary (151669..)
# that a trained model never emits. Ban them; everything else stays fair game.
BANNED_IDS = range(151643, 151936)
BANNED = {str(i): -100 for i in BANNED_IDS}


QUESTIONS = [
    "Write two short paragraphs about caching, separated by a blank line.",
    "Now list three bullet points about tokenizers.\n\nKeep it brief.",
    "Explain prefix caching in one sentence.",
    "Give me a tiny Python snippet that prints hello.",
    "What is a BPE merge? Answer with a line break in the middle.",
    "Summarise our conversation.",
]


@dataclass
class Turn:
    turn: int
    prompt_tokens: int
    generated: int
    finish: str | None
    expected: int | None = None
    common: int | None = None
    hit: int = 0
    queried: int = 0
    held: int = 0
    detail: str = ""

    @property
    def agree(self) -> float | None:
        if self.expected is None or self.common is None:
            return None
        return 100.0 * self.common / self.expected if self.expected else 100.0


@dataclass
class ChatRun:
    label: str
    stream: bool
    turns: list[Turn] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0

    def table(self) -> str:
        lines = [f"== {self.label} ({'stream' if self.stream else 'non-stream'})",
                 f"{'turn':>4} {'prompt':>6} {'gen':>4} {'finish':>7} {'expected':>8} {'common':>6} {'agree%':>7} "
                 f"{'hit':>5} {'held':>4}  first divergence"]
        for t in self.turns:
            agree = "-" if t.agree is None else f"{t.agree:.1f}%"
            lines.append(f"{t.turn:>4} {t.prompt_tokens:>6} {t.generated:>4} {str(t.finish):>7} "
                         f"{'-' if t.expected is None else t.expected:>8} {'-' if t.common is None else t.common:>6} "
                         f"{agree:>7} {t.hit:>5} {t.held:>4}  {t.detail or '-'}")
        rate = 100.0 * self.hits / self.queries if self.queries else 0.0
        exact = sum(1 for t in self.turns if t.agree == 100.0)
        lines.append(f"prefix cache: hits {self.hits:.0f} / queries {self.queries:.0f} tokens ({rate:.1f}%); "
                     f"exact extension {exact}/{len(self.turns) - 1} turns")
        return "\n".join(lines)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def chat_turn(server: VllmServer, body: dict[str, Any], stream: bool) -> tuple[list[int], list[int], str, str | None]:
    """One chat completion; (prompt ids, generated ids, content, finish reason) of choice 0."""
    if not stream:
        resp = server.post("/v1/chat/completions", body)
        choice = resp["choices"][0]
        return resp["prompt_token_ids"], choice["token_ids"], choice["message"]["content"] or "", \
            choice.get("finish_reason")
    prompt_ids: list[int] = []
    gen: list[int] = []
    text: list[str] = []
    finish = None
    for chunk in server.stream("/v1/chat/completions", body):
        if chunk.get("prompt_token_ids"):
            prompt_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices", []):
            if choice.get("index", 0) != 0:
                continue
            gen.extend(choice.get("token_ids") or [])
            text.append((choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    return prompt_ids, gen, "".join(text), finish


def held_back(gen: Sequence[int], text: str, decode: Callable[[list[int]], str]) -> int:
    """Trailing generated ids that the returned text does not contain (an unfinished character).

    vLLM's detokenizer holds back the bytes of a UTF-8 character cut by max_tokens;
    the client never sees them, so no prompt can contain them.
    """
    for k in range(0, min(4, len(gen)) + 1):
        if decode(list(gen[:len(gen) - k])) == text:
            return k
    return 0


def run_chat(server: VllmServer, label: str, *, stream: bool, decode: Callable[[list[int]], str], turns: int = 6,
             max_tokens: int = 40, seed: int = 0, system: str = "You are a helpful assistant.",
             cache_salt: str | None = None, between: Callable[[int], None] | None = None) -> ChatRun:
    """A multi-turn chat at temperature 1.0; per turn, how much of (previous prompt + output) is kept.

    "expected" is the previous prompt + its generated ids, less ids held back
    from the text (column "held"; see :func:`held_back`). ``between(k)`` runs
    before turn k (the fail-open test kills and restarts the sidecar there).
    """
    run = ChatRun(label, stream)
    before = server.metrics()
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    expected: list[int] | None = None
    for k in range(1, turns + 1):
        if between is not None:
            between(k)
        messages.append({"role": "user", "content": QUESTIONS[(k - 1) % len(QUESTIONS)]})
        body = {"model": server.model, "messages": messages, "temperature": 1.0, "max_tokens": max_tokens,
                "return_token_ids": True, "seed": seed * 100 + k,
                "logit_bias": BANNED}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        m0 = server.metrics()
        prompt_ids, gen, content, finish = chat_turn(server, body, stream)
        m1 = server.metrics()
        t = Turn(k, len(prompt_ids), len(gen), finish,
                 hit=int(m1["vllm:prefix_cache_hits_total"] - m0["vllm:prefix_cache_hits_total"]),
                 queried=int(m1["vllm:prefix_cache_queries_total"] - m0["vllm:prefix_cache_queries_total"]))
        if expected is not None:
            t.expected, t.common = len(expected), common_prefix(prompt_ids, expected)
            if t.common < len(expected):
                t.detail = (f"at {t.common}: expected {expected[t.common:t.common + 3]} "
                            f"got {prompt_ids[t.common:t.common + 3]}")
        run.turns.append(t)
        t.held = held_back(gen, content, decode)
        expected = prompt_ids + gen[:len(gen) - t.held]
        messages.append({"role": "assistant", "content": content})
    after = server.metrics()
    run.hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    run.queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    return run


def wait_until(predicate: Any, timeout: float, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def span_objects(log_text: str) -> list[dict[str, Any]]:
    """The JSON objects OpenTelemetry's console exporter printed into a log."""
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    for m in re.finditer(r"^\{\s*$", log_text, re.M):
        try:
            obj, _ = decoder.raw_decode(log_text, m.start())
        except ValueError:
            continue
        if isinstance(obj, dict) and "context" in obj:
            out.append(obj)
    return out
