"""Types of the C extension ``_speedups.c``: the added-token scan (``boundaries.py`` is the
reference) and the steady-state lookup (``lookup.py``'s Python path is the reference)."""

from typing import Any, TypeVar

_L = TypeVar("_L", bound=list[Any])

API: int  # the version of these functions (the loader checks it)

class Matcher:
    def __init__(self, tokens: list[tuple[bytes, bool]]) -> None: ...
    def scan(self, data: bytes, pos: int, tail_from: int
             ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int, int]: ...


def extend(text: str, recent: list[Any], ns: tuple[str, bytes], ctx: tuple[Any, ...], tail: int,
           now: float, ar: bool) -> tuple[Any, ...] | None: ...
def cut_tokens(data: bytes, spans: list[tuple[int, int]], i: int, last: int, keyed: list[int], k: int,
               ids: list[int], pos: int, id_of: dict[bytes, int], at: dict[int, int]) -> None: ...
def common_prefix(a: bytes, b: bytes) -> int: ...
def untrack(ids: _L) -> _L: ...
