"""Types of the C extension ``_speedups.c`` (index probes and slot writes; ``_index.py`` is the reference)."""

from typing_extensions import Buffer

API: int  # the version of these functions (the loader checks it)

def find(buf: Buffer, index_off: int, n_buckets: int, key: bytes) -> int: ...
def last_live(buf: Buffer, index_off: int, n_buckets: int, keys: list[bytes], lo: int, hi: int, now: float,
              tail: int) -> int: ...
def set_slot(buf: Buffer, index_off: int, n_buckets: int, key: bytes, lsn_kind: int, expiry: int, access: int,
             tail: int, head: int, now: float) -> bool: ...
