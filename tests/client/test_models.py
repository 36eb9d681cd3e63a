"""The client's result types: what an in-process read builds equals what the dataclasses make."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from sidecar_client._models import CacheDecision, TokenizeResult, local_result


def test_a_local_result_equals_the_dataclasses_and_is_as_frozen() -> None:
    """local_result fills the instances' ``__dict__`` instead of running the frozen dataclasses'
    ``__init__``: the object must be indistinguishable (equal, same repr and hash, frozen,
    replace/asdict/pickle work), and both classes must keep exactly the fields it fills (a field
    added to either must be added there too: this fails until it is)."""
    ids = [1, 2, 3]
    made = TokenizeResult(ids, "f" * 32, CacheDecision("l1", 7, 20, 5, 2, 3, "why"), "fastokens", None, "local")
    got = local_result(ids, "f" * 32, "fastokens", "l1", 7, 20, 5, 2, 3, "why")
    assert got == made and repr(got) == repr(made)
    assert got.decision == made.decision and hash(got.decision) == hash(made.decision)
    assert got.token_ids is ids and got.served_by == "local" and got.prompt_text is None
    assert [f.name for f in dataclasses.fields(TokenizeResult)] == list(vars(got))
    assert [f.name for f in dataclasses.fields(CacheDecision)] == list(vars(got.decision))
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.backend = "tokenizers"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.decision.source = "miss"  # type: ignore[misc]
    assert dataclasses.replace(got, backend="tokenizers").backend == "tokenizers"
    assert dataclasses.asdict(got) == dataclasses.asdict(made)
    assert pickle.loads(pickle.dumps(got)) == made
