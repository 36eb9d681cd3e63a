"""Prefix-cache reuse across multi-turn agent conversations: baseline vs tokcache vs the limit.

    python bench/prefix_reuse.py            # 3 conversations x 12 turns
    python bench/prefix_reuse.py --quick    # 1 x 5 (tests)
    python bench/prefix_reuse.py --tokcache-mode exact   # negative control: tokcache == baseline
    python bench/prefix_reuse.py --no-think              # a template that rewrites history

**Conversations.** Deterministic coding-agent chats (own generator, below): a system prompt, four
tool definitions, a user task (English or Chinese), then per turn one assistant answer and what
follows it: tool results (JSON with indentation, numbered source files, pytest logs with
whitespace runs, CJK docs) after a tool call, or a user follow-up after a prose answer. Answers are
plain-text ``content``: prose with ``"\\n\\n"`` paragraphs, numbers, fenced code with indentation,
aligned tables, CJK and emoji, and tool calls written as Qwen3 emits them
(``<tool_call>\\n{json}\\n</tool_call>``), not ``tool_calls``. Rendered with Qwen3's template
through transformers ``apply_chat_template(add_generation_prompt=True)``, default template
kwargs, and the model answers *without* a ``<think>`` block: Qwen3's template then re-renders
every earlier assistant answer verbatim, so turn ``t+1``'s text is an exact string extension of
turn ``t``'s prompt text + answer. (``--no-think`` passes ``enable_thinking=False`` instead:
the generation prompt then ends in an empty ``<think></think>`` block that history drops, a
template rewrite that stops any prefix cache at the last assistant header. There the re-rendered
answer can be spelled canonically or with its generated ids - the same text is reused either way,
but token counts differ, so the token ratio then also measures whether tokcache splices the
generated ids at the rewritten position (segment AR); the ``tc/limit text`` column gives the
ratio in text bytes.)

**Generated ids** come from :mod:`bench.ar_emulator`: the canonical ids of the answer with a
share ``rate`` of tokens re-segmented (split / re-cut, decode-exact), then Qwen3's EOS
``<|im_end|>``. Every path sees the same generated ids for the same (conversation, turn, rate).

**Paths**, one simulated engine (:class:`bench.prefix_cache_model.PrefixCache`) each per
(conversation, rate, block size); each turn the engine looks up the prompt, then caches
``prompt + generated[:-1]``:

- ``baseline``: prompt ids = ``tokenizers`` ``encode(render(messages))`` (no special tokens added),
  what vLLM does today.
- ``tokcache``: a real sidecar process; ``Tokenize(messages, kv-stable)`` then ``RecordOutput``
  with the generated ids, every turn, one ``cache_salt`` per (conversation, rate).
- ``limit``: an oracle tokenizer. The engine holds KV for ``S_i = P_i + A_i`` (prompt, answer ids
  without EOS) of every earlier turn ``i``. The oracle prompt of turn ``t`` is built as
  ``S_j[:k] + splice(T_t[text(S_j[:k]):])`` with ``(j, k)`` maximising ``k`` over held sequences
  such that the bytes of ``S_j[:k]`` are a prefix of ``T_t``'s bytes (ending on a character
  boundary) - i.e. it keeps every token the engine holds that still spells a prefix of the new
  text (when ``T_t`` extends ``T_{t-1} + answer_{t-1}``, that is all of ``S_{t-1}``), and
  ``splice`` encodes the rest canonically except that every earlier answer text in it is spelled
  with that answer's generated ids. The limit is the reuse of this oracle's own engine under the
  same vLLM rules. It is an upper bound for any path: KV reuse is a token prefix of a held
  sequence, a held sequence spells the conversation's text, and on any stretch of text the
  oracle's tokens are at least as many (canonical ids, plus the generated ids - canonical ids
  with extra splits - for answers) as a path that uses canonical or generated ids. The run checks
  it turn by turn and fails if a path ever beats it.

Reused tokens are summed over turns >= 2 (turn 1 meets an empty cache). The table shows
tokcache/limit and baseline/limit (the target: tokcache >= 99.9 % of the limit at every rate), the
tokcache ratio in text bytes spelled by the reused tokens, and the prompt tokens each path prefills
beyond what the limit prefills.
Also checked: the sidecar's prompt text equals transformers' render, its ids decode to that text,
at rate 0 they equal the canonical ids, and no record is refused. Exit status 1 if a check or the
target fails. Writes ``bench/out/prefix_reuse.json`` and ``bench/out/prefix_reuse.png``
(reused share per turn, one panel per rate, block 16). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
for _p in (ROOT / "client",):
    if _p.is_dir() and str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.ar_emulator import AREmulator, Emulated  # noqa: E402
from bench.prefix_cache_model import PrefixCache  # noqa: E402
from tokcache.ids import common_prefix  # noqa: E402

RATES = (0.0, 0.001, 0.01, 0.05)
BLOCK_SIZES = (16, 128)
PATHS = ("baseline", "tokcache", "limit")
TARGET = 0.999
MODEL = "qwen3"
QWEN3_EOS = 151645  # <|im_end|>

Message = dict[str, Any]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------------------------

SYSTEM_PROMPT = (
    "You are Forge, a software engineering agent working in a checkout of the user's repository "
    "at /workspace/repo. Read before you edit, keep diffs minimal, run the narrowest tests after "
    "each change and the full suite before you finish.\n\n"
    "To call a tool, write the call in a <tool_call></tool_call> block. Answer in the user's "
    "language, in Markdown, with code in fenced blocks."
)


def _tool(name: str, desc: str, props: dict[str, Any], required: list[str]) -> Message:
    return {"type": "function", "function": {"name": name, "description": desc,
            "parameters": {"type": "object", "properties": props, "required": required}}}


TOOLS: list[Message] = [
    _tool("read_file", "Read a file; returns numbered lines.",
          {"path": {"type": "string"}, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
          ["path"]),
    _tool("edit_file", "Replace one exact occurrence of old_str with new_str.",
          {"path": {"type": "string"}, "old_str": {"type": "string"}, "new_str": {"type": "string"}},
          ["path", "old_str", "new_str"]),
    _tool("search_code", "Regex search over the repository; returns JSON matches.",
          {"query": {"type": "string"}, "max_results": {"type": "integer", "default": 20}}, ["query"]),
    _tool("run_shell", "Run a shell command in the repository root.",
          {"command": {"type": "string"}, "timeout_s": {"type": "integer", "default": 60}}, ["command"]),
]

_MODULES = ["auth", "billing", "cache", "scheduler", "storage", "metrics"]
_NOUNS = ["token", "session", "invoice", "batch", "window", "quota", "lease", "bucket", "segment"]
_VERBS = ["load", "parse", "validate", "flush", "merge", "refresh", "compute", "evict", "apply"]
_ERRORS = ["KeyError: 'expires_at'", "AssertionError: assert 3 == 4",
           "TypeError: unsupported operand type(s) for +: 'NoneType' and 'int'",
           "TimeoutError: lease not acquired within 5.0s"]
_EN_TASKS = ["The {m} tests fail since yesterday's refactor with `{e}`. Find the cause and fix it "
             "without changing the public API.",
             "Add a `{v}_{n}` helper to the {m} module that handles empty input, with tests.",
             "Our {m} code recomputes the {n} on every call; add an LRU cache and keep invalidation "
             "correct."]
_ZH_TASKS = ["请帮我看一下 {m} 模块：测试一直报错 `{e}`，找到原因并修复，不要改公共接口。🙏",
             "{m} 的性能太差了 😩 每次请求都重新计算 {n}，请加缓存并确认失效逻辑正确。"]
_FOLLOWUPS = ["Thanks! Now also handle the case where the {n} is missing entirely.",
              "Looks good. Add a regression test for `{e}` so it doesn't come back.",
              "好的 👍 再帮我把 {m} 里的注释改成英文，保持格式不变。",
              "Run the whole suite once more and show me the summary table."]
_ZH_LINES = ["这个函数在并发场景下不安全：两个线程可能同时刷新同一个 {n}。",
             "我把缓存键改成了（用户，{n}）二元组，失效时一起删除。✅",
             "测试全部通过，耗时 {f} 秒，没有新增警告。",
             "注意：旧版本的数据格式里没有 `expires_at` 字段，需要兼容。"]


class _Gen:
    """All content of one conversation, from one ``random.Random``."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.m = self.r.choice(_MODULES)
        self.zh = seed % 3 == 1  # one conversation in three is in Chinese

    def fmt(self, s: str) -> str:
        r = self.r
        return s.format(m=self.m, n=r.choice(_NOUNS), v=r.choice(_VERBS), e=r.choice(_ERRORS),
                        f=f"{r.uniform(0.2, 40):.2f}")

    def ident(self) -> str:
        return f"{self.r.choice(_VERBS)}_{self.r.choice(_NOUNS)}"

    def code(self, funcs: int = 2) -> str:
        r = self.r
        out: list[str] = []
        for _ in range(funcs):
            name, arg = self.ident(), r.choice(_NOUNS)
            lines = [f"def {name}({arg}: dict[str, int], limit: int = {r.choice([8, 64, 100, 1024])}) -> list[str]:",
                     f'    """{r.choice(_VERBS).capitalize()} the {arg} and return the keys over the limit."""',
                     "    out: list[str] = []",
                     f"    for key, value in sorted({arg}.items()):",
                     "        if value is None:",
                     "            continue",
                     f"        if value > limit * {r.randint(2, 9)}:",
                     f"            out.append(f\"{{key}}={{value:>{r.choice([4, 6, 8])}}}\")",
                     "        elif key.startswith(\"_\"):",
                     f"            raise ValueError(f\"private key {{key!r}} in {arg}\")"]
            if self.zh and r.random() < 0.6:
                lines.insert(3, "    " + r.choice(["# 计算缓存键：同一个用户必须落在同一个桶里",
                                                   "# 注意：不能持有锁去做网络请求 ⚠️"]))
            lines.append("    return out")
            if r.random() < 0.5:
                lines += ["", "", f"{name.upper()}_TIMEOUT = {r.uniform(0.5, 30):.1f}  # seconds"]
            out.append("\n".join(lines))
        return "\n\n\n".join(out)

    def tool_call(self) -> tuple[str, str]:
        """(answer text with a tool call, tool name)."""
        r = self.r
        name = r.choice(["read_file", "edit_file", "edit_file", "search_code", "run_shell", "run_shell"])
        path = f"src/{self.m}/{r.choice(['service', 'models', 'store', 'utils'])}.py"
        if name == "read_file":
            args: dict[str, Any] = {"path": path, "start_line": r.randint(1, 200), "end_line": r.randint(220, 480)}
        elif name == "edit_file":
            body = self.code(1)
            lines = body.splitlines()
            args = {"path": path, "old_str": "\n".join(lines[:2]),
                    "new_str": body.replace("continue", "out.append(key)\n            continue")}
        elif name == "search_code":
            args = {"query": rf"def {r.choice(_VERBS)}_\w+\(", "max_results": r.choice([10, 20, 50])}
        else:
            args = {"command": r.choice([f"pytest -q tests/{self.m} -k {r.choice(_NOUNS)}",
                                         f"python -m mypy src/{self.m} --strict",
                                         f"git diff --stat && git log -n {r.randint(2, 9)} --oneline"]),
                    "timeout_s": r.choice([60, 120, 300])}
        lead = r.choice([f"Let me look at `{path}` first.", "I'll run the tests to confirm.",
                         f"The error points at line {r.randint(10, 400)}; checking it now.",
                         "先看看相关代码。", "好的，我先运行测试确认问题。"] if self.zh else
                        [f"Let me look at `{path}` first.", "I'll run the tests to confirm.",
                         f"The error points at line {r.randint(10, 400)}; checking it now.",
                         f"Two candidates: `{self.ident()}` and `{self.ident()}`. Searching."])
        call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        return f"{lead}\n\n<tool_call>\n{call}\n</tool_call>", name

    def tool_result(self, name: str) -> str:
        r = self.r
        if name == "read_file":
            start = r.randint(1, 300)
            src = self.code(r.randint(2, 3)).splitlines()
            return "\n".join(f"{start + i:>6}\t{line}" for i, line in enumerate(src))
        if name == "search_code":
            hits = [{"path": f"src/{r.choice(_MODULES)}/{r.choice(['service', 'store'])}.py",
                     "line": r.randint(1, 900), "text": f"def {self.ident()}(self, {r.choice(_NOUNS)}):"}
                    for _ in range(r.randint(3, 8))]
            return json.dumps({"matches": hits, "truncated": False, "elapsed_ms": r.randint(3, 90)},
                              indent=2, ensure_ascii=False)
        if name == "edit_file":
            return json.dumps({"ok": True, "replacements": 1, "diff": "@@ -12,3 +12,4 @@\n-            continue\n"
                               "+            out.append(key)\n+            continue"}, indent=2)
        # run_shell: a pytest-like report with aligned columns and whitespace runs
        tests = [f"tests/{self.m}/test_{self.ident()}.py::test_{self.ident()}" for _ in range(r.randint(4, 9))]
        width = max(len(t) for t in tests) + 2
        status = ["PASSED", "PASSED", "PASSED", "FAILED"]
        lines = [f"{t:<{width}}{r.choice(status):>8}  [{(i + 1) * 100 // len(tests):>3}%]"
                 for i, t in enumerate(tests)]
        summary = f" {r.randint(1, 3)} failed, {len(tests)} passed in {r.uniform(0.3, 9):.2f}s "
        tail = "\n".join(lines) + "\n\n" + "=" * 20 + summary + "=" * 20
        if self.zh and r.random() < 0.5:
            tail += "\n\n" + self.fmt(r.choice(_ZH_LINES))
        return json.dumps({"exit_code": r.choice([0, 1]), "stdout": tail, "stderr": ""}, indent=2, ensure_ascii=False)

    def prose_answer(self) -> str:
        r = self.r
        parts = [r.choice(["I found the problem.", "Done — here is what changed.", "修好了，原因如下。"]
                          if self.zh else ["I found the problem.", "Done — here is what changed.",
                                           "Here is a summary of the investigation."])]
        parts.append(f"The `{self.ident()}` path read `{r.choice(_NOUNS)}.expires_at` before the "
                     f"{r.choice(_NOUNS)} was loaded, so {r.randint(2, 12)} of {r.randint(40, 1200)} "
                     f"requests ({r.uniform(0.1, 9.9):.1f}%) failed with `{r.choice(_ERRORS)}`.")
        if self.zh:
            parts.append(self.fmt(r.choice(_ZH_LINES)) + "\n" + self.fmt(r.choice(_ZH_LINES)))
        parts.append(f"```python\n{self.code(r.randint(1, 2))}\n```")
        rows = [(f"test_{self.ident()}", r.choice(["passed", "failed", "skipped"]), f"{r.uniform(0.01, 12):.2f}s")
                for _ in range(r.randint(3, 6))]
        w = max(len(a) for a, _, _ in rows)
        table = "\n".join(f"| {a:<{w}} | {b:<7} | {c:>7} |" for a, b, c in rows)
        parts.append(f"| {'test':<{w}} | {'result':<7} | {'time':>7} |\n|{'-' * (w + 2)}|---------|---------|\n{table}")
        cfg = {"module": self.m, "cache": {"max_entries": r.choice([128, 1024, 4096]), "ttl_s": r.randint(30, 900)},
               "retries": [r.randint(1, 5) for _ in range(3)]}
        parts.append("Config used:\n\n```json\n" + json.dumps(cfg, indent=2) + "\n```")
        parts.append(r.choice(["Verified with `pytest -q`: all green. 🎉", "测试全部通过 ✅",
                               f"Next step: run the {r.randint(3, 40)} slow tests nightly."]))
        return "\n\n".join(parts)


@dataclass
class Conversation:
    """``prompts_messages[t]`` is what turn ``t+1`` sends; ``answers[t]`` what the model says."""

    seed: int
    tools: list[Message]
    prompt_messages: list[list[Message]]
    answers: list[str]
    kinds: list[str] = field(default_factory=list)  # "call" | "answer"


def make_conversation(seed: int, turns: int) -> Conversation:
    g = _Gen(seed)
    msgs: list[Message] = [{"role": "system", "content": SYSTEM_PROMPT},
                           {"role": "user", "content": g.fmt(g.r.choice(_ZH_TASKS if g.zh else _EN_TASKS))}]
    prompts, answers, kinds = [], [], []
    for t in range(turns):
        prompts.append([dict(m) for m in msgs])
        if t > 0 and g.r.random() < 0.3:
            answer, nxt = g.prose_answer(), [{"role": "user", "content": g.fmt(g.r.choice(_FOLLOWUPS))}]
            kinds.append("answer")
        else:
            answer, name = g.tool_call()
            nxt = [{"role": "tool", "content": g.tool_result(name)}]
            kinds.append("call")
        answers.append(answer)
        msgs = msgs + [{"role": "assistant", "content": answer}] + nxt
    return Conversation(seed, TOOLS, prompts, answers, kinds)


# ---------------------------------------------------------------------------------------------
# Tokenizer helpers
# ---------------------------------------------------------------------------------------------


class Qwen3:
    """transformers' renderer + ``tokenizers`` encoder on the bundled Qwen3 directory."""

    def __init__(self, directory: Path, template_kwargs: dict[str, Any]) -> None:
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer

        self.dir = directory
        self.hf = AutoTokenizer.from_pretrained(str(directory))
        self.tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.template_kwargs = template_kwargs
        self.emulator = AREmulator(self.tok, eos_id=QWEN3_EOS)
        self._tbytes: dict[int, bytes] = {}

    def render(self, messages: Sequence[Message], tools: Sequence[Message]) -> str:
        text = self.hf.apply_chat_template(list(messages), tools=list(tools), add_generation_prompt=True,
                                           tokenize=False, **self.template_kwargs)
        assert isinstance(text, str)
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=False))

    def tbytes(self, tid: int) -> bytes:
        """The bytes a token spells (added tokens: their content)."""
        b = self._tbytes.get(tid)
        if b is None:
            b = self.emulator.token_bytes(tid)
            if b is None:
                b = (self.tok.id_to_token(tid) or "").encode()
            self._tbytes[tid] = b
        return b

    def encode_spliced(self, text: str, known: Sequence[tuple[str, list[int]]]) -> list[int]:
        """Canonical ids of ``text``, except that known answer texts are spelled with their ids."""
        out: list[int] = []
        pos = 0
        while pos < len(text):
            best: tuple[int, str, list[int]] | None = None
            for ans, ids in known:
                i = text.find(ans, pos)
                if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(ans) > len(best[1]))):
                    best = (i, ans, ids)
            if best is None:
                out += self.encode(text[pos:])
                break
            i, ans, ids = best
            if i > pos:
                out += self.encode(text[pos:i])
            out += ids
            pos = i + len(ans)
        return out


# ---------------------------------------------------------------------------------------------
# The tokcache sidecar
# ---------------------------------------------------------------------------------------------


class Sidecar:
    """``python -m tokcache.sidecar.cli serve`` on a private unix socket and shm prefix."""

    def __init__(self, model_dir: Path) -> None:
        uid = f"pr{os.getpid()}x{int(time.time() * 1000) % 10**8}"
        self.prefix = f"tcbench-{uid}"
        self.tmp = Path(tempfile.mkdtemp(prefix="tokcache-bench-"))
        self.sock = Path(f"/tmp/{self.prefix}.sock")
        self.address = f"unix://{self.sock}"
        self.log_path = self.tmp / "sidecar.log"
        self.cmd = [sys.executable, "-m", "tokcache.sidecar.cli", "serve", "--listen", self.address,
                    "--model", f"{MODEL}={model_dir}", "--shm-size", "256MiB", "--shm-prefix", self.prefix]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> None:
        from sidecar_client import SidecarClient, SidecarUnavailable

        env = dict(os.environ)
        paths = (str(ROOT), str(ROOT / "client"), env.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        with self.log_path.open("ab") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=f, env=env, cwd=str(ROOT))
        deadline = time.monotonic() + timeout
        with SidecarClient(self.address, timeout=2) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sidecar exited {self.proc.returncode}:\n{self.log()}")
                if self.sock.exists():
                    try:
                        if c.list_models():
                            return
                    except SidecarUnavailable:
                        pass
                time.sleep(0.1)
        raise RuntimeError(f"sidecar not ready in {timeout:.0f}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.returncode in (0, -signal.SIGTERM):
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            log(f"sidecar log kept: {self.log_path}")
        shm = Path("/dev/shm")
        if shm.is_dir():
            for p in list(shm.glob(f"{self.prefix}*")) + list(shm.glob(f"sem.{self.prefix}*")):
                try:
                    p.unlink()
                except OSError:
                    pass
        for p in (self.sock,):
            try:
                p.unlink()
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# The replay
# ---------------------------------------------------------------------------------------------


@dataclass
class TurnIds:
    prompt: list[int]
    gen: list[int]


@dataclass
class Replay:
    """Per path, the prompt/generated ids of every turn of one (conversation, rate)."""

    conv: int
    rate: float
    paths: dict[str, list[TurnIds]] = field(default_factory=dict)
    sources: Counter[str] = field(default_factory=Counter)
    ar_spliced: int = 0
    refusals: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    oracle_diffs: list[dict[str, Any]] = field(default_factory=list)  # turns where tokcache != oracle ids


def oracle_prompt(q: Qwen3, text: str, held: Sequence[tuple[list[int], str]],
                  known: Sequence[tuple[str, list[int]]]) -> list[int]:
    """The oracle's ids for ``text`` (see the module docstring)."""
    tb = text.encode()
    best_k, best_seq, best_len = 0, None, 0
    for seq, seq_text in held:
        if text.startswith(seq_text):  # the whole held sequence spells a prefix
            k, nbytes = len(seq), len(seq_text.encode())
        else:
            k = nbytes = 0
            for tid in seq:
                b = q.tbytes(tid)
                if not tb.startswith(b, nbytes):
                    break
                k, nbytes = k + 1, nbytes + len(b)
            while k and not _char_boundary(tb, nbytes):
                k -= 1
                nbytes -= len(q.tbytes(seq[k]))
        if k > best_k:
            best_k, best_seq, best_len = k, seq, nbytes
    if best_seq is None:
        return q.encode_spliced(text, known)
    rest = tb[best_len:].decode()
    return best_seq[:best_k] + q.encode_spliced(rest, known)


def _char_boundary(b: bytes, i: int) -> bool:
    return i >= len(b) or (b[i] & 0xC0) != 0x80


def replay(q: Qwen3, conv: Conversation, ci: int, rate: float, gens: list[Emulated],
           client: Any | None, salt: str, mode: str = "kv-stable") -> Replay:
    rep = Replay(ci, rate, {p: [] for p in PATHS})
    held: list[tuple[list[int], str]] = []   # oracle: (ids, text) the engine holds KV for
    known: list[tuple[str, list[int]]] = []   # answers so far and their generated ids
    for t, msgs in enumerate(conv.prompt_messages):
        text = q.render(msgs, conv.tools)
        answer, gen = conv.answers[t], gens[t]
        canon = q.encode(text)
        rep.paths["baseline"].append(TurnIds(canon, gen.ids))
        oracle = oracle_prompt(q, text, held, known)
        if q.decode(oracle) != text:
            rep.mismatches.append(f"conv {ci} rate {rate} turn {t + 1}: oracle ids do not decode to the prompt")
        rep.paths["limit"].append(TurnIds(oracle, gen.ids))
        held.append((oracle + gen.answer_ids, text + answer))
        known.append((answer, gen.answer_ids))
        if client is None:
            continue
        from sidecar_client import InvalidArgumentError

        r = client.tokenize(MODEL, messages=msgs, tools=conv.tools, add_generation_prompt=True,
                            chat_template_kwargs=q.template_kwargs or None, cache_salt=salt,
                            mode=mode, return_prompt_text=True)
        rep.sources[r.decision.source] += 1
        rep.ar_spliced += r.decision.ar_spliced_tokens
        where = f"conv {ci} rate {rate} turn {t + 1}"
        if r.prompt_text != text:
            rep.mismatches.append(f"{where}: sidecar prompt text differs from transformers' render")
        if q.decode(r.token_ids) != text:
            rep.mismatches.append(f"{where}: tokcache ids do not decode to the prompt text")
        if rate == 0.0 and r.token_ids != canon:
            rep.mismatches.append(f"{where}: rate 0 but tokcache ids differ from the canonical ids")
        rep.paths["tokcache"].append(TurnIds(list(r.token_ids), gen.ids))
        if list(r.token_ids) != oracle:
            tc_ids = list(r.token_ids)
            i = common_prefix(tc_ids, oracle)
            rep.oracle_diffs.append({
                "turn": t + 1, "source": r.decision.source, "first_diff_token": i,
                "tokcache_tokens": len(tc_ids), "oracle_tokens": len(oracle),
                "text_before": q.decode(oracle[max(0, i - 8):i])[-60:],
                "tokcache_next": [q.tok.id_to_token(x) for x in tc_ids[i:i + 6]],
                "oracle_next": [q.tok.id_to_token(x) for x in oracle[i:i + 6]]})
        try:
            client.record_output(MODEL, prompt_text=r.prompt_text, prompt_token_ids=r.token_ids,
                                 output_text=answer, output_token_ids=gen.ids, finish_reason="stop",
                                 stop_reason=None, cache_salt=salt)
        except InvalidArgumentError as exc:
            rep.refusals.append(f"{where}: {exc}")
    return rep


def run_engines(rep: Replay, block_size: int, q: Qwen3) -> dict[str, list[tuple[int, int, int]]]:
    """Per path, per turn: (reused tokens, prompt tokens, text bytes the reused tokens spell)."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for path, turns in rep.paths.items():
        if not turns:
            continue
        cache = PrefixCache(block_size)
        rows = []
        for ti in turns:
            res = cache.run_request(ti.prompt, ti.gen)
            rows.append((res.reused_tokens, res.prompt_tokens,
                         sum(len(q.tbytes(x)) for x in ti.prompt[:res.reused_tokens])))
        out[path] = rows
    return out


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def pct(a: float, b: float) -> str:
    return f"{100 * a / b:.2f}%" if b else "n/a"


def build_table(rows: list[dict[str, Any]], have_tokcache: bool) -> str:
    """Reused prompt tokens (turns >= 2); the target column is tokcache/limit.

    ``text`` = the same ratio measured in text bytes spelled by the reused tokens;
    ``extra prefill`` = prompt tokens prefilled beyond what the limit prefills (work lost).
    """
    head = (f"{'rate':>6} {'achieved':>9} {'block':>5} │ {'baseline':>9} {'tokcache':>9} {'limit':>9} │ "
            f"{'tokcache/limit':>15} {'baseline/limit':>15} │ {'tc/limit text':>13} │ "
            f"{'extra prefill: baseline':>23} {'tokcache':>9}")
    lines = [head, "─" * len(head)]
    for row in rows:
        tc = row["tokcache"]
        tcs = f"{tc:>9}" if tc is not None else f"{'n/a':>9}"
        share = row["tokcache_share"]
        flag = "" if share is None else (" ✓" if share >= TARGET else " ✗")
        tcp = (pct(tc, row["limit"]) + flag) if tc is not None else "unavailable"
        rb, pf = row["reused_bytes"], row["prefill_tokens"]
        text = pct(rb["tokcache"], rb["limit"]) if "tokcache" in rb else "n/a"

        extra = {p: f"{100 * (pf[p] - pf['limit']) / pf['limit']:+.2f}%" if p in pf and pf["limit"] else "n/a"
                 for p in ("baseline", "tokcache")}
        lines.append(f"{row['rate_label']:>6} {100 * row['achieved_rate']:>8.3f}% {row['block_size']:>5} │ "
                     f"{row['baseline']:>9} {tcs} {row['limit']:>9} │ {tcp:>15} "
                     f"{pct(row['baseline'], row['limit']):>15} │ {text:>13} │ "
                     f"{extra['baseline']:>23} {extra['tokcache']:>9}")
    if not have_tokcache:
        lines.append("(tokcache path unavailable)")
    return "\n".join(lines)


def rate_label(rate: float) -> str:
    return f"{100 * rate:g}%"


def plot(path: Path, per_turn: dict[str, Any], rates: Sequence[float], block: int,
         achieved: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2 if len(rates) > 2 else len(rates)
    rows = -(-len(rates) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 3.8 * rows), sharey=True, squeeze=False)
    styles: dict[str, dict[str, Any]] = {
        "limit": dict(color="0.6", lw=5.0, alpha=0.6, zorder=1),
        "tokcache": dict(color="tab:green", lw=1.6, marker="o", ms=3.5, zorder=3),
        "baseline": dict(color="tab:red", lw=1.4, marker="s", ms=3.5, zorder=2),
    }
    for ax, rate in zip(axes.flat, rates, strict=False):
        data = per_turn[rate_label(rate)][str(block)]
        for p in ("limit", "tokcache", "baseline"):
            if p not in data:
                continue
            share = data[p]["share"]
            ax.plot(range(1, len(share) + 1), [100 * s for s in share], label=p, **styles[p])
        ax.set_title(f"non-canonical rate {rate_label(rate)} (achieved {100 * achieved[rate_label(rate)]:.2f}%)")
        ax.set_xlabel("turn")
        ax.set_ylabel("prompt tokens reused (%)")
        ax.grid(alpha=0.3)
        ax.set_ylim(-2, 102)
    for ax in list(axes.flat)[len(rates):]:
        ax.set_visible(False)
    axes.flat[0].legend(loc="lower right")
    fig.suptitle(f"vLLM prefix-cache reuse per turn, block {block} (Qwen3, multi-turn agent chats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 conversation x 5 turns")
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-think", action="store_true", help="render with enable_thinking=False (template rewrites)")
    ap.add_argument("--no-tokcache", action="store_true", help="skip the sidecar path")
    ap.add_argument("--tokcache-mode", choices=("kv-stable", "exact"), default="kv-stable",
                    help="Tokenize mode of the tokcache path (exact = negative control: no AR splicing)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    ns = ap.parse_args(argv)
    n_conv = ns.conversations or (1 if ns.quick else 3)
    n_turns = ns.turns or (5 if ns.quick else 12)

    from tokcache.sidecar.bundled import qwen3_dir

    t0 = time.monotonic()
    qdir = qwen3_dir()
    kwargs = {"enable_thinking": False} if ns.no_think else {}
    q = Qwen3(qdir, kwargs)
    convs = [make_conversation(ns.seed + i, n_turns) for i in range(n_conv)]
    log(f"prefix_reuse: {n_conv} conversation(s) x {n_turns} turns, rates {[rate_label(r) for r in RATES]}, "
        f"blocks {list(BLOCK_SIZES)}, tokenizer {qdir}")

    why_not = "disabled (--no-tokcache)" if ns.no_tokcache else None
    sidecar: Sidecar | None = None
    client: Any | None = None
    if why_not is None:
        try:
            from sidecar_client import SidecarClient

            sidecar = Sidecar(qdir)
            log(f"starting sidecar on {sidecar.address}")
            sidecar.start()
            client = SidecarClient(sidecar.address, timeout=60)
        except Exception as exc:  # noqa: BLE001 - report and go on without the path
            why_not = f"sidecar failed to start: {exc}"
            if sidecar is not None:
                sidecar.stop()
            sidecar = None
    if why_not:
        log(f"tokcache path unavailable: {why_not}")

    replays: list[Replay] = []
    emu_stats: dict[str, dict[str, Any]] = {}
    run_tag = f"{os.getpid()}-{int(time.time())}"
    try:
        for rate in RATES:
            rewritten = total = 0
            kinds: Counter[str] = Counter()
            for ci, conv in enumerate(convs):
                gens = [q.emulator.emulate(a, rate, seed=(conv.seed, t)) for t, a in enumerate(conv.answers)]
                for g in gens:
                    rewritten += g.rewritten
                    total += len(g.canonical)
                    kinds.update(g.by_kind)
                salt = f"prefix-reuse-{run_tag}-c{ci}-r{rate}" if client is not None else ""
                rep = replay(q, conv, ci, rate, gens, client, salt=salt, mode=ns.tokcache_mode)
                replays.append(rep)
                log(f"  rate {rate_label(rate):>5} conv {ci}: {n_turns} turns, sources {dict(rep.sources) or '-'}"
                    f"{', refusals ' + str(len(rep.refusals)) if rep.refusals else ''}"
                    f"  [{time.monotonic() - t0:.1f}s]")
            emu_stats[rate_label(rate)] = {"target": rate, "achieved": rewritten / total if total else 0.0,
                                           "rewritten_tokens": rewritten, "answer_tokens": total,
                                           "by_kind": dict(sorted(kinds.items()))}
    finally:
        if client is not None:
            client.close()
        if sidecar is not None:
            sidecar.stop()

    have_tc = why_not is None and all(rep.paths["tokcache"] for rep in replays)
    if not have_tc and why_not is None:
        why_not = "tokcache path incomplete"

    rows: list[dict[str, Any]] = []
    per_turn: dict[str, dict[str, dict[str, Any]]] = {}
    violations: list[str] = []
    for rate in RATES:
        reps = [r for r in replays if r.rate == rate]
        per_turn[rate_label(rate)] = {}
        for block in BLOCK_SIZES:
            engines = [run_engines(rep, block, q) for rep in reps]
            sums: dict[str, int] = {}
            byte_sums: dict[str, int] = {}
            prefill: dict[str, int] = {}
            turn_data: dict[str, Any] = {}
            for p in PATHS:
                if not all(p in e for e in engines):
                    continue
                reused = [[r for r, _, _ in e[p]] for e in engines]
                prompts = [[n for _, n, _ in e[p]] for e in engines]
                rbytes = [[b for _, _, b in e[p]] for e in engines]
                sums[p] = sum(sum(x[1:]) for x in reused)
                byte_sums[p] = sum(sum(x[1:]) for x in rbytes)
                prefill[p] = sum(sum(n[1:]) - sum(x[1:]) for n, x in zip(prompts, reused, strict=True))
                share = [sum(x[t] for x in reused) / max(1, sum(x[t] for x in prompts)) for t in range(n_turns)]
                turn_data[p] = {"reused": reused, "prompt_tokens": prompts, "reused_bytes": rbytes, "share": share}
            for e, rep in zip(engines, reps, strict=True):
                for p in ("baseline", "tokcache"):
                    if p not in e:
                        continue
                    for t, ((got, _, _), (lim, _, _)) in enumerate(zip(e[p], e["limit"], strict=True)):
                        if got > lim:
                            violations.append(f"rate {rate_label(rate)} block {block} conv {rep.conv} turn {t + 1}: "
                                              f"{p} reused {got} > limit {lim}")
            per_turn[rate_label(rate)][str(block)] = turn_data
            tc = sums.get("tokcache") if have_tc else None
            lim = sums["limit"]
            rows.append({"rate": rate, "rate_label": rate_label(rate),
                         "achieved_rate": emu_stats[rate_label(rate)]["achieved"], "block_size": block,
                         "baseline": sums["baseline"], "tokcache": tc, "limit": lim,
                         "tokcache_share": (tc / lim if lim else 1.0) if tc is not None else None,
                         "baseline_share": sums["baseline"] / lim if lim else 1.0,
                         "reused_bytes": {p: byte_sums[p] for p in byte_sums if p != "tokcache" or have_tc},
                         "prefill_tokens": {p: prefill[p] for p in prefill if p != "tokcache" or have_tc}})

    sources = {rate_label(rate): dict(sum((r.sources for r in replays if r.rate == rate), Counter()))
               for rate in RATES}
    spliced = {rate_label(rate): sum(r.ar_spliced for r in replays if r.rate == rate) for rate in RATES}
    refusals = [x for r in replays for x in r.refusals]
    mismatches = [x for r in replays for x in r.mismatches]
    oracle_diffs = [{"conv": r.conv, "rate": r.rate, **d} for r in replays for d in r.oracle_diffs]
    tc_turns = sum(len(r.paths["tokcache"]) for r in replays)

    table = build_table(rows, have_tc)
    print(f"Prefix-cache reuse, Qwen3, {n_conv} conversation(s) x {n_turns} turns "
          f"({'enable_thinking=False' if ns.no_think else 'answers without <think>'}); "
          f"reused prompt tokens summed over turns 2..{n_turns}")
    print(table)
    if have_tc:
        same = tc_turns - len(oracle_diffs)
        print(f"tokcache prompt ids identical to the limit's (oracle's) ids: {same}/{tc_turns} turns")
        print("tokcache decision sources by rate: "
              + "; ".join(f"{k}: {', '.join(f'{s}={n}' for s, n in sorted(v.items()))} (AR-spliced tokens {spliced[k]})"
                          for k, v in sources.items()))
    else:
        print(f"tokcache: unavailable ({why_not})")
    print("emulator: " + "; ".join(f"{k}: achieved {100 * v['achieved']:.3f}% "
                                   f"({v['rewritten_tokens']}/{v['answer_tokens']} answer tokens)"
                                   for k, v in emu_stats.items()))
    problems = (("record refusals", refusals), ("id mismatches", mismatches), ("limit violations", violations))
    for title, items in problems:
        if items:
            print(f"{title} ({len(items)}):")
            for x in items[:20]:
                print(f"  {x}")

    shortfall = [row for row in rows if row["tokcache_share"] is not None and row["tokcache_share"] < TARGET]
    ok = not shortfall and not mismatches and not violations and not refusals and (have_tc or ns.no_tokcache)
    ns.out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "prefix_reuse",
        "model": MODEL, "tokenizer_dir": str(qdir),
        "config": {"conversations": n_conv, "turns": n_turns, "seed": ns.seed, "rates": list(RATES),
                   "block_sizes": list(BLOCK_SIZES), "target": TARGET, "eos_id": QWEN3_EOS,
                   "template": "enable_thinking=False" if ns.no_think else "default; answers without <think>",
                   "quick": ns.quick, "tokcache_mode": ns.tokcache_mode},
        "tokcache": {"available": have_tc, "reason": why_not, "decision_sources": sources,
                     "ar_spliced_tokens": spliced, "refusals": refusals,
                     "turns_equal_to_oracle": tc_turns - len(oracle_diffs), "turns": tc_turns,
                     "oracle_diffs": oracle_diffs},
        "emulator": emu_stats,
        "rows": rows,
        "per_turn": per_turn,
        "conversation_kinds": [c.kinds for c in convs],
        "mismatches": mismatches,
        "limit_violations": violations,
        "ok": ok,
        "elapsed_s": round(time.monotonic() - t0, 2),
    }
    (ns.out / "prefix_reuse.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    plot(ns.out / "prefix_reuse.png", per_turn, RATES, 16, {k: v["achieved"] for k, v in emu_stats.items()})
    log(f"wrote {ns.out / 'prefix_reuse.json'} and {ns.out / 'prefix_reuse.png'} [{time.monotonic() - t0:.1f}s]")
    if shortfall:
        log(f"FAIL: tokcache below {100 * TARGET:.1f}% of the limit: "
            + ", ".join(f"rate {r['rate_label']} block {r['block_size']}" for r in shortfall))
    if not have_tc and not ns.no_tokcache:
        log(f"FAIL: tokcache path unavailable ({why_not})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
