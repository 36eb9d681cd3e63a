"""The vLLM-faithful prefix cache model."""

from __future__ import annotations

import pytest

from bench.prefix_cache_model import PrefixCache, block_hashes, hash_block_tokens


def seq(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_hashes_are_chained() -> None:
    a = seq(48)
    b = [7] * 16 + a[16:]  # block 0 differs, blocks 1-2 identical
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 3
    assert all(x != y for x, y in zip(ha, hb, strict=True))  # a parent change changes every later hash
    assert ha[1] == hash_block_tokens(ha[0], a[16:32])
    assert hash_block_tokens(None, a[:16]) == ha[0]


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes(seq(15), 16) == []
    assert len(block_hashes(seq(31), 16)) == 1
    assert len(block_hashes(seq(32), 16)) == 2
    assert block_hashes(seq(47), 16) == block_hashes(seq(48), 16)[:2]


def test_salt_is_mixed_into_first_block_only_but_chains() -> None:
    a = seq(32)
    plain, salted = block_hashes(a, 16), block_hashes(a, 16, cache_salt="s1")
    assert plain[0] != salted[0] and plain[1] != salted[1]
    assert salted[1] == hash_block_tokens(salted[0], a[16:])


def test_reuse_counts_leading_full_blocks() -> None:
    c = PrefixCache(16)
    c.insert(seq(100))  # 6 full blocks cached (96 tokens); the partial 4 are not
    assert len(c) == 6
    assert c.lookup(seq(200)) == 96
    assert c.lookup(seq(50)) == 48  # 49 = len-1 -> 3 blocks


def test_last_token_rule() -> None:
    c = PrefixCache(16)
    c.insert(seq(64))
    # Whole prompt cached: the last token must be recomputed, so max hit = (64-1)//16 blocks.
    assert c.lookup(seq(64)) == 48
    assert c.lookup(seq(65)) == 64
    assert c.lookup(seq(16)) == 0
    assert c.lookup(seq(17)) == 16
    assert c.lookup([]) == 0


def test_divergence_in_block_k_stops_reuse_at_k() -> None:
    c = PrefixCache(16)
    base = seq(160)
    c.insert(base)
    for k in range(10):
        other = list(base)
        other[k * 16 + 5] = 1
        assert c.lookup(other + [9]) == k * 16
        # Identical blocks after the divergence do not hit: the chain is broken.


def test_block_128() -> None:
    c = PrefixCache(128)
    c.insert(seq(300))
    assert c.lookup(seq(400)) == 256
    other = seq(400)
    other[200] = 3
    assert c.lookup(other) == 128


def test_salts_isolate() -> None:
    c = PrefixCache(16)
    c.insert(seq(64), cache_salt="a")
    assert c.lookup(seq(100), cache_salt="b") == 0
    assert c.lookup(seq(100)) == 0
    assert c.lookup(seq(100), cache_salt="a") == 64


def test_run_request_caches_prompt_and_output_but_not_the_last_sampled_token() -> None:
    c = PrefixCache(16)
    prompt, output = seq(30), seq(20, start=5000) + [151645]  # 20 answer ids + EOS
    r = c.run_request(prompt, output)
    assert r.reused_tokens == 0 and r.prompt_tokens == 30
    # KV held: 30 + 20 = 50 tokens -> 3 full blocks. The EOS (token 51) was never computed.
    assert len(c) == 3
    nxt = prompt + output + seq(40, start=9000)  # next turn continues with <|im_end|> = the EOS id
    assert c.run_request(nxt, [1, 2]).reused_tokens == 48
    # With one more answer id the EOS block would have been full-of-computed tokens.
    c2 = PrefixCache(16)
    c2.run_request(seq(31), seq(2, start=5000) + [151645])  # held 33 -> 2 blocks
    assert c2.lookup(seq(31) + seq(2, start=5000) + [151645] + [1] * 20) == 32


def test_multi_turn_chain() -> None:
    c = PrefixCache(16)
    p1 = seq(100)
    a1 = seq(40, start=5000)
    c.run_request(p1, a1 + [0])
    p2 = p1 + a1 + seq(30, start=7000)
    assert c.run_request(p2, [1, 0]).reused_tokens == 128  # 140 held -> 8 blocks
    # A non-canonical answer re-encoding: one id differs at position 110 -> reuse stops at block 6.
    p2b = list(p2)
    p2b[110] = 42
    assert PrefixCache.lookup(c, p2b) == 96


def test_bad_block_size() -> None:
    with pytest.raises(ValueError):
        PrefixCache(0)
    with pytest.raises(ValueError):
        block_hashes([1], 0)
