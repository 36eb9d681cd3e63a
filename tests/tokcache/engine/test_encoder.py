"""The encoding backends: what their construction leaves switched on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokcache.engine.encoder import FastokensEncoder, TokenizersEncoder


def test_fastokens_segment_cache_stays_off_whatever_the_environment(
        qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FASTOKENS_SEGMENT_CACHE (vLLM's fastokens mode) would give the tail encoder a cache of
    segments it never sees twice; the encoder switches it off, and its ids are the reference's."""
    monkeypatch.setenv("FASTOKENS_SEGMENT_CACHE", "64")
    path = qwen3_path / "tokenizer.json"
    import fastokens

    assert fastokens.Tokenizer.from_file(str(path)).segment_cache_stats() is not None  # the variable works
    enc = FastokensEncoder(path)
    assert enc.tokenizer.segment_cache_stats() is None
    ref = TokenizersEncoder(path)
    text = "<|im_start|>user\nhello  world\n\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHi"
    assert enc.encode(text) == ref.encode(text)


def test_shared_ints_is_what_the_backend_does(tokenizer_path: Path) -> None:
    """``shared_ints`` (the lookup then leaves the encoder's lists uninterned) is probed at
    load, and holds on other texts: fastokens hands out one int object per id on every call,
    ``tokenizers`` makes new ones (whose lists the lookup interns)."""
    text = "The quick brown fox 🦊 jumps over the lazy dog, naïvely; 数据 <|im_end|> 12345 and more text"
    path = tokenizer_path / "tokenizer.json"
    for cls, shared in ((FastokensEncoder, True), (TokenizersEncoder, False)):
        enc = cls(path)
        assert enc.shared_ints is shared, cls
        a, b = enc.encode(text), enc.encode(text[:-5] + " text")
        big = [i for i, x in enumerate(a[:-2]) if x > 256]
        assert big and all((a[i] is b[i]) is shared for i in big), cls
