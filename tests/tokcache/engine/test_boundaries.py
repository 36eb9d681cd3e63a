"""The boundary self-check keeps exactly the added tokens that are safe cut points."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from tokcache.engine import boundaries
from tokcache.engine.boundaries import BoundaryCheck, BoundaryScanner, check_boundaries
from tokcache.engine.encoder import TokenizersEncoder
from tokcache.native import pure_python

CORPUS = ["hello world", "the quick brown fox", "word word words", "你好 世界", "12 34 56",
          "end. Start", "tabs\tand spaces  x", "newlines\n\nfoo"] * 20


def _qwen3_parts(qwen3_path: Path) -> tuple[Path, BoundaryCheck, list[str]]:
    """Qwen3's tokenizer.json, its boundary check, and its added tokens' contents."""
    path = qwen3_path / "tokenizer.json"
    added = [str(t["content"]) for t in json.loads(path.read_text())["added_tokens"]]
    return path, check_boundaries(path, TokenizersEncoder(path)), added


def _tokenizer(tmp_path: Path, pre: pre_tokenizers.PreTokenizer, added: list[AddedToken]) -> Path:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(added)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_real_tokenizers_have_role_tokens_as_boundaries(qwen3_path: Path, llama32_path: Path) -> None:
    qwen = check_boundaries(qwen3_path / "tokenizer.json", TokenizersEncoder(qwen3_path / "tokenizer.json"))
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(qwen.boundary_tokens)
    # Non-special added tokens are boundaries too (Qwen marks these special=False).
    assert {"<tool_call>", "</tool_call>", "<think>", "</think>"} <= set(qwen.boundary_tokens)
    assert qwen.disabled_reason == ""
    llama = check_boundaries(llama32_path / "tokenizer.json", TokenizersEncoder(llama32_path / "tokenizer.json"))
    assert {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"} <= set(llama.boundary_tokens)


def test_flagged_tokens_are_rejected(tmp_path: Path) -> None:
    added = [
        AddedToken("<plain>", special=True, normalized=False),
        AddedToken("<nonspecial>", special=False, normalized=False),
        AddedToken("<lstrip>", special=True, lstrip=True, normalized=False),
        AddedToken("<rstrip>", special=True, rstrip=True, normalized=False),
        AddedToken("sw", special=False, single_word=True, normalized=False),
    ]
    path = _tokenizer(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=False), added)
    check = check_boundaries(path, TokenizersEncoder(path))
    assert set(check.boundary_tokens) == {"<plain>", "<nonspecial>", "[UNK]"}
    assert set(check.rejected) == {"<lstrip>", "<rstrip>", "sw"}


def test_metaspace_prepend_first_disables_l1(tmp_path: Path) -> None:
    added = [AddedToken("<s1>", special=True, normalized=False), AddedToken("<s2>", special=True, normalized=False)]
    path = _tokenizer(tmp_path, pre_tokenizers.Metaspace(prepend_scheme="first"), added)
    check = check_boundaries(path, TokenizersEncoder(path))
    assert check.boundary_tokens == ()
    assert "self-check" in check.disabled_reason
    scanner = BoundaryScanner.from_tokenizer(path, check)
    assert not scanner.enabled and scanner.cuts(b"a<s1>b") == []


def test_no_added_tokens_disables_l1(tmp_path: Path) -> None:
    path = _tokenizer(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=False), [])
    data = json.loads(path.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "[UNK]"]
    path.write_text(json.dumps(data))
    check = check_boundaries(path, TokenizersEncoder(path))
    assert check.boundary_tokens == () and check.disabled_reason == "tokenizer has no added tokens"


@pytest.mark.parametrize("text,expected", [
    ("<|im_start|>user\nhi<|im_end|>\n", [12, 29]),
    ("no tokens here", []),
    ("<|im_end|<|im_end|>", [19]),
    ("<think></think>x", [7, 15]),
    ("你<|im_end|>好", [3 + 10]),
])
def test_scanner_offsets(qwen3_path: Path, text: str, expected: list[int]) -> None:
    path = qwen3_path / "tokenizer.json"
    scanner = BoundaryScanner.from_tokenizer(path, check_boundaries(path, TokenizersEncoder(path)))
    assert scanner.cuts(text.encode()) == expected


def test_scanner_prefers_longest_added_token() -> None:
    # "<a>" is a boundary, "<a>x" a longer non-boundary added token: no cut inside it.
    scanner = BoundaryScanner(["<a>", "<a>x"], ["<a>"])
    assert scanner.cuts(b"<a>x <a> <a>") == [8, 12]


def test_incremental_scan_equals_full_scan(qwen3_path: Path) -> None:
    """The scan memo reuses a previous text's matches; results equal a fresh full scan."""
    import random

    path = qwen3_path / "tokenizer.json"
    check = check_boundaries(path, TokenizersEncoder(path))
    memo = BoundaryScanner.from_tokenizer(path, check)
    added = [str(t["content"]) for t in json.loads(path.read_text())["added_tokens"]]
    fresh = BoundaryScanner(added, check.boundary_tokens, memo_bytes=0)
    texts = BoundaryScanner.from_tokenizer(path, check)  # scanned from str: only new text encoded
    rng = random.Random(7)
    parts = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "x", " ", "\n", "<|im_",
             "end|>", "<", "|", ">", "think>", "你好", "<tool_response>"]
    for _ in range(200):
        text = ""
        for _ in range(rng.randint(1, 8)):
            text += "".join(rng.choice(parts) for _ in range(rng.randint(0, 12)))
            data = text.encode()
            assert memo.spans(data) == fresh.spans(data), text
            scan = texts.scan_text(text)
            assert scan.data == data and scan.spans == fresh.spans(data), text


def test_a_rewritten_text_reuses_the_prefix_it_shares(qwen3_path: Path) -> None:
    """A text that extends none of the latest texts but shares a long prefix with one (a chat
    template that rewrote history) takes its spans up to a span before where they differ and
    scans only after it; the result equals a full scan, whatever the rewrite cuts through."""
    import random

    path, check, added = _qwen3_parts(qwen3_path)
    fresh = BoundaryScanner(added, check.boundary_tokens, memo_bytes=0)
    rng = random.Random(11)
    parts = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "x", " ", "\n", "<|im_",
             "end|>", "<", "|", ">", "think>", "你好", "<tool_response>", "word " * 40]
    reused = 0
    for scanner in (BoundaryScanner.from_tokenizer(path, check),
                    BoundaryScanner(added, check.boundary_tokens, native=False)):
        for _ in range(60):
            text = "".join(rng.choice(parts) for _ in range(rng.randint(200, 600)))
            assert scanner.scan_text(text).spans == fresh.spans(text.encode())
            for _ in range(3):  # rewrite at a random point (often inside a token), then append
                at = rng.randint(len(text) // 3, len(text))
                text = text[:at] + "".join(rng.choice(parts) for _ in range(rng.randint(0, 40)))
                scan = scanner.scan_text(text) if rng.random() < 0.5 else scanner.scan(text.encode())
                assert scan.data == text.encode()
                assert scan.spans == fresh.spans(scan.data), text
                reused += 0 < scan.base_len < len(scan.data)
    assert reused > 100  # most rewrites shared enough to reuse a prefix


@pytest.mark.parametrize("recent", [4, boundaries._MEMO_RECENT])
def test_a_rewritten_history_extends_the_root_of_its_line(qwen3_path: Path, recent: int) -> None:
    """A template that rewrites history when the user speaks (Qwen3 drops the reasoning of the
    turns since the user's previous message) renders a text that extends none of the latest
    texts but the one its conversation's line of turns started from: the first prompt, or the
    previous rewrite. The scanner finds that text (the root of a latest text's line, or one of
    the latest roots) and scans only what was appended to it. Every scan equals a full scan,
    with other conversations interleaved, from str and from UTF-8 alike.

    With 4 latest texts the first prompts have left them (3 conversations, each with a first
    prompt and a latest text): a rewrite is found as a root and starts a line of its own. With
    the default, a first prompt (which the second prompt rewrote at its end, so nothing
    superseded it) is still among the latest when the first rewrite comes: the rewrite is
    found there and continues its line, and every later rewrite is scanned from that line's
    root at least, as with one conversation at a time and 4."""
    import random

    path, check, added = _qwen3_parts(qwen3_path)
    fresh = BoundaryScanner(added, check.boundary_tokens, memo_bytes=0)
    rng = random.Random(13)

    def words(n: int) -> str:
        return " ".join(rng.choice(["read", "file", "ok", "命令", "é", "🛠"]) for _ in range(n))

    for scanner, as_bytes in ((BoundaryScanner.from_tokenizer(path, check, recent=recent), False),
                              (BoundaryScanner.from_tokenizer(path, check, recent=recent), True),
                              (BoundaryScanner(added, check.boundary_tokens, native=False, recent=recent), False)):
        def scan(text: str, scanner: BoundaryScanner = scanner, as_bytes: bool = as_bytes) -> boundaries.Scan:
            got = scanner.scan(text.encode()) if as_bytes else scanner.scan_text(text)
            assert got.data == text.encode() and got.spans == fresh.spans(got.data)
            return got

        system = "<|im_start|>system\n" + words(800) + "<|im_end|>\n"
        convs = 3  # interleaved: each conversation's latest text stays among the latest four
        first = [f"{system}<|im_start|>user\nconversation {c}: {words(300)}<|im_end|>\n<|im_start|>assistant\n"
                 for c in range(convs)]
        line_root = list(first)  # what each conversation's next rewrite extends
        latest = list(first)
        for c in range(convs):
            assert scan(first[c]).root is None
        for c in range(convs):  # the second prompt rewrites the first's end (a line of its own)
            latest[c] = first[c][:-12] + "<think>\n\n</think>\n\n" + words(50)
            got = scan(latest[c])
            assert got.root is None and 0 < got.base_len < len(first[c].encode())
        for round_ in range(4):
            for _ in range(5):  # turns that extend the latest (with reasoning)
                for c in range(convs):
                    latest[c] += f"<think>{words(40)}</think><tool_call>{words(30)}</tool_call><|im_end|>\n"
                    got = scan(latest[c])
                    assert got.root is not None and got.base_len > 0
            for c in range(convs):  # the user speaks: the reasoning is dropped
                text = (line_root[c] + f"<tool_call>{words(30)}</tool_call><|im_end|>\n"
                        f"<|im_start|>user\nround {round_}: {words(40)}<|im_end|>\n<|im_start|>assistant\n")
                got = scan(text)
                if recent == 4:
                    assert got.base_len == len(line_root[c].encode()), (round_, c)
                    assert got.root is None  # a line of its own
                else:  # the first prompt's line: every rewrite is scanned from there at least
                    assert got.base_len >= len(first[c].encode()), (round_, c)
                line_root[c] = latest[c] = text
                _check_recent(scanner)
        assert len(scanner._roots) <= boundaries._MEMO_ROOTS


def _check_recent(scanner: BoundaryScanner) -> None:
    """The scanner's list of each recent text's root stays in step with the recent texts, and
    bases() answers the latest texts, then their roots, then the latest roots."""
    recent, roots = scanner._recent, scanner._recent_roots
    assert len(roots) == len(recent) and all(r is c.root for r, c in zip(roots, recent, strict=True))
    bases, n = scanner.bases()
    want = list(recent) + [c.root for c in recent if c.root is not None] + list(scanner._roots)
    assert n == len(recent) and len(bases) == len(want) and all(a is b for a, b in zip(bases, want, strict=True))


@pytest.mark.parametrize("others", [0, 4])  # 4: the line's latest text left the latest ones (filed)
def test_a_rewrite_drops_the_line_it_rewrote(qwen3_path: Path, others: int) -> None:
    """Once a text rewrote a line's history (it extends the line's root and starts a line of its
    own), the old line's latest text leaves the memo, whether still among the latest or filed
    under an anchor (``others`` unrelated texts scanned in between): a conversation keeps ~3
    texts alive, not one per rewrite. The memo's byte count stays the sum of what it holds, and
    every later rewrite still extends its root, its scan a full scan's."""
    import random

    path, check, added = _qwen3_parts(qwen3_path)
    fresh = BoundaryScanner(added, check.boundary_tokens, memo_bytes=0)
    rng = random.Random(7)

    def words(n: int) -> str:
        return " ".join(rng.choice(["read", "file", "ok", "命令", "é"]) for _ in range(n))

    def held(scanner: BoundaryScanner) -> list[boundaries.Scan]:
        return list(scanner._recent) + [e for bucket in scanner._memo.values() for e in bucket]

    scanner = BoundaryScanner.from_tokenizer(path, check)
    system = "<|im_start|>system\n" + words(800) + "<|im_end|>\n"
    line_root = f"{system}<|im_start|>user\n{words(300)}<|im_end|>\n<|im_start|>assistant\n"
    latest = line_root
    root = scanner.scan_text(line_root)
    for round_ in range(4):
        for _ in range(4):  # turns that extend the latest (with reasoning)
            latest += f"<think>{words(40)}</think><tool_call>{words(30)}</tool_call><|im_end|>\n"
            assert scanner.scan_text(latest).root is root
            _check_recent(scanner)
        assert [e for e in held(scanner) if e.root is root]
        for i in range(others):  # other conversations' first prompts
            scanner.scan_text(f"<|im_start|>user\nother {round_}.{i}: {words(900)}<|im_end|>\n")
        text = (line_root + f"<tool_call>{words(30)}</tool_call><|im_end|>\n"
                f"<|im_start|>user\nround {round_}: {words(40)}<|im_end|>\n<|im_start|>assistant\n")
        got = scanner.scan_text(text)  # the user speaks: the reasoning is dropped
        assert got.base_len == len(line_root.encode()) and got.root is None, round_
        assert got.spans == fresh.spans(got.data)
        assert not [e for e in held(scanner) if e.root is root], round_
        _check_recent(scanner)
        assert scanner._bytes == sum(e.weight for e in held(scanner))
        line_root = latest = text
        root = got


def test_roots_stay_within_the_memo_budget(qwen3_path: Path) -> None:
    """The latest roots are kept within a quarter of the memo's budget; a memo of no budget
    keeps none (and still scans right)."""
    path, check, added = _qwen3_parts(qwen3_path)
    for budget in (0, 40_000):
        scanner = BoundaryScanner(added, check.boundary_tokens, memo_bytes=budget)
        for i in range(20):
            text = f"<|im_start|>user\n{i} " + "x" * 5000 + "<|im_end|>\n"
            assert scanner.scan_text(text).spans == [(0, 12), (len(text) - 11, len(text) - 1)]
            assert scanner._root_bytes == sum(r.weight for r in scanner._roots) <= budget // 4
            _check_recent(scanner)  # (the budget pops recent texts too)


def test_common_prefix_native_equals_reference() -> None:
    import random

    from tokcache.engine import boundaries

    rng = random.Random(5)
    fns = [boundaries._common_prefix] + ([boundaries._native.common_prefix] if boundaries._native else [])
    for _ in range(300):
        n = rng.choice([0, 1, 63, 64, 65, 4095, 4096, 4097, 9000, 20000])
        a = bytes(rng.randrange(3) for _ in range(n))
        at = rng.randint(0, n)
        b = a[:at] + bytes(rng.randrange(3) for _ in range(rng.randint(0, 50)))
        want = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        for fn in fns:
            assert fn(a, b) == want == fn(b, a)


def test_scan_memo_tells_conversations_apart(qwen3_path: Path) -> None:
    """Many conversations of one agent share a long system prompt; each turn still finds its
    own previous turn (only the new text is scanned), the result equals a full scan, and the
    memo keeps one entry per conversation (a turn supersedes the one it extends)."""
    import random

    path = qwen3_path / "tokenizer.json"
    check = check_boundaries(path, TokenizersEncoder(path))
    scanner = BoundaryScanner.from_tokenizer(path, check)
    added = [str(t["content"]) for t in json.loads(path.read_text())["added_tokens"]]
    fresh = BoundaryScanner(added, check.boundary_tokens, memo_bytes=0)
    rng = random.Random(3)
    system = "<|im_start|>system\n" + "You are an agent. Use the tools. 🛠 " * 700 + "<|im_end|>\n"  # ~25K chars
    convs = [system for _ in range(40)]
    for turn in range(4):
        for c in range(len(convs)):
            prev = convs[c]
            words = " ".join(rng.choice(["read", "file", "ok", "test", "é", "命令"])
                             for _ in range(rng.randint(50, 900)))
            convs[c] = (f"{prev}<|im_start|>user\nconversation {c} turn {turn}: {words}<|im_end|>\n"
                        "<|im_start|>assistant\n")
            scan = scanner.scan_text(convs[c])
            assert scan.spans == fresh.spans(scan.data)
            if turn:  # turn 0 extends the system prompt alone, which no one scanned
                assert scan.base_len == len(prev.encode()), (turn, c)
    entries = sum(len(b) for b in scanner._memo.values()) + len(scanner._recent)
    assert entries == len(convs)


def test_added_tokens_parses_only_the_array(qwen3_path: Path, llama32_path: Path, tmp_path: Path) -> None:
    """``added_tokens`` reads the array alone; same answer as parsing the whole file, also
    for a file that puts the key last, has a long array, or has none."""
    from tokcache.engine.boundaries import added_tokens

    for path in (qwen3_path / "tokenizer.json", llama32_path / "tokenizer.json"):
        want = json.loads(path.read_text())["added_tokens"]
        assert added_tokens(path) == want and len(want) > 20
    long = [{"id": i, "content": f"<|reserved_{i}|>" + "é" * 40, "special": True} for i in range(3000)]
    for name, doc in (("last", {"model": {"vocab": {"a": 0}}, "added_tokens": long}),
                      ("none", {"model": {"vocab": {"added_tokens": 1}}})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc, ensure_ascii=False))
        assert added_tokens(path) == doc.get("added_tokens", [])


_TOY_WORDS = ["<a>", "<a>x", "<ab>", "<b>", "ab", "abc", "<|x|>", "<|x", "x|>", "é<", "<é>"]


@pytest.mark.parametrize("words", ["qwen3", "llama32", "toy"])
def test_native_matcher_finds_what_the_regex_finds(words: str, request: pytest.FixtureRequest) -> None:
    """The C matcher (tokcache.engine._speedups.Matcher) and the trie regex agree on every scan —
    spans, the tail region's matches, kept_end, stable — whole and growing, on texts made of
    added tokens, their fragments and noise."""
    import random


    if pure_python():
        pytest.skip("TOKCACHE_PURE_PYTHON=1: no native scan to compare")
    if words == "toy":
        added, marks = _TOY_WORDS, ["<a>", "<b>", "<|x|>", "abc", "é<"]
    else:
        path = Path(request.getfixturevalue(f"{words}_path")) / "tokenizer.json"
        added = [str(t["content"]) for t in json.loads(path.read_text())["added_tokens"] if not t.get("normalized")]
        marks = list(check_boundaries(path, TokenizersEncoder(path)).boundary_tokens)
    native = BoundaryScanner(added, marks, memo_bytes=1 << 20)
    regex = BoundaryScanner(added, marks, memo_bytes=1 << 20, native=False)
    assert native._matcher is not None and regex._matcher is None
    rng = random.Random(words)
    parts = [*added, *(w[:k] for w in added[:40] for k in range(1, len(w))), "x", " ", "\n", "|", "<", ">", "你"]
    for _ in range(150):
        text = ""
        for _ in range(rng.randint(1, 6)):
            text += "".join(rng.choice(parts) for _ in range(rng.randint(0, 15)))
            a, b = native.scan_text(text), regex.scan_text(text)
            assert (a.spans, a.tail, a.tail_from, a.kept_end, a.stable) == \
                   (b.spans, b.tail, b.tail_from, b.kept_end, b.stable), text


def test_the_memo_counts_each_entry_once_by_its_fixed_weight(qwen3_path: Path) -> None:
    """Scan.weight is fixed when the scan is made (its texts, plus its line root's), and the
    memo's byte count is the sum of what it holds, through extensions, rewritten histories,
    filing and eviction."""
    path, check, added = _qwen3_parts(qwen3_path)
    scanner = BoundaryScanner(added, check.boundary_tokens, memo_bytes=400_000)
    held = []
    for conv in range(12):
        text = f"<|im_start|>system\nchat {conv} 🙂 " + "y" * 3000 + "<|im_end|>\n"
        for turn in range(6):
            text += f"<|im_start|>user\nturn {turn} " + "z" * (900 + 37 * conv) + "<|im_end|>\n"
            if turn == 4:  # a rewritten history: the same start, a different middle
                text = text[:3100] + "<|im_start|>user\nrewritten<|im_end|>\n" + text[3100:]
            scan = scanner.scan_text(text)
            held.append(scan)
            own = len(scan.data) + sys.getsizeof(scan.text)
            assert scan.weight == own + (scan.root.weight if scan.root is not None else 0)
            filed = list(scanner._recent) + [e for bucket in scanner._memo.values() for e in bucket]
            assert len({id(e) for e in filed}) == len(filed)
            assert scanner._bytes == sum(e.weight for e in filed) <= 400_000
            assert scanner._root_bytes == sum(r.weight for r in scanner._roots)
    assert any(s.root is not None for s in held) and any(s.root is None for s in held)
