"""Non-canonical model outputs for AR tests: ids that decode to a text but are not its BPE."""

from __future__ import annotations

from tokcache.sidecar.engine.model import ModelEngine


def noncanonical(engine: ModelEngine, text: str, every: int = 1) -> list[int]:
    """Split every ``every``-th multi-byte token of ``encode(text)`` into two vocabulary tokens.

    The result decodes to ``text`` exactly (asserted) and differs from the
    canonical ids whenever some token could be split (asserted).
    """
    assert engine.token_bytes is not None
    table = engine.token_bytes._table
    reverse = {b: i for i, b in table.items() if i not in engine.special_ids}
    canonical = engine.reference.encode(text)
    out: list[int] = []
    n = 0
    for tok in canonical:
        b = table[tok]
        split = None
        if len(b) >= 2 and n % every == 0:
            for k in range(1, len(b)):
                if b[:k] in reverse and b[k:] in reverse:
                    split = [reverse[b[:k]], reverse[b[k:]]]
                    break
        if split is not None:
            n += 1
            out += split
        else:
            out.append(tok)
    assert out != canonical, "nothing to split"
    assert engine.reference.tokenizer.decode(out, skip_special_tokens=False) == text
    return out
