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
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokcache.ids import common_prefix

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32  # CPU attention needs a multiple of 32; small blocks show small reuse differences
# The tiny model's KV is 1 KiB per token: 128 MiB holds 131072 tokens, far more than a run
# uses. (VLLM_CPU_KVCACHE_SPACE counts whole GiB: four servers would pin 4 GiB for nothing.)
KV_CACHE_BYTES = 128 * 1024 * 1024
# The plugin's Tokenize deadline and response wait in these runs: generous, because on 2 CPUs
# shared by four vLLM servers, three sidecars and other jobs a sidecar call has been seen to
# stall for 0.75 s (a 0.2 ms encode took 0.34 s), and a missed deadline is a fallback: a lost turn.
DEADLINE_S = 2.0
# Room for the agent conversations of test_06 (a 25 KB system prompt, ~6.7K tokens, plus six
# turns); make_tiny_model.py's max_position_embeddings matches.
MAX_MODEL_LEN = 8192


_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = threading.Lock()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port free now, outside the kernel's ephemeral range, never given out before in this process.

    Not ``bind(0)``: that port is ephemeral, and the seconds until a vLLM binds it are
    enough for another process's ``bind(0)`` (torch, ZMQ: every vLLM opens several) to take
    it, or for a second ``free_port`` to return it again. Ports below the ephemeral range
    are only ever bound by explicit request.
    """
    low, high = _ephemeral_range()
    start, stop = (20000, low) if low > 21000 else (high + 1, 65536)
    with _PORTS_LOCK:
        for port in range(start + os.getpid() % 500, stop):
            if port in _PORTS_GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _PORTS_GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port in {start}-{stop - 1}")


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
    """A CPU vLLM on the tiny model.

    ``api_servers=None``: ``python -m vllm.entrypoints.openai.api_server`` (one
    API server process). ``api_servers=N``: vLLM's CLI, ``vllm serve MODEL
    --api-server-count N`` (through ``e2e/vllm_cli.py``), which with N > 1
    spawns N API server processes sharing the port (SO_REUSEPORT) and serves
    /metrics from prometheus_client's multiprocess directory. ``render=True``:
    ``vllm launch render MODEL``, vLLM's GPU-less render server (no engine).
    """

    def __init__(self, workdir: Path, name: str, model_dir: Path, args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, *, api_servers: int | None = None,
                 render: bool = False) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The name requests use, and the one only this server serves: wait_ready checks that
        # the server answering on the port is this one (not a neighbour that bound it first).
        self.model = f"e2e-{name}-{uuid.uuid4().hex[:8]}"
        self.api_servers = api_servers
        self.log_path = workdir / f"vllm-{name}.log"
        common = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
                  "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE), "--enforce-eager",
                  "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--host", "127.0.0.1", "--port", str(self.port),
                  "--served-model-name", self.model]
        if render:
            self.cmd = [sys.executable, str(ROOT / "e2e" / "vllm_cli.py"), "launch", "render", str(model_dir),
                        "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(self.port),
                        "--served-model-name", self.model, *args]
        elif api_servers is None:
            self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                        *common, *args]
        else:
            self.cmd = [sys.executable, str(ROOT / "e2e" / "vllm_cli.py"), "serve", str(model_dir), *common,
                        "--api-server-count", str(api_servers), *args]
        # Nothing of the caller's that changes how a server tokenizes (fastokens) or counts.
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("TOKCACHE_", "FASTOKENS_"))
                 and k.upper() not in ("PROMETHEUS_MULTIPROC_DIR", "VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_FASTOKENS")}
        self.env = {**clean, "VLLM_TARGET_DEVICE": "cpu",
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

    def wait_ready(self, timeout: float = 600.0) -> VllmServer:
        assert self.proc is not None, "launch() first"
        if self.ready_s is not None:
            return self
        deadline = self.started_at + timeout
        # Asked at least once: the servers are launched together at the start of the session and a
        # server first used late (test_06's) may be asked after its deadline, ready since long
        # (a slow VM's earlier tests outlasted it: "not ready in 360s" with no check made). Five
        # servers starting at once on 2 slow cores took 250-347 s to answer: hence 600 s.
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM {self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    healthy = r.status == 200
                if healthy:
                    served = self._served_models()
                    if self.model not in served:
                        self.stop()
                        raise RuntimeError(f"vLLM {self.name}: port {self.port} is answered by another server "
                                           f"(serving {served}, not {self.model!r}):\n{self.log_tail()}")
                    self.ready_s = time.monotonic() - self.started_at
                    return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM {self.name} not ready in {timeout}s:\n{self.log_tail()}")

    def _served_models(self) -> list[str]:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as r:
            return [str(m.get("id")) for m in json.loads(r.read()).get("data", [])]

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


_VERBS = ("read", "write", "list", "search", "run", "patch", "fetch", "diff", "test", "build", "lint", "format")
_NOUNS = ("file", "directory", "symbol", "commit", "branch", "issue", "log", "config", "schema", "migration",
          "query", "trace")


def agent_system(tools: int = 30) -> str:
    """A coding agent's system prompt: instructions, ``tools`` JSON tool schemas and rules.

    Deterministic; 30 tools make 24.7 KB, 6.7K Qwen3 tokens: the size of a real agent's
    system prompt, where the cost of re-tokenizing the whole prompt every turn shows.
    """
    lines = ["You are a coding agent working in a large repository. Think step by step, call tools to inspect "
             "the code before changing it, keep diffs minimal, run the tests after every change and report what "
             "you did.", "", "# Tools", "",
             'Call a tool by answering with one JSON object per line: {"name": ..., "arguments": {...}}.',
             "Available tools:", ""]
    for i in range(tools):
        verb, noun = _VERBS[i % len(_VERBS)], _NOUNS[(i * 5) % len(_NOUNS)]
        schema = {"type": "function", "function": {
            "name": f"{verb}_{noun}_{i}",
            "description": (f"{verb.capitalize()} a {noun} of the workspace (variant {i}). Returns a JSON object "
                            f"with `ok`, `{noun}` and `elapsed_ms`; errors carry `code` and a human-readable "
                            f"`message`. Use it when the user asks about the {noun}, never speculatively; at most "
                            f"{i % 7 + 2} calls per turn."),
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "description": f"Path of the {noun}, relative to the repository root."},
                "pattern": {"type": "string", "description": "Optional glob or regular expression (Rust syntax)."},
                "limit": {"type": "integer", "minimum": 1, "maximum": 1000 + i, "default": 100},
                "dry_run": {"type": "boolean", "default": i % 2 == 0}},
                "required": ["path"]}}}
        lines.append(json.dumps(schema))
    lines += ["", "# Rules", ""]
    lines += [f"{k + 1}. Never touch files outside the workspace; quote paths exactly; prefer "
              f"`{_VERBS[k % 12]}_{_NOUNS[k % 12]}` over shell commands when both work." for k in range(20)]
    return "\n".join(lines)


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


@dataclass
class Reply:
    """One chat completion (choice 0) as the client saw it."""

    prompt_ids: list[int]
    gen: list[int]
    content: str
    finish: str | None
    cached: int | None  # usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details)
    ttft: float | None  # streamed: seconds to the first chunk carrying generated ids or text
    latency: float  # seconds to the end of the response


def chat_reply(server: VllmServer, body: dict[str, Any], stream: bool) -> Reply:
    """Like :func:`chat_turn`, plus cached prompt tokens and timings."""
    t0 = time.monotonic()
    if not stream:
        resp = server.post("/v1/chat/completions", body)
        choice = resp["choices"][0]
        details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
        return Reply(resp["prompt_token_ids"], choice["token_ids"], choice["message"]["content"] or "",
                     choice.get("finish_reason"), details.get("cached_tokens"), None, time.monotonic() - t0)
    prompt_ids: list[int] = []
    gen: list[int] = []
    text: list[str] = []
    finish = None
    cached = None
    ttft = None
    for chunk in server.stream("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}):
        if chunk.get("prompt_token_ids"):
            prompt_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices", []):
            if choice.get("index", 0) != 0:
                continue
            ids = choice.get("token_ids") or []
            piece = (choice.get("delta") or {}).get("content") or ""
            if ttft is None and (ids or piece):
                ttft = time.monotonic() - t0
            gen.extend(ids)
            text.append(piece)
            finish = choice.get("finish_reason") or finish
        if chunk.get("usage"):
            cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    return Reply(prompt_ids, gen, "".join(text), finish, cached, ttft, time.monotonic() - t0)


@dataclass
class ConvTurn:
    """Turn ``turn`` of conversation ``conv``; ``expected``: previous prompt + output, as for :class:`Turn`."""

    conv: int
    turn: int
    reply: Reply
    expected: int | None
    common: int | None
    held: int

    @property
    def exact(self) -> bool:
        return self.expected is not None and self.common == self.expected

    @property
    def prefilled(self) -> int | None:
        return None if self.reply.cached is None else len(self.reply.prompt_ids) - self.reply.cached


def run_conversations(server: VllmServer, *, convs: int, turns: int, stream: bool, seed: int,
                      decode: Callable[[list[int]], str], max_tokens: int = 40,
                      system: str = "You are a helpful assistant.") -> list[ConvTurn]:
    """``convs`` chats at once, each sending its next turn as soon as the previous response ended.

    Conversation ``c``'s turn ``k`` uses seed ``seed + 100 * c + k`` (the same
    conversations on every server). Returns every turn, by conversation then turn.
    """
    decode_lock = threading.Lock()  # one tokenizer object shared by the threads

    def conversation(c: int) -> list[ConvTurn]:
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        expected: list[int] | None = None
        out: list[ConvTurn] = []
        for k in range(1, turns + 1):
            messages.append({"role": "user", "content": QUESTIONS[(k - 1) % len(QUESTIONS)]})
            body = {"model": server.model, "messages": messages, "temperature": 1.0, "max_tokens": max_tokens,
                    "return_token_ids": True, "seed": seed + 100 * c + k, "logit_bias": BANNED}
            reply = chat_reply(server, body, stream)
            with decode_lock:
                held = held_back(reply.gen, reply.content, decode)
            common = None if expected is None else common_prefix(reply.prompt_ids, expected)
            out.append(ConvTurn(c, k, reply, None if expected is None else len(expected), common, held))
            expected = reply.prompt_ids + reply.gen[:len(reply.gen) - held]
            messages.append({"role": "assistant", "content": reply.content})
        return out

    with ThreadPoolExecutor(convs) as pool:
        return [t for conv in pool.map(conversation, range(convs)) for t in conv]


def histogram(metrics: Mapping[str, float], name: str, **labels: str) -> list[tuple[float, float]]:
    """The cumulative buckets ``[(le, count), ...]`` of a histogram in :meth:`VllmServer.metrics`.

    ``labels``: the series' labels besides ``le`` (none for an unlabelled histogram).
    """
    out = []
    prefix = name + "_bucket{"
    for key, value in metrics.items():
        if not key.startswith(prefix):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', key[len(name):]))
        le = found.pop("le", None)
        if le is not None and found == labels:
            out.append((float(le), value))
    return sorted(out)


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket holding rank q."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def delta(m1: Mapping[str, float], m0: Mapping[str, float], key: str) -> float:
    """How much sample ``key`` of :meth:`VllmServer.metrics` grew from ``m0`` to ``m1``."""
    return m1.get(key, 0.0) - m0.get(key, 0.0)


def labelled(m1: Mapping[str, float], m0: Mapping[str, float], family: str, label: str) -> dict[str, int]:
    """The non-zero increases of ``tokcache_vllm_<family>_total`` by ``label``, e.g. fallbacks by reason."""
    prefix = f'tokcache_vllm_{family}_total{{{label}="'
    return {k[len(prefix):-2]: int(delta(m1, m0, k)) for k in m1 if k.startswith(prefix) and delta(m1, m0, k)}


TOKENIZE_SECONDS = "tokcache_vllm_tokenize_seconds"


@dataclass(frozen=True)
class Timing:
    """A histogram's observations between two scrapes: count, mean (``_sum``/``_count``), p50, p90
    and p99 (:func:`histogram_quantile` in the buckets: as good as the bucket bounds around them)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    slow: int = 0  # observations above SLOW_S (they make a mean far above the p90)
    p99: float | None = None

    def text(self) -> str:
        def ms(x: float | None) -> str:
            return "-" if x is None else f"{1000 * x:.2f} ms"

        slow = f", {self.slow} over {SLOW_S * 1000:.0f} ms" if self.slow else ""
        return f"n={self.count} p50 {ms(self.p50)} p90 {ms(self.p90)} p99 {ms(self.p99)} mean {ms(self.mean)}{slow}"


SLOW_S = 0.1  # a bucket bound of both plugin histograms


def timing(m0: Mapping[str, float], m1: Mapping[str, float], name: str, **labels: str) -> Timing:
    """The observations of histogram ``name`` (series ``labels``) between scrapes ``m0`` and ``m1``."""
    before = dict(histogram(m0, name, **labels))
    buckets = [(le, n - before.get(le, 0.0)) for le, n in histogram(m1, name, **labels)]
    series = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    count = delta(m1, m0, name + "_count" + series)
    total = delta(m1, m0, name + "_sum" + series)
    fast = dict(buckets).get(SLOW_S)
    return Timing(int(count), total / count if count else None, histogram_quantile(buckets, 0.5),
                  histogram_quantile(buckets, 0.9), 0 if fast is None else int(count - fast),
                  histogram_quantile(buckets, 0.99))


def tokenize_timings(m0: Mapping[str, float], m1: Mapping[str, float]) -> dict[str, Timing]:
    """``tokcache_vllm_tokenize_seconds`` between two scrapes, by path (local, sidecar, vllm) that saw prompts."""
    paths = {m.group(1) for k in m1 if (m := re.fullmatch(TOKENIZE_SECONDS + r'_count\{path="([^"]+)"\}', k))}
    out = {path: timing(m0, m1, TOKENIZE_SECONDS, path=path) for path in sorted(paths)}
    return {path: t for path, t in out.items() if t.count}


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
