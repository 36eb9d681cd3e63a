"""``make demo``: a sidecar on the bundled Qwen3 tokenizer, replaying an agent conversation.

Starts ``tokcache-sidecar serve`` on a temporary unix socket (and its own
shared-memory prefix), sends a growing multi-turn conversation turn by turn
as chat messages, and prints each turn's cache decision and latency next to
in-process tokenization (render + HF ``tokenizers``, what vLLM does by
default), checking the ids are identical. Then stops the sidecar and removes
its shared memory.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tokcache.sidecar.bundled import qwen3_dir

TOOLS = [{
    "type": "function",
    "function": {
        "name": "run_shell",
        "description": "Run a shell command in the repository and return its output.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    },
}, {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}]

_FILE = '''def parse(line: str) -> dict[str, int]:
    """Parse 'key=value' pairs."""
    out = {}
    for part in line.split(","):
        key, _, value = part.partition("=")
        out[key.strip()] = int(value)   # BUG: fails on empty values
    return out
'''


def conversation(turns: int = 8) -> list[list[dict[str, Any]]]:
    """The message list sent at each turn (each turn extends the previous one)."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful coding agent. Use tools; answer briefly."},
        {"role": "user", "content": "The parser crashes on `a=1,,b=2`. Find and fix the bug.\n\n日志: 解析失败 🐛"},
    ]
    out = [list(msgs)]
    for t in range(1, turns):
        if t % 2:
            msgs.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": f"call_{t}", "type": "function",
                "function": {"name": "read_file" if t % 4 == 1 else "run_shell",
                             "arguments": json.dumps({"path": "parser.py"} if t % 4 == 1
                                                     else {"cmd": f"pytest -q -k parse_{t}"})}}]})
            failure = "    ValueError: invalid literal for int() with base 10: ''"
            result = _FILE if t % 4 == 1 else f"F.{'.' * t}\n{failure}\n\n{t} passed, 1 failed  "
            msgs.append({"role": "tool", "tool_call_id": f"call_{t}", "content": result})
        else:
            msgs.append({"role": "assistant",
                         "content": f"Step {t}: empty values reach `int()`.\n\n"
                                    "```python\n    if not value:\n        continue\n```\n"})
            msgs.append({"role": "user", "content": f"Good. Now run the tests again (round {t})."})
        out.append(list(msgs))
    return out


def _wait_for_socket(path: Path, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"sidecar exited with {proc.returncode}")
        if path.exists():
            return
        time.sleep(0.05)
    raise SystemExit("sidecar did not start in time")


def main() -> int:
    import tokenizers

    from sidecar_client import SidecarClient, SidecarUnavailable
    from tokcache.sidecar.engine.render import ChatRenderer

    model_dir = qwen3_dir()
    tmp = Path(tempfile.mkdtemp(prefix="tokcache-demo-"))
    sock = tmp / "tokcache.sock"
    prefix = f"tokcache-demo-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "tokcache.sidecar.cli", "serve", "--listen", f"unix://{sock}",
           "--model", f"qwen3={model_dir}", "--shm-size", "64MiB", "--shm-prefix", prefix]
    print(f"$ tokcache-sidecar serve --listen unix://{sock} --model qwen3={model_dir} --shm-size 64MiB")
    log = (tmp / "sidecar.log").open("wb")
    proc = subprocess.Popen(cmd, stderr=log)
    try:
        _wait_for_socket(sock, proc)
        renderer = ChatRenderer.from_dir(model_dir)
        assert renderer is not None
        reference = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        with SidecarClient(f"unix://{sock}") as client:
            t0 = time.monotonic()
            while True:  # ready once the tokenizers are loaded
                try:
                    models = client.list_models()
                    if models:
                        break
                except SidecarUnavailable:
                    pass
                if time.monotonic() - t0 > 60:
                    raise SystemExit("sidecar not ready after 60 s")
                time.sleep(0.1)
            m = models[0]
            print(f"model {m.name}: fingerprint {m.fingerprint}, backend {m.backend}, "
                  f"{m.boundary_tokens} boundary tokens\n")
            print(f"{'turn':>4} {'chars':>6} {'tokens':>6}  {'source':<6} {'cached':>6} {'encoded':>7}  "
                  f"{'sidecar µs':>10} {'in-process µs':>13}  ids")
            for turn, messages in enumerate(conversation(), 1):
                t0 = time.perf_counter()
                r = client.tokenize("qwen3", messages=messages, tools=TOOLS, add_generation_prompt=True)
                sidecar_us = (time.perf_counter() - t0) * 1e6
                t0 = time.perf_counter()
                text = renderer.render(messages, tools=TOOLS, add_generation_prompt=True)
                ref = reference.encode(text, add_special_tokens=False).ids
                local_us = (time.perf_counter() - t0) * 1e6
                same = "identical" if r.token_ids == ref else "MISMATCH"
                d = r.decision
                print(f"{turn:>4} {len(text):>6} {len(ref):>6}  {d.source:<6} {d.cached_tokens:>6} "
                      f"{d.encoded_chars:>7}  {sidecar_us:>10.0f} {local_us:>13.0f}  {same}")
                if same != "identical":
                    return 1
            # The same conversation again: every turn is now an exact (L0) hit.
            r = client.tokenize("qwen3", messages=conversation()[-1], tools=TOOLS, add_generation_prompt=True)
            print(f"\nreplaying the last turn: source {r.decision.source}, "
                  f"{r.decision.cached_tokens} of {len(r.token_ids)} tokens from the cache")
        return 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        for entry in Path("/dev/shm").glob(f"{prefix}*"):
            entry.unlink(missing_ok=True)
        for entry in Path("/dev/shm").glob(f"sem.{prefix}*"):
            entry.unlink(missing_ok=True)
        log.close()
        if proc.returncode not in (0, -signal.SIGTERM):
            sys.stderr.write((tmp / "sidecar.log").read_text(errors="replace")[-4000:])
        shutil.rmtree(tmp, ignore_errors=True)
        print("\nsidecar stopped, shared memory removed")


if __name__ == "__main__":
    sys.exit(main())
