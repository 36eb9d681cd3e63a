"""A vLLM-faithful model of automatic prefix caching (vLLM v1 ``KVCacheManager``), token ids only.

What it reproduces (vLLM ``vllm/v1/core/kv_cache_utils.py`` and ``kv_cache_manager.py``):

- A sequence is cut into blocks of ``block_size`` tokens; only **full** blocks get a hash and can
  be cached or reused.
- Block hashes are **chained**: ``hash_block_tokens(parent_hash, block_ids, extra_keys)``, the
  first block's parent being ``NONE_HASH``; ``extra_keys`` carries the request's ``cache_salt``
  on the first block only (as ``generate_block_hash_extra_keys`` does). A block therefore hits
  only if every token before it is identical too.
- Lookup (``get_computed_blocks``): ``max_cache_hit_length = num_prompt_tokens - 1`` (the last
  prompt token is always recomputed to get logits) and ``find_longest_cache_hit`` walks the first
  ``max_cache_hit_length // block_size`` block hashes, stopping at the first miss. The reused
  token count is ``hit_blocks * block_size``.
- After a request runs, its full blocks are cached: the prompt's and those filled during
  decoding. The last sampled token (the EOS of a finished answer) is never fed back through the
  model, so the KV-held sequence is ``prompt + output[:-1]`` (vLLM caches
  ``min(num_computed_tokens, num_tokens)`` tokens).

Not modelled: eviction (the cache is unbounded), hybrid/sliding-window groups, LoRA and
multimodal extra keys, speculative decoding. The hash is SHA-256 over (parent, ids, extra): only
equality matters here.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["NONE_HASH", "PrefixCache", "RequestResult", "block_hashes", "hash_block_tokens"]

NONE_HASH = hashlib.sha256(b"tokcache-bench-none-hash").digest()


def hash_block_tokens(parent: bytes | None, block_ids: Sequence[int],
                      extra_keys: tuple[str, ...] | None = None) -> bytes:
    """Hash of one full block, chained on its parent's hash (``None`` = first block)."""
    h = hashlib.sha256(parent if parent is not None else NONE_HASH)
    h.update(struct.pack(f"<{len(block_ids)}I", *block_ids))
    if extra_keys:
        h.update(b"\x00extra\x00" + "\x00".join(extra_keys).encode())
    return h.digest()


def block_hashes(ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of ``ids`` (a trailing partial block has none)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    out: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(ids) - block_size + 1, block_size):
        extra = (cache_salt,) if (start == 0 and cache_salt) else None
        parent = hash_block_tokens(parent, ids[start:start + block_size], extra)
        out.append(parent)
    return out


@dataclass(frozen=True)
class RequestResult:
    prompt_tokens: int
    reused_tokens: int          # prompt tokens whose KV came from the cache
    cached_blocks_after: int    # size of the cache after the request


class PrefixCache:
    """One engine's prefix cache (unbounded) for one block size."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._hashes: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._hashes)

    def lookup(self, prompt_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Prompt tokens vLLM would reuse: leading hit blocks, capped at ``len - 1`` tokens."""
        max_hit = max(len(prompt_ids) - 1, 0)
        max_blocks = max_hit // self.block_size
        hit = 0
        for h in block_hashes(prompt_ids[:max_blocks * self.block_size], self.block_size, cache_salt):
            if h not in self._hashes:
                break
            hit += 1
        return hit * self.block_size

    def insert(self, ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Cache the full blocks of a computed sequence; returns how many were new."""
        before = len(self._hashes)
        self._hashes.update(block_hashes(ids, self.block_size, cache_salt))
        return len(self._hashes) - before

    def run_request(self, prompt_ids: Sequence[int], output_ids: Iterable[int],
                    cache_salt: str | None = None) -> RequestResult:
        """Serve one request: look the prompt up, then cache ``prompt + output[:-1]``."""
        prompt = list(prompt_ids)
        out = list(output_ids)
        reused = self.lookup(prompt, cache_salt)
        self.insert(prompt + out[:-1], cache_salt)
        return RequestResult(len(prompt), reused, len(self._hashes))
