"""The contenders of ``multiturn_latency.py``: one class each, same small interface.

A contender turns a prompt text into ``list[int]`` as its client would see it: in-process
encoders return the ids, servers are called over a persistent connection and their replies are
decoded to a Python list inside the timed call (that is part of what a caller pays).

Servers are started as subprocesses in their own session and always stopped in ``close()``;
``close()`` is idempotent and safe after a failed ``start()``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

__all__ = [
    "Contender",
    "ContenderUnavailable",
    "FastokensContender",
    "SmgContender",
    "SmgFloor",
    "TokcacheContender",
    "TokcacheFloor",
    "TokenizersContender",
]

REPO = Path(__file__).resolve().parents[1]
SMG_VERSION = "1.13.0"
SMG_VENV = REPO / "bench" / ".venv-smg"
TOKCACHE_MODEL = "bench"
READY_TIMEOUT_S = 90.0


class ContenderUnavailable(RuntimeError):
    """A contender could not be installed or started; the run goes on without it."""


class Contender:
    """Base: ``encode`` is the timed call; ``checked`` says its ids are compared."""

    name = "?"
    label = "?"
    checked = True

    def start(self) -> None:
        """Load or launch; raise ContenderUnavailable when that cannot work here."""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def last_info(self) -> dict[str, Any]:
        """Per-call details recorded next to the latency (e.g. the cache decision)."""
        return {}

    def close(self) -> None:
        """Release everything; idempotent."""


class TokenizersContender(Contender):
    name = "tokenizers"
    label = "tokenizers (in-process)"

    def __init__(self, tokenizer_json: Path, add_special_tokens: bool) -> None:
        self._path = tokenizer_json
        self._add = add_special_tokens

    def start(self) -> None:
        import tokenizers

        self._tok = tokenizers.Tokenizer.from_file(str(self._path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self._add).ids


class FastokensContender(Contender):
    def __init__(self, tokenizer_json: Path, add_special_tokens: bool, segment_cache_bytes: int = 0) -> None:
        self._path = tokenizer_json
        self._add = add_special_tokens
        self._cache = segment_cache_bytes
        self.name = "fastokens+seg" if segment_cache_bytes else "fastokens"
        self.label = (
            f"fastokens + segment cache ({segment_cache_bytes >> 20} MiB)"
            if segment_cache_bytes
            else "fastokens (in-process)"
        )

    def start(self) -> None:
        import fastokens

        self._tok = fastokens.Tokenizer.from_file(str(self._path))
        # Explicit either way: FASTOKENS_SEGMENT_CACHE in the environment would turn it on.
        self._tok.enable_segment_cache(self._cache)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self._add).ids

    def stats(self) -> dict[str, Any] | None:
        stats = self._tok.segment_cache_stats()
        return dict(stats) if stats else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> int | None:
    """Signal a server started with start_new_session=True, then kill its group if it lingers."""
    if proc is None:
        return None
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return proc.wait(5)
    return proc.returncode


def _die_with_parent() -> None:
    """preexec_fn: the server gets SIGTERM if the benchmark dies without reaching close()."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1 (Linux)
    except (OSError, AttributeError):
        pass


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    # SMG logs with ANSI colours; strip them so the tail is readable in a report.
    return "\n".join(re.sub(r"\x1b\[[0-9;]*m", "", x) for x in lines[-n:])


class SmgContender(Contender):
    """SMG's Rust tokenizer with its L0+L1 cache, behind its HTTP ``/v1/tokenize``."""

    name = "smg"
    label = f"SMG {SMG_VERSION} /v1/tokenize (HTTP keep-alive)"

    def __init__(self, tokenizer_dir: Path, log_dir: Path) -> None:
        self._dir = tokenizer_dir
        self._log = log_dir / "smg.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: http.client.HTTPConnection | None = None
        self.metrics_port = 0
        self.port = 0
        self.reconnects = 0  # kept-alive connections SMG had closed, opened again (see _post)

    @staticmethod
    def ensure_installed() -> Path:
        exe = SMG_VENV / "bin" / "smg"
        if exe.exists():
            return exe
        print(f"installing smg=={SMG_VERSION} into {SMG_VENV} ...", file=sys.stderr)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(SMG_VENV)], check=True, timeout=120)
            subprocess.run(
                [str(SMG_VENV / "bin" / "pip"), "install", "-q", f"smg=={SMG_VERSION}"],
                check=True,
                timeout=600,
            )
        except (subprocess.SubprocessError, OSError) as exc:
            raise ContenderUnavailable(f"could not install smg=={SMG_VERSION}: {exc}") from exc
        if not exe.exists():
            raise ContenderUnavailable(f"smg=={SMG_VERSION} installed no `smg` executable")
        return exe

    def start(self) -> None:
        exe = self.ensure_installed()
        self.port, self.metrics_port = _free_port(), _free_port()
        cmd = [
            str(exe),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model-path",
            str(self._dir),
            "--tokenizer-cache-enable-l0",
            "--tokenizer-cache-enable-l1",
            "--disable-health-check",
            # Per-request INFO logging is SMG's default; warn gives it its best case.
            "--log-level",
            "warn",
            # Its metrics listener binds 0.0.0.0:29000 by default; keep it on loopback.
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.metrics_port),
        ]
        self._log.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
            )
        # The tokenizer loads in the background after the port opens: ready = a tokenize works.
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ContenderUnavailable(f"smg exited with {self._proc.returncode}:\n{_tail(self._log)}")
            try:
                self._connect()
                self.encode("ready?")
                return
            except (OSError, http.client.HTTPException, RuntimeError) as exc:
                last = str(exc)
                self._drop_conn()
                time.sleep(0.2)
        raise ContenderUnavailable(f"smg not ready after {READY_TIMEOUT_S:.0f}s ({last}):\n{_tail(self._log)}")

    def _connect(self) -> None:
        if self._conn is None:
            self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            self._conn.connect()
            self._conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _drop_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _post(self, body: bytes) -> bytes:
        try:
            resp = self._send(body)
        except (BrokenPipeError, ConnectionResetError, http.client.CannotSendRequest):
            # SMG closes a keep-alive connection left idle for more than a minute or so (kept
            # at 65 s, closed at 95 s, measured with 1.13), and the long mode computes its
            # references between the ready check and the first turn: open a new one and send
            # again, once, as an HTTP client's connection pool does. Counted.
            self._drop_conn()
            self._connect()
            self.reconnects += 1
            resp = self._send(body)
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"smg /v1/tokenize: HTTP {resp.status}: {data[:300]!r}")
        return data

    def _send(self, body: bytes) -> http.client.HTTPResponse:
        assert self._conn is not None
        self._conn.request("POST", "/v1/tokenize", body=body, headers={"Content-Type": "application/json"})
        return self._conn.getresponse()

    def encode(self, text: str) -> list[int]:
        body = json.dumps({"model": str(self._dir), "prompt": text}).encode()
        tokens: list[int] = json.loads(self._post(body))["tokens"]
        return tokens

    def metrics(self) -> dict[str, float]:
        """SMG's tokenizer-cache and allocator counters from its Prometheus endpoint."""
        conn = http.client.HTTPConnection("127.0.0.1", self.metrics_port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(("smg_tokenizer_cache_", "smg_allocator_")):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        out["vm_rss_bytes"] = float(self.rss_bytes() or 0)
        return out

    def rss_bytes(self) -> int | None:
        """SMG's resident set (``VmRSS``): where its in-process caches live."""
        if self._proc is None:
            return None
        try:
            for line in Path(f"/proc/{self._proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def close(self) -> None:
        self._drop_conn()
        _stop(self._proc)
        self._proc = None


class SmgFloor(Contender):
    """SMG's HTTP round trip on a 1-token prompt: the transport floor of ``smg``."""

    name = "smg-floor"
    label = "SMG floor (1-token /v1/tokenize)"
    checked = False

    def __init__(self, smg: SmgContender) -> None:
        self._smg = smg
        self._body = json.dumps({"model": str(smg._dir), "prompt": "hi"}).encode()

    def encode(self, text: str) -> list[int]:
        tokens: list[int] = json.loads(self._smg._post(self._body))["tokens"]
        return tokens


class GeneratedOutput:
    """The output a serving engine generated between a prompt and the next turn's text, as a
    benchmark records it: the text from the prompt's end to the first added special token
    after it, whose id ends the output (the end-of-turn token the model generated); its ids are
    that text's canonical encoding, so kv-stable ids still equal ``tokenizers``'. Built lazily
    (the reference tokenizer loads on first use)."""

    def __init__(self, tokenizer_dir: Path) -> None:
        self._dir = tokenizer_dir
        self._ref: Any = None
        self._added: Any = None

    def load(self) -> GeneratedOutput:
        """Load the reference tokenizer now (before a clock starts), once."""
        if self._ref is None:
            import tokenizers

            self._ref = tokenizers.Tokenizer.from_file(str(self._dir / "tokenizer.json"))
            added = sorted((t.content for t in self._ref.get_added_tokens_decoder().values() if t.special),
                           key=len, reverse=True)
            self._added = re.compile("|".join(map(re.escape, added)))
        return self

    def between(self, prompt: str, next_text: str) -> tuple[str, list[int]] | None:
        """(output text, output ids), or None when ``next_text`` does not extend ``prompt`` (a
        template that rewrote history, another conversation) or no output precedes the token."""
        if not next_text.startswith(prompt):
            return None
        self.load()
        rest = next_text[len(prompt):]
        end = self._added.search(rest)
        if end is None or end.start() == 0:
            return None
        out = rest[: end.start()]
        return out, self._ref.encode(out, add_special_tokens=False).ids + [self._ref.token_to_id(end.group())]


class TokcacheContender(Contender):
    """A tokcache sidecar as a subprocess (its own segment) and a ``SidecarClient`` for it.

    ``zero_rpc`` (the client's default): text is tokenized in the benchmark's process from
    the sidecar's shared memory, and what it learned is stored by the client within the call.
    Without it every call is a gRPC round trip over the unix socket;
    ``stream=False`` sends each call as a unary ``Tokenize`` instead of over the client's
    ``TokenizeStream``.
    """

    def __init__(self, tokenizer_dir: Path, log_dir: Path, add_special_tokens: bool, shm_size: str = "256MiB",
                 stream: bool = True, zero_rpc: bool = True, name: str = "", record_outputs: bool = False) -> None:
        self._stream = stream
        self._zero_rpc = zero_rpc
        # True: every turn's output is recorded (RecordOutput) before the next turn, as vLLM's
        # plugin does, so kv-stable reads take recorded outputs (AR) into account: see prepare.
        self._record = record_outputs
        self._prev: tuple[str, list[int]] | None = None
        self._outputs = GeneratedOutput(tokenizer_dir)
        if record_outputs:
            self.name, self.label = name or "tokcache-ar", "tokcache, outputs recorded (what vLLM's plugin does)"
        elif zero_rpc:
            self.name, self.label = name or "tokcache", "tokcache (default client: reads in this process)"
        else:
            self.name = name or "tokcache-rpc"
            self.label = f"tokcache RPC ({'TokenizeStream' if stream else 'unary Tokenize'}, unix socket)"
        self._dir = tokenizer_dir
        self._add = add_special_tokens
        self._shm_size = shm_size
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.shm_prefix = f"tkbench{tag}"
        self.socket_path = Path(f"/tmp/tokcache-bench-{tag}.sock")
        self._log = log_dir / f"{self.name}-sidecar.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._client: Any = None
        self._last: Any = None
        self.exit_code: int | None = None

    @property
    def target(self) -> str:
        return f"unix://{self.socket_path}"

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tokcache.sidecar.cli", *args]

    def start(self) -> None:
        try:
            from sidecar_client import SidecarClient
        except ImportError as exc:
            raise ContenderUnavailable(f"sidecar_client is not importable: {exc}") from exc
        stale = remove_stale_segments()
        if stale:
            print(f"removed {len(stale)} stale segment(s)/socket(s) of killed runs", file=sys.stderr)
        cmd = self._cli(
            "serve",
            "--listen",
            self.target,
            "--model",
            f"{TOKCACHE_MODEL}={self._dir}",
            "--shm-size",
            self._shm_size,
            "--shm-prefix",
            self.shm_prefix,
        )
        self._log.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ContenderUnavailable(f"sidecar exited with {self._proc.returncode}:\n{_tail(self._log)}")
            if self.socket_path.exists():
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        s.settimeout(1.0)
                        s.connect(str(self.socket_path))
                    break
                except OSError:
                    pass
            time.sleep(0.1)
        else:
            raise ContenderUnavailable(
                f"sidecar socket not accepting after {READY_TIMEOUT_S:.0f}s:\n{_tail(self._log)}"
            )
        self._client = SidecarClient(self.target, stream=self._stream, zero_rpc=self._zero_rpc)
        self._client.__enter__()
        # The socket can accept before the model is loaded: ready = a tokenize answers.
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                self.encode("ready?")
                return
            except Exception as exc:  # noqa: BLE001 - the client's error types are not settled yet
                last = exc
                if self._proc.poll() is not None:
                    break
                time.sleep(0.2)
        raise ContenderUnavailable(f"sidecar never answered Tokenize ({last!r}):\n{_tail(self._log)}")

    def encode(self, text: str) -> list[int]:
        r = self._client.tokenize(model=TOKCACHE_MODEL, text=text, add_special_tokens=self._add, cache_salt="")
        ids = r.token_ids
        if not isinstance(ids, list):
            ids = list(ids)
        if self._record:
            self._prev = (text, ids)
        # last_info() reads it outside the timed call, as other contenders' do. Not the result
        # itself: holding it would free the previous call's 15k-id list inside this timed call
        # (~25 µs cold), a cost no other contender's call carries (the harness drops theirs).
        self._last = (r.decision, r.served_by)
        return ids

    def prepare(self, text: str) -> None:
        """Before the timed call for ``text`` (``record_outputs`` only): record the output that
        took the previous prompt to this one (see GeneratedOutput) — what a serving engine does
        once its response is sent, before the client's next turn. The ids are checked as
        everyone's. A text that does not extend the previous prompt records nothing."""
        if not self._record or self._prev is None:
            return
        prompt, prompt_ids = self._prev
        self._prev = None
        got = self._outputs.between(prompt, text)
        if got is None:
            return
        out, ids = got
        self._client.record_output(TOKCACHE_MODEL, prompt_text=prompt, prompt_token_ids=prompt_ids, output_text=out,
                                   output_token_ids=ids, stop_reason=None, prompt_add_special_tokens=self._add)

    def close_client(self) -> None:
        """Close this process's client and keep the sidecar serving (a benchmark whose own
        process is no client of it)."""
        if self._client is not None:
            self._client.__exit__(None, None, None)
            self._client = None

    def client_stats(self) -> dict[str, Any]:
        return dict(self._client.stats()) if self._client is not None else {}

    def last_info(self) -> dict[str, Any]:
        if self._last is None:
            return {}
        d, served_by = self._last
        return {"source": d.source, "cached_tokens": d.cached_tokens, "encoded_chars": d.encoded_chars,
                "served_by": served_by}

    def list_models(self) -> Any:
        return self._client.list_models()

    def shm_usage(self) -> dict[str, Any]:
        """Bytes the segment(s) under our prefix hold.

        ``used_bytes``: the sidecar's own count (``tokcache-sidecar stats``), if it answers.
        ``resident_bytes``: pages the kernel has backing the ``/dev/shm`` files (``st_blocks``);
        that is what counts against a pod's memory limit, whatever the arena's bookkeeping says.
        """
        out: dict[str, Any] = {"used_bytes": None, "resident_bytes": 0, "stats_error": None, "stats": None}
        for entry in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            try:
                out["resident_bytes"] += entry.stat().st_blocks * 512
            except OSError:
                pass
        try:
            res = subprocess.run(
                self._cli("stats", "--shm-prefix", self.shm_prefix),
                capture_output=True,
                text=True,
                timeout=60,
                cwd=REPO,
            )
            if res.returncode != 0:
                raise RuntimeError(f"exit {res.returncode}: {res.stderr.strip()[-300:]}")
            stats = json.loads(res.stdout)
            out["used_bytes"] = _find_used_bytes(stats)
            out["stats"] = stats
            if out["used_bytes"] is None:
                raise RuntimeError(f"no used_bytes in: {res.stdout[:300]}")
        except (subprocess.SubprocessError, OSError, RuntimeError, json.JSONDecodeError) as exc:
            out["stats_error"] = str(exc)
        return out

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - closing must not mask the run's result
                pass
            self._client = None
        if self._proc is not None:
            self.exit_code = _stop(self._proc, signal.SIGTERM, grace_s=15.0)
            self._proc = None
        for pattern in (f"{self.shm_prefix}*", f"sem.{self.shm_prefix}*"):
            for entry in Path("/dev/shm").glob(pattern):
                entry.unlink(missing_ok=True)
        self.socket_path.unlink(missing_ok=True)


def remove_stale_segments() -> list[str]:
    """Unlink segments and sockets of earlier runs whose process is gone (killed before close())."""
    removed = []
    for entry in [
        *Path("/dev/shm").glob("tkbench*"),
        *Path("/dev/shm").glob("sem.tkbench*"),
        *Path("/tmp").glob("tokcache-bench-*.sock"),
    ]:
        m = re.search(r"(?:tkbench|tokcache-bench-)(\d+)-", entry.name)
        if m is None or int(m.group(1)) == os.getpid() or Path(f"/proc/{m.group(1)}").exists():
            continue
        entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return removed


def _find_used_bytes(data: Any) -> int | None:
    """``used_bytes`` from the stats JSON: top level, or summed over nested segments."""
    if isinstance(data, dict):
        if isinstance(data.get("used_bytes"), int):
            return int(data["used_bytes"])
        found = [_find_used_bytes(v) for v in data.values()]
    elif isinstance(data, list):
        found = [_find_used_bytes(v) for v in data]
    else:
        return None
    vals = [v for v in found if v is not None]
    return sum(vals) if vals else None


class TokcacheFloor(Contender):
    """A 1-token Tokenize on the same RPC client (so over the same stream): tokcache's transport
    floor, the counterpart of SMG's 1-token ``/v1/tokenize``. Its text is an L0 hit after
    the first call, so the sidecar's own work in it is a few microseconds."""

    name = "tokcache-rpc-floor"
    label = "tokcache RPC floor (1-token Tokenize, same client)"
    checked = False

    def __init__(self, tokcache: TokcacheContender) -> None:
        self._tc = tokcache
        self._call: Any = None

    def start(self) -> None:
        client = self._tc._client
        self._call = lambda: client.tokenize(model=TOKCACHE_MODEL, text="hi", add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        self._call()
        return []

    # close: the base class's no-op; the client is the tokcache contender's, closed with it.
