"""The encoding backends: what their construction leaves switched on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokcache.engine.encoder import FastokensEncoder, TokenizersEncoder

pytest.importorskip("fastokens")


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
