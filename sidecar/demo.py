"""``make demo``: the problem tokcache solves and the fix, in one run, on the bundled Qwen3 tokenizer.

An agent loop sends the whole conversation back every turn. The model's answers come back
as text; re-tokenizing them rarely gives the ids the model generated ("\\n\\n" generated as
two ``\\n`` tokens re-encodes as one), so vLLM's prefix cache — keyed by token ids — stops
matching at the first such answer and prefills the rest again, every turn.

The demo starts a real ``tokcache-sidecar`` on a temporary socket and replays an agent
conversation. At every turn a stand-in for the model answers: the answer's canonical ids
with every multi-byte token split into two vocabulary tokens (valid ids that decode to the
text, but not what BPE picks), and the answer is recorded (RecordOutput). A trained model
generates most tokens as BPE would, so its answers re-encode differently from their first
non-canonical token on, later or not at all: the stand-in is the worst case for vLLM alone.
The next turn's prompt is then tokenized two ways:

- as vLLM does by default: render, then ``tokenizers`` (canonical ids);
- with tokcache's client (``sidecar_client.SidecarClient``, reading the sidecar's shared
  memory in this process): the recorded ids come back spliced in.

For each turn it prints how much of the prompt vLLM's prefix cache could reuse (the
longest common prefix with the previous prompt + generated ids, in whole KV blocks), the
cache's decision, and the tokenization latency of both, then stops the sidecar and
removes its shared memory.
"""

from __future__ import annotations

import shlex
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

BLOCK = 16  # tokens per KV block (vLLM's default block size on GPUs)
TOOLS = [{
    "type": "function",
    "function": {
        "name": "run_shell",
        "description": "Run a shell command in the repository and return its output.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    },
}]

ANSWERS = [
    "Let me look at the parser first.\n\n```python\ndef parse(line: str) -> dict[str, int]:\n    out = {}\n"
    "    for part in line.split(\",\"):\n        key, _, value = part.partition(\"=\")\n"
    "        out[key.strip()] = int(value)\n    return out\n```\n\nThe loop calls `int()` on every value, "
    "including the empty one between the two commas.",
    "The bug: empty values reach `int()`.\n\n```python\n    for part in line.split(\",\"):\n"
    "        key, _, value = part.partition(\"=\")\n        if not value:\n            continue\n"
    "        out[key.strip()] = int(value)\n```\n\nI also added a test:\n\n```python\n"
    "def test_empty_value() -> None:\n    assert parse(\"a=1,,b=2\") == {\"a\": 1, \"b\": 2}\n```",
    "All 12 tests pass now.\n\n- fixed `parse()` to skip empty values\n- added `test_empty_value`\n"
    "- no other caller depends on the old behaviour\n\n```\n$ pytest -q\n............  [100%]\n"
    "12 passed in 0.31s\n```\n\nAnything else?",
    "Done: the changelog has a new entry.\n\n```markdown\n## 1.4.1\n\n### Fixed\n\n"
    "- `parse()` no longer crashes on empty values (`a=1,,b=2`).\n```\n\n日志已更新 ✅ Shall I open a PR?",
    "PR #42 is open.\n\n  Title: \"parser: skip empty values\"\n  Branch: fix/parser-empty-values\n\n"
    "CI is green:\n\n| job | result |\n| --- | --- |\n| lint | ok |\n| tests | 12 passed |\n",
]
QUESTIONS = [
    "The parser crashes on `a=1,,b=2`. Find and fix the bug.",
    "Good. Show me the fix.",
    "Run the whole suite, please.",
    "Update the changelog too.",
    "Open a pull request.",
]


def model_ids(text: str, encode: Any, token_bytes: dict[int, bytes], specials: set[int]) -> list[int]:
    """The stand-in model's ids for ``text``: valid (they decode to it), never BPE's where avoidable.

    Models emit one token at a time and sometimes pick two shorter tokens where BPE has one
    (newlines, spaces before words). The stand-in does it for every multi-byte canonical token
    that has a split into two vocabulary tokens, so an answer's re-encoding differs from its
    first multi-byte token on; a trained model's differs from its first such choice, if any.
    """
    reverse = {b: i for i, b in token_bytes.items() if i not in specials}
    out: list[int] = []
    for tok in encode(text):
        b = token_bytes[tok]
        split = next(([reverse[b[:k]], reverse[b[k:]]] for k in range(1, len(b))
                      if b[:k] in reverse and b[k:] in reverse), None) if len(b) >= 2 else None
        out += split or [tok]
    return out


def _wait_ready(client: Any, proc: subprocess.Popen[bytes], timeout: float = 90.0) -> Any:
    from sidecar_client import SidecarUnavailable

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"sidecar exited with {proc.returncode}")
        try:
            models = client.list_models()
            if models:
                return models[0]
        except SidecarUnavailable:
            pass
        time.sleep(0.1)
    raise SystemExit(f"sidecar not ready after {timeout:.0f} s")


def main() -> int:
    import tokenizers

    from sidecar_client import SidecarClient
    from tokcache.engine.tokenbytes import TokenBytes
    from tokcache.ids import common_prefix
    from tokcache.sidecar.engine.render import ChatRenderer

    model_dir = qwen3_dir()
    tmp = Path(tempfile.mkdtemp(prefix="tokcache-demo-"))
    sock = tmp / "tokcache.sock"
    prefix = f"tokcache-demo-{uuid.uuid4().hex[:8]}"
    args = ["serve", "--listen", f"unix://{sock}", "--model", f"qwen3={model_dir}", "--shm-size", "64MiB",
            "--shm-prefix", prefix]
    print("$ tokcache-sidecar " + shlex.join(args))
    log = (tmp / "sidecar.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "tokcache.sidecar.cli", *args], stderr=log)
    try:
        renderer = ChatRenderer.from_dir(model_dir)
        assert renderer is not None
        reference = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        token_bytes = TokenBytes.from_tokenizer_json(model_dir / "tokenizer.json")
        assert token_bytes is not None  # Qwen3's byte-level BPE has a byte table
        table = token_bytes._table
        specials = {i for i, t in reference.get_added_tokens_decoder().items() if t.special}

        def encode(text: str) -> list[int]:
            return list(reference.encode(text, add_special_tokens=False).ids)

        with SidecarClient(f"unix://{sock}") as client:
            m = _wait_ready(client, proc)
            t0 = time.perf_counter()
            client.tokenize("qwen3", text="warm up")  # maps the segment, loads the encoder: once
            print(f"model {m.name}: tokenizer fingerprint {m.fingerprint}, encoder {m.backend}, "
                  f"{m.boundary_tokens} boundary tokens\nclient: reads segment {m.shm_name} in this process "
                  f"(attached in {(time.perf_counter() - t0) * 1000:.0f} ms)")
            print("answers: a stand-in for the model, every multi-byte token split in two (valid ids, not BPE's);\n"
                  "a trained model generates most tokens as BPE would, so the 'vLLM alone' column is a worst case.\n")
            print(f"{'turn':>4} {'prompt':>7} {'prefilled':>10} {'prefilled':>10}  {'decision':<8} {'from cache':>10} "
                  f"{'encoded':>8} {'tokcache':>9} {'tokenizers':>10}  ids")
            print(f"{'':>4} {'':>7} {'vLLM alone':>10} {'tokcache':>10}  {'':<8} {'':>10} {'':>8} {'':>9} "
                  f"{'(vLLM)':>10}")
            print(f"{'':>4} {'tokens':>7} {'tokens':>10} {'tokens':>10}  {'':<8} {'tokens':>10} {'chars':>8} "
                  f"{'µs':>9} {'µs':>10}")
            messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful coding agent."}]
            held_alone: list[int] | None = None  # the ids vLLM holds KV for after the last turn
            held_tc: list[int] | None = None
            totals = {"alone": 0, "tc": 0}
            for turn, (question, answer) in enumerate(zip(QUESTIONS, ANSWERS, strict=True), 1):
                messages.append({"role": "user", "content": question})
                text = renderer.render(messages, tools=TOOLS, add_generation_prompt=True)
                t0 = time.perf_counter()
                canonical = encode(text)
                plain_us = (time.perf_counter() - t0) * 1e6
                t0 = time.perf_counter()
                r = client.tokenize("qwen3", text=text, add_special_tokens=False)
                tc_us = (time.perf_counter() - t0) * 1e6
                ids = r.token_ids

                def prefilled(prompt: list[int], held: list[int] | None) -> int:
                    reused = 0 if held is None else common_prefix(prompt, held) // BLOCK * BLOCK
                    return len(prompt) - reused

                alone, tc = prefilled(canonical, held_alone), prefilled(ids, held_tc)
                if turn > 1:
                    totals["alone"] += alone
                    totals["tc"] += tc
                d = r.decision
                check = "canonical" if ids == canonical else "model's own"
                print(f"{turn:>4} {len(ids):>7} {alone:>10} {tc:>10}  {d.source:<8} {d.cached_tokens:>10} "
                      f"{d.encoded_chars:>8} {tc_us:>9.0f} {plain_us:>10.0f}  {check}")
                # The model answers; vLLM then holds KV for the prompt + the generated ids.
                generated = model_ids(answer, encode, table, specials)
                held_alone = canonical + generated
                held_tc = ids + generated
                client.record_output("qwen3", prompt_text=text, prompt_token_ids=ids, output_text=answer,
                                     output_token_ids=[*generated, 151645])  # + <|im_end|> (EOS)
                messages.append({"role": "assistant", "content": answer})
            print(f"\nturns 2-{len(QUESTIONS)}: vLLM prefills {totals['alone']} prompt tokens alone, "
                  f"{totals['tc']} with tokcache ({totals['alone'] / max(1, totals['tc']):.1f}x fewer)")
            print(f"prefilled = prompt tokens past the longest prefix vLLM still holds KV for (the previous prompt "
                  f"+ the ids the model generated), in {BLOCK}-token blocks.\nvLLM alone re-tokenizes the "
                  f"model's last answer into other ids, so the KV from there on is prefilled again\n(here from the "
                  f"answer's start; with a trained model from its first non-canonical token, if any); with "
                  f"tokcache the recorded ids come back (decision 'ar') and only the new messages are prefilled.")
            stats = client.stats()
            print(f"client: {stats['tokenize']} decided in this process, {sum(stats['fallbacks'].values())} over "
                  f"RPC; their writes {stats['writes']}")
        return 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        for entry in [*Path("/dev/shm").glob(f"{prefix}*"), *Path("/dev/shm").glob(f"sem.{prefix}*")]:
            entry.unlink(missing_ok=True)
        log.close()
        if proc.returncode not in (0, -signal.SIGTERM):
            sys.stderr.write((tmp / "sidecar.log").read_text(errors="replace")[-4000:])
        shutil.rmtree(tmp, ignore_errors=True)
        print("\nsidecar stopped, shared memory removed")


if __name__ == "__main__":
    sys.exit(main())
