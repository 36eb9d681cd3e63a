"""Deterministic multi-turn agent conversations, rendered with a real chat template.

A conversation is what a coding agent sends a Qwen3 server: one system prompt, eight tool
definitions, a user task, then a loop of assistant tool calls (JSON arguments, some with code)
and tool results (source files with indentation, JSON search hits, logs with whitespace runs,
docs with CJK and emoji). Every few steps the assistant answers and the user asks for more.

Turn ``t`` (1-based) is the ``t``-th request the agent makes: the messages so far, rendered with
``add_generation_prompt=True``. Sizes are steered so the last turn is close to ``target_bytes``
(UTF-8), growing roughly linearly, with the jitter real tool output has.

Assistant messages carry ``reasoning_content``: Qwen3's template keeps it inside the current
tool loop and drops it from earlier turns once a new user query arrives, so a user turn rewrites
some history. That is real Qwen3 agent traffic, and a prefix cache has to live with it.

Everything derives from ``random.Random(seed)``: the same seed gives the same texts.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Conversation",
    "DEFAULT_TARGET_BYTES",
    "DEFAULT_TURNS",
    "END_OF_TURN",
    "Renderer",
    "SYSTEM_PROMPT",
    "TOOLS",
    "generate",
    "load_renderer",
]

DEFAULT_TURNS = 40
DEFAULT_TARGET_BYTES = 57_000
END_OF_TURN = "<|im_end|>"  # Qwen3's: an answer ends where the template closes its message

Message = dict[str, Any]
Renderer = Callable[[Sequence[Message], Sequence[Message]], str]

SYSTEM_PROMPT = """\
You are Forge, an autonomous software engineering agent working inside a sandboxed checkout of \
the user's repository. You can read and edit files, search the code base, run shell commands and \
run the test suite through the tools described below.

Rules:
1. Understand before you change. Read the relevant files and tests first; never guess an API.
2. Keep diffs minimal and in the existing style (naming, typing, docstrings, error handling).
3. After every edit, run the narrowest test target that covers it, then the full suite before \
you declare the task done.
4. Never run destructive commands (rm -rf outside the work tree, git push, network access).
5. If a command fails, read its output carefully; do not retry the same command blindly.
6. Answer in the user's language. Use Markdown; put code in fenced blocks with a language tag.
7. When you finish, summarise what changed, why, and how it was verified, in at most ten lines.

Environment: Linux x86_64, Python 3.11, pytest 8, ruff, mypy --strict. The repository root is \
/workspace/repo. Time limit per command: 120 s. Output longer than 8,000 characters is truncated \
in the middle."""


def _fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> Message:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


TOOLS: list[Message] = [
    _fn(
        "read_file",
        "Read a text file from the repository. Returns the content with line numbers.",
        {
            "path": {"type": "string", "description": "Path relative to the repository root."},
            "start_line": {"type": "integer", "description": "First line (1-based)."},
            "end_line": {"type": "integer", "description": "Last line, inclusive."},
        },
        ["path"],
    ),
    _fn(
        "write_file",
        "Create or overwrite a file with the given content.",
        {
            "path": {"type": "string", "description": "Path relative to the repository root."},
            "content": {"type": "string", "description": "The full new content."},
        },
        ["path", "content"],
    ),
    _fn(
        "edit_file",
        "Replace one exact occurrence of old_str with new_str in a file.",
        {
            "path": {"type": "string"},
            "old_str": {"type": "string", "description": "Text to replace; must be unique."},
            "new_str": {"type": "string", "description": "Replacement text."},
        },
        ["path", "old_str", "new_str"],
    ),
    _fn(
        "search_code",
        "Search the repository with a regular expression. Returns JSON matches.",
        {
            "query": {"type": "string", "description": "A Python regular expression."},
            "path_glob": {"type": "string", "description": "Restrict to paths matching this."},
            "max_results": {"type": "integer", "default": 20},
        },
        ["query"],
    ),
    _fn(
        "list_dir",
        "List a directory like `ls -l`, optionally recursively.",
        {"path": {"type": "string"}, "depth": {"type": "integer", "default": 1}},
        ["path"],
    ),
    _fn(
        "run_shell",
        "Run a shell command in the repository root and return stdout, stderr and exit code.",
        {
            "command": {"type": "string"},
            "timeout_s": {"type": "integer", "default": 60},
        },
        ["command"],
    ),
    _fn(
        "run_tests",
        "Run pytest on a target and return the report.",
        {
            "target": {"type": "string", "description": "File, directory or node id."},
            "keyword": {"type": "string", "description": "pytest -k expression."},
            "verbose": {"type": "boolean", "default": False},
        },
        [],
    ),
    _fn(
        "read_docs",
        "Fetch a page of the project's internal documentation (Markdown).",
        {"topic": {"type": "string"}},
        ["topic"],
    ),
]

_MODULES = ["auth", "billing", "cache", "scheduler", "storage", "api", "metrics", "sessions"]
_NOUNS = [
    "user",
    "token",
    "session",
    "invoice",
    "record",
    "batch",
    "entry",
    "window",
    "quota",
    "account",
    "payload",
    "request",
    "handle",
    "segment",
    "bucket",
    "lease",
    "report",
    "key",
]
_VERBS = [
    "load",
    "parse",
    "validate",
    "build",
    "resolve",
    "flush",
    "merge",
    "refresh",
    "compute",
    "render",
    "encode",
    "fetch",
    "evict",
    "schedule",
    "apply",
    "collect",
    "normalize",
    "emit",
]
_TYPES = ["int", "str", "bytes", "float", "bool", "list[str]", "dict[str, int]", "None"]
_ERRORS = [
    "KeyError: 'expires_at'",
    "AssertionError: assert 3 == 4",
    "TypeError: unsupported operand type(s) for +: 'NoneType' and 'int'",
    "ValueError: invalid literal for int() with base 10: ''",
    "AttributeError: 'Session' object has no attribute 'refresh_token'",
    "TimeoutError: lease not acquired within 5.0s",
]
_EN_TASKS = [
    "The {m} tests started failing after yesterday's refactor: `{e}`. Please find the cause "
    "and fix it without changing the public API.",
    "Add a `{v}_{n}` helper to the {m} module that handles empty input, with tests.",
    "Our {m} code recomputes the {n} on every call. Add an LRU cache with a size limit and make "
    "sure invalidation still works when the {n} changes.",
    "Can you review `src/{m}/service.py` for thread-safety problems and fix what you find?",
    "Rename `{v}_{n}` to `{v}_{n}s` everywhere and update the docs and changelog.",
]
_ZH_TASKS = [
    "请帮我看一下 {m} 模块：测试一直报错 `{e}`，找到原因并修复，不要改公共接口。🙏",
    "给 {m} 模块加一个 `{v}_{n}` 函数，空输入要返回空列表，并补上单元测试。",
    "{m} 的性能太差了 😩 每次请求都重新计算 {n}，请加缓存并确认失效逻辑正确。",
]
_FOLLOWUPS = [
    "Thanks! Now also handle the case where the {n} is missing entirely.",
    "Looks good. Can you add a regression test for `{e}` so it doesn't come back?",
    "Please run the whole suite once more and show me the summary.",
    "One more thing: the {m} logs are too noisy at INFO; move the per-{n} lines to DEBUG.",
    "好的 👍 再帮我把 {m} 里的注释改成英文，保持格式不变。",
    "Ship it 🚀 but first double-check mypy is clean on src/{m}.",
]
_ZH_COMMENTS = [
    "# 计算缓存键：同一个用户的请求必须落在同一个桶里",
    "# 注意：这里不能持有锁去做网络请求，否则会死锁",
    "# TODO(张伟): 过期时间应该从配置读取",
    "# 兼容旧版本的数据格式 ✅",
]


def _ident(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _py_function(rng: random.Random, indent: str = "") -> list[str]:
    name = _ident(rng)
    args = ", ".join(f"{rng.choice(_NOUNS)}: {rng.choice(_TYPES[:-1])}" for _ in range(rng.randint(1, 3)))
    ret = rng.choice(_TYPES)
    noun = rng.choice(_NOUNS)
    out = [
        f"{indent}def {name}(self, {args}) -> {ret}:" if indent else f"def {name}({args}) -> {ret}:",
        f'{indent}    """{name.split("_")[0].capitalize()} the {noun} and return the result."""',
    ]
    for _ in range(rng.randint(2, 5)):
        kind = rng.random()
        var = rng.choice(_NOUNS)
        if kind < 0.3:
            out += [
                f"{indent}    if {var} is None:",
                f'{indent}        raise ValueError(f"missing {var}: {{{var}!r}}")',
            ]
        elif kind < 0.55:
            out += [
                f"{indent}    for {var} in self._{rng.choice(_NOUNS)}s:",
                f"{indent}        if not {var}.{rng.choice(_VERBS)}():",
                f"{indent}            continue",
                f"{indent}        {var}_count += 1",
            ]
        elif kind < 0.7:
            out.append(rng.choice(_ZH_COMMENTS).replace("# ", f"{indent}    # ", 1))
            out.append(f"{indent}    {var} = {_ident(rng)}({rng.choice(_NOUNS)}, timeout={rng.randint(1, 30)})")
        elif kind < 0.85:
            out += [
                f"{indent}    with self._lock:  # guards _{var}s",
                f"{indent}        self._{var}s[{rng.choice(_NOUNS)}.key] = {var}",
            ]
        else:
            out.append(
                f'{indent}    {var} = {{"id": {rng.randint(1, 9999)}, "kind": "{rng.choice(_NOUNS)}", '
                f'"ttl": {rng.randint(10, 3600)}}}'
            )
    out.append(f"{indent}    return {rng.choice(_NOUNS) if ret != 'None' else 'None'}")
    return out


def _python_source(rng: random.Random, size: int, module: str) -> str:
    lines = [
        f'"""{module.capitalize()} service: {rng.choice(_NOUNS)}s, {rng.choice(_NOUNS)}s and their lifecycle."""',
        "",
        "from __future__ import annotations",
        "",
        "import threading",
        "from dataclasses import dataclass, field",
        "",
    ]
    while sum(len(x) + 1 for x in lines) < size:
        if rng.random() < 0.35:
            cls = f"{rng.choice(_NOUNS).capitalize()}{rng.choice(['Store', 'Manager', 'Cache', 'Client'])}"
            lines += [
                "",
                "",
                f"class {cls}:",
                f'    """Owns the {rng.choice(_NOUNS)}s of one {rng.choice(_NOUNS)}."""',
                "",
            ]
            lines += ["    def __init__(self) -> None:", "        self._lock = threading.Lock()", ""]
            lines += _py_function(rng, indent="    ")
        else:
            lines += ["", ""] + _py_function(rng)
    return "\n".join(lines)


def _numbered(text: str, start: int = 1) -> str:
    # `cat -n` style: right-aligned numbers then a tab, the whitespace runs real agents see.
    return "\n".join(f"{i:>6}\t{line}" for i, line in enumerate(text.split("\n"), start))


def _clip(text: str, size: int) -> str:
    if len(text) <= size:
        return text
    cut = text.rfind("\n", 0, size)
    return text[: cut if cut > size // 2 else size]


def _log_lines(rng: random.Random, size: int, module: str) -> str:
    lines: list[str] = []
    sec = rng.randint(0, 3000)
    while sum(len(x) + 1 for x in lines) < size:
        sec += rng.randint(0, 3)
        level = rng.choices(["INFO ", "DEBUG", "WARN ", "ERROR"], [6, 3, 2, 1])[0]
        worker = f"[worker-{rng.randint(0, 7)}]"
        ts = f"2025-03-14T10:{sec // 60 % 60:02d}:{sec % 60:02d}.{rng.randint(0, 999):03d}Z"
        msg = rng.choice(
            [
                f"{rng.choice(_VERBS)} {rng.choice(_NOUNS)} id={rng.randint(1, 99999):<6} "
                f"latency_ms={rng.uniform(0.1, 250):>8.2f}",
                f"GET /api/{module}/{rng.choice(_NOUNS)}s/{rng.randint(1, 999)}    "
                f"status={rng.choice([200, 200, 404, 500])}",
                f"lease {rng.getrandbits(32):08x} renewed        ttl={rng.randint(5, 60)}s",
                f"{rng.choice(_ERRORS)}",
                f"cache hit ratio: {rng.uniform(0, 1):.3f}   entries={rng.randint(0, 50000):>7}   ✅",
            ]
        )
        lines.append(f"{ts}  {level}  {worker:<11} {module}.{rng.choice(_NOUNS):<8}  {msg}")
    return "\n".join(lines)


def _pytest_report(rng: random.Random, size: int, module: str, failing: bool) -> str:
    lines = [
        "============================= test session starts ==============================",
        "platform linux -- Python 3.11.7, pytest-8.3.4, pluggy-1.5.0",
        "rootdir: /workspace/repo",
        "configfile: pyproject.toml",
        f"collected {rng.randint(40, 400)} items",
        "",
    ]
    passed = failed = 0
    while sum(len(x) + 1 for x in lines) < size * 0.7:
        test = f"tests/{module}/test_{rng.choice(_NOUNS)}.py::test_{_ident(rng)}"
        ok = not failing or rng.random() > 0.15
        passed, failed = passed + ok, failed + (not ok)
        status = "PASSED" if ok else "FAILED"
        lines.append(f"{test} {status:<6}{'':>{max(1, 72 - len(test) - 6)}}[{rng.randint(1, 100):>3}%]")
    if failed:
        lines += [
            "",
            "=================================== FAILURES ===================================",
            f"_____________________________ test_{_ident(rng)} _____________________________",
            "",
        ]
        lines += [f"    {x}" for x in _py_function(rng)[:6]]
        lines += [">       assert result == expected", f"E       {rng.choice(_ERRORS)}", ""]
    lines.append(_log_lines(rng, int(size * 0.15), module))
    mark = "❌" if failed else "✅"
    lines.append(f"{'=' * 20} {failed} failed, {passed} passed in {rng.uniform(0.5, 40):.2f}s {mark} {'=' * 20}")
    return _clip("\n".join(lines), size + 400)


def _search_json(rng: random.Random, size: int, query: str, module: str) -> str:
    matches: list[dict[str, Any]] = []
    out = ""
    while len(out) < size:
        matches.append(
            {
                "path": f"src/{module}/{rng.choice(_NOUNS)}.py",
                "line": rng.randint(1, 900),
                "text": rng.choice(_py_function(rng)).strip(),
            }
        )
        out = json.dumps({"query": query, "matches": matches, "truncated": False}, indent=2, ensure_ascii=False)
    return out


def _dir_listing(rng: random.Random, size: int, module: str) -> str:
    lines = [f"total {rng.randint(20, 400)}"]
    while sum(len(x) + 1 for x in lines) < size:
        is_dir = rng.random() < 0.2
        name = f"{rng.choice(_NOUNS)}{'' if is_dir else rng.choice(['.py', '.py', '.md', '.toml', '.json'])}"
        lines.append(
            f"{'drwxr-xr-x' if is_dir else '-rw-r--r--'}  1 agent agent {rng.randint(0, 99999):>7} "
            f"Mar {rng.randint(1, 28):>2} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}  src/{module}/{name}"
        )
    return "\n".join(lines)


def _docs_page(rng: random.Random, size: int, module: str) -> str:
    parts = [f"# {module.capitalize()} 模块设计说明 📘", ""]
    while sum(len(x) + 1 for x in parts) < size:
        noun = rng.choice(_NOUNS)
        parts += [
            f"## {noun.capitalize()} lifecycle / {noun} 的生命周期",
            "",
            f"每个 {noun} 在创建时分配一个唯一 ID，过期后由后台任务统一回收。"
            f"Callers must hold the {rng.choice(_NOUNS)} lease while mutating it; 否则会出现竞争条件 ⚠️.",
            "",
            "| field | type | 说明 |",
            "|-------|------|------|",
            f"| `{noun}_id` | `int` | 主键 |",
            "| `expires_at` | `float` | Unix 时间戳（秒） |",
            "",
            "```python",
            *_py_function(rng)[:5],
            "```",
            "",
        ]
    return "\n".join(parts)


@dataclass
class Conversation:
    """One rendered conversation: ``texts[t-1]`` is the prompt text of turn ``t``."""

    seed: int
    texts: list[str]
    kinds: list[str]  # per turn: "user" (after a user message) or "tool" (after tool results)
    messages: list[Message] = field(repr=False)
    # Per turn: how many of ``messages`` its prompt renders. The message after them is the
    # assistant's answer to that prompt (none after the last turn).
    sizes: list[int] = field(default_factory=list, repr=False)

    def output_of(self, turn: int, render: Renderer) -> str | None:
        """The text the model generated after turn ``turn``'s prompt (1-based): its assistant
        message as the template renders it while it is the latest (reasoning included), up to
        the end-of-turn token. None after the last turn."""
        if turn >= len(self.texts):
            return None
        prompt = self.texts[turn - 1]
        with_answer = render(self.messages[:self.sizes[turn - 1] + 1], TOOLS)
        if not with_answer.startswith(prompt):
            return None
        end = with_answer.find(END_OF_TURN, len(prompt))
        return with_answer[len(prompt):end] if end > len(prompt) else None

    @property
    def last_bytes(self) -> int:
        return len(self.texts[-1].encode())

    def rewritten_turns(self) -> list[int]:
        """Turns whose text is not an extension of the previous turn's text (template rewrites)."""
        return [t + 1 for t in range(1, len(self.texts)) if not self.texts[t].startswith(self.texts[t - 1])]


class _Builder:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.module = rng.choice(_MODULES)
        self.zh = rng.random() < 0.35
        self.call_no = 0

    def fmt(self, template: str) -> str:
        r = self.rng
        return template.format(m=self.module, n=r.choice(_NOUNS), v=r.choice(_VERBS), e=r.choice(_ERRORS))

    def user_task(self) -> str:
        return self.fmt(self.rng.choice(_ZH_TASKS if self.zh else _EN_TASKS))

    def followup(self) -> str:
        self.module = self.rng.choice(_MODULES) if self.rng.random() < 0.3 else self.module
        return self.fmt(self.rng.choice(_FOLLOWUPS))

    def _call(self, name: str, args: dict[str, Any]) -> Message:
        self.call_no += 1
        return {
            "id": f"call_{self.rng.getrandbits(48):012x}",
            "type": "function",
            "function": {"name": name, "arguments": args},
        }

    def reasoning(self) -> str:
        r = self.rng
        n = r.choice(_NOUNS)
        return r.choice(
            [
                f"The failure mentions {n}; I should look at where {self.module} builds it before editing.",
                f"I need to check how `{_ident(r)}` is used, then run the {self.module} tests.",
                f"用户希望不改公共接口。先看 {n} 的定义，再决定怎么修。",
                f"The last run shows {r.randint(1, 5)} failures; they share the same {n} fixture.",
            ]
        )

    def step(self, budget: int) -> tuple[Message, list[Message]]:
        """One assistant tool-call message and its tool results, about ``budget`` chars in all."""
        r = self.rng
        m = self.module
        kind = r.choices(
            ["read", "read2", "search", "tests", "shell", "edit", "list", "docs"], [5, 1, 3, 3, 2, 3, 1, 1]
        )[0]
        content = r.choice(
            ["", "", f"Let me check the {m} code.", "I'll run the tests to confirm.", "先看看相关代码。"]
        )
        calls: list[Message]
        results: list[str]
        size = max(150, budget)
        if kind == "read":
            path = f"src/{m}/{r.choice(_NOUNS)}.py"
            calls = [self._call("read_file", {"path": path})]
            results = [_numbered(_python_source(r, size, m))]
        elif kind == "read2":
            paths = [f"src/{m}/{r.choice(_NOUNS)}.py", f"tests/{m}/test_{r.choice(_NOUNS)}.py"]
            calls = [self._call("read_file", {"path": p}) for p in paths]
            results = [_numbered(_python_source(r, size // 2, m)) for _ in paths]
        elif kind == "search":
            query = rf"def {r.choice(_VERBS)}_\w+\(|{r.choice(_NOUNS)}_id"
            calls = [self._call("search_code", {"query": query, "path_glob": f"src/{m}/**/*.py", "max_results": 20})]
            results = [_search_json(r, size, query, m)]
        elif kind == "tests":
            calls = [self._call("run_tests", {"target": f"tests/{m}", "verbose": True})]
            results = [_pytest_report(r, size, m, failing=r.random() < 0.5)]
        elif kind == "shell":
            cmd = r.choice([f"git log --oneline -n 20 -- src/{m}", f"grep -rn TODO src/{m}", "python -m mypy src"])
            calls = [self._call("run_shell", {"command": cmd, "timeout_s": 60})]
            results = [
                json.dumps({"exit_code": 0, "stdout": _log_lines(r, size - 60, m), "stderr": ""}, ensure_ascii=False)
            ]
        elif kind == "edit":
            old = "\n".join(_py_function(r)[:3])
            new = "\n".join(_py_function(r))
            calls = [
                self._call("edit_file", {"path": f"src/{m}/{r.choice(_NOUNS)}.py", "old_str": old, "new_str": new})
            ]
            results = [f"Edited src/{m}: 1 occurrence replaced.\n" + _numbered(new, r.randint(10, 400))]
            budget_left = size - len(results[0]) - len(new) - len(old)
            if budget_left > 300:
                results[0] += "\n\n" + _pytest_report(r, budget_left, m, failing=False)
        elif kind == "list":
            calls = [self._call("list_dir", {"path": f"src/{m}", "depth": 2})]
            results = [_dir_listing(r, size, m)]
        else:
            calls = [self._call("read_docs", {"topic": f"{m} design"})]
            results = [_docs_page(r, size, m)]
        assistant: Message = {
            "role": "assistant",
            "content": content,
            "reasoning_content": self.reasoning(),
            "tool_calls": calls,
        }
        tools = [
            {"role": "tool", "tool_call_id": c["id"], "content": _clip(res, size + 200)}
            for c, res in zip(calls, results, strict=True)
        ]
        return assistant, tools

    def answer(self) -> Message:
        r = self.rng
        fn = _py_function(r)
        if self.zh:
            text = (
                f"已修复 ✅ 问题出在 `{fn[0][4 : fn[0].index('(')]}`：{r.choice(_ERRORS)}。\n\n"
                "修改内容：\n```python\n" + "\n".join(fn) + "\n```\n\n所有测试都通过了 🎉"
            )
        else:
            text = (
                f"Done ✅ The root cause was in `{fn[0][4 : fn[0].index('(')]}`: {r.choice(_ERRORS)}.\n\n"
                "Change:\n```python\n" + "\n".join(fn) + f"\n```\n\nVerified with `pytest tests/{self.module}` "
                f"({r.randint(20, 300)} passed) and mypy --strict."
            )
        return {"role": "assistant", "content": text, "reasoning_content": self.reasoning()}


def generate(
    seed: int,
    render: Renderer,
    turns: int = DEFAULT_TURNS,
    target_bytes: int = DEFAULT_TARGET_BYTES,
) -> Conversation:
    """Build conversation ``seed`` with ``turns`` requests, the last about ``target_bytes``."""
    rng = random.Random(seed)
    b = _Builder(rng)
    messages: list[Message] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": b.user_task()}]
    texts = [render(messages, TOOLS)]
    sizes = [len(messages)]
    kinds = ["user"]
    base = len(texts[0].encode())
    growth = max(200.0, (target_bytes - base) / max(1, turns - 1))
    steps_until_answer = rng.randint(5, 9)
    for t in range(2, turns + 1):
        want = base + growth * (t - 1)  # where this turn should land
        # Steer toward the line with heavy-tailed jitter; the absolute target corrects drift.
        budget = int((want - len(texts[-1].encode())) * rng.choice([0.4, 0.7, 1.0, 1.0, 1.3, 1.8]))
        steps_until_answer -= 1
        if steps_until_answer <= 0 and t < turns:
            messages.append(b.answer())
            messages.append({"role": "user", "content": b.followup()})
            kinds.append("user")
            steps_until_answer = rng.randint(5, 9)
        else:
            assistant, tool_msgs = b.step(budget - 350)
            messages.append(assistant)
            messages.extend(tool_msgs)
            kinds.append("tool")
        sizes.append(len(messages))
        texts.append(render(messages, TOOLS))
    return Conversation(seed=seed, texts=texts, kinds=kinds, messages=messages, sizes=sizes)


def load_renderer(tokenizer_dir: Path, fallback_dir: Path | None = None) -> Renderer:
    """A renderer using ``transformers``' ``apply_chat_template`` on a local directory.

    If ``tokenizer_dir`` has no chat template, the template of ``fallback_dir`` renders the
    text instead (said on stderr): the benchmark needs realistic text, not that model's format.
    """
    from transformers import AutoTokenizer  # slow import, only when rendering

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if not getattr(tok, "chat_template", None):
        if fallback_dir is None:
            raise ValueError(f"{tokenizer_dir} has no chat template")
        print(f"note: {tokenizer_dir} has no chat template; rendering with {fallback_dir}'s", file=sys.stderr)
        tok = AutoTokenizer.from_pretrained(str(fallback_dir))

    def render(messages: Sequence[Message], tools: Sequence[Message]) -> str:
        text = tok.apply_chat_template(list(messages), tools=list(tools), add_generation_prompt=True, tokenize=False)
        assert isinstance(text, str)
        return text

    return render


if __name__ == "__main__":  # quick look: python bench/conversations.py [seed]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tokcache.sidecar.bundled import qwen3_dir

    conv = generate(int(sys.argv[1]) if len(sys.argv) > 1 else 0, load_renderer(qwen3_dir()))
    for i, (text, kind) in enumerate(zip(conv.texts, conv.kinds, strict=True), 1):
        print(f"turn {i:>2} {kind:<4} {len(text):>6} chars {len(text.encode()):>6} bytes")
    print("rewritten turns:", conv.rewritten_turns())
