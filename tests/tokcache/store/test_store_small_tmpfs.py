"""The store on a /dev/shm smaller than it, or filled by someone else: errors, never SIGBUS.

A store into (or a load from) a mapped tmpfs page the filesystem cannot allocate kills the
process with SIGBUS. Each test runs a scenario of ``small_tmpfs_child`` in a private mount
namespace with an 8 MiB tmpfs on /dev/shm and asserts on what it printed; a signal shows
up as the child's return code.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest

from tests.tokcache.store.small_tmpfs import namespace_unavailable, run_child

MIB = 1 << 20

pytestmark = pytest.mark.skipif(namespace_unavailable() is not None,
                                reason=f"needs a private mount namespace: {namespace_unavailable()}")


def _scenario(name: str, tmpfs: str = "8m") -> dict[str, Any]:
    done = run_child(tmpfs, name)
    if done.returncode < 0:
        pytest.fail(f"{name}: killed by {signal.Signals(-done.returncode).name}\n{done.stderr[-3000:]}")
    assert done.returncode == 0, f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_segment_larger_than_tmpfs_is_refused_at_creation_and_sized_to_fit() -> None:
    r = _scenario("create")
    # Creating 64 MiB on 8 MiB: SegmentFull at once, nothing left behind.
    assert r["open_64mib"].startswith("SegmentFull: ") and "no room for 67108864" in r["open_64mib"]
    assert r["leftovers"] == []
    # usable_size: a clamp with its reason, a refusal below the minimum.
    assert 4 * MIB < r["size"] < 8 * MIB and r["size"] % 4096 == 0
    assert "can back 8388608 bytes" in r["why"]
    assert "not enough for the minimum of 16777216 bytes" in r["refused"]
    # Sized to fit: allocated whole at creation, then laps of the arena, every put lands.
    assert r["resident_at_open"] == r["size"] == r["resident"]
    assert r["stored"] == r["puts"] and r["evictions"] > r["puts"] // 2
    assert r["hits"] > 0 and r["wrong"] == 0
    # A restart keeps that size (its own pages count as available) and re-attaches warm.
    assert r["restart_size"] == r["size"] and "keeping the existing" in r["restart_why"]
    assert r["restart_warm"] and r["restart_last"]


def test_tmpfs_filled_at_run_time_means_evictions_or_segment_full() -> None:
    r = _scenario("runtime_full")
    # Allocated whole: a filler taking every free page changes nothing for the store.
    assert r["resident_at_open"] == r["size"] and r["free_1"] == 0
    assert r["stored_1"] == 1500
    # Pages given back under pressure and taken by the filler: growing back into them
    # evicts the store's own oldest records to give their pages back instead of SIGBUS.
    assert r["resident_shrunk"] < r["size"] // 4
    assert r["stored_2"] + r["full_2"] == 1500 and r["stored_2"] > 0
    assert r["pressure_evictions_2"] > 0
    assert r["hits_2"] > 0 and r["wrong_2"] == 0
    assert r["resident_2"] < r["size"] // 4  # it could not grow: the filler holds the rest
    # More than the live log's pages can give: SegmentFull, nothing stored, store goes on.
    assert r["big"].startswith("SegmentFull: ") and r["big_get"] is None
    assert r["after_big"] is True


def test_reader_survives_replacement_and_released_pages_on_a_full_tmpfs() -> None:
    r = _scenario("readers")
    assert r["attach_a"] == {"hits": 300, "wrong": 0, "size": 2 * MIB}
    # Replaced by another size: unlinked, never truncated; the reader's mapping of the old
    # file still reads every record, with the tmpfs full.
    assert r["b_created"] and r["a_retired"]
    old = r["old_after_replace"]
    assert old == {"replaced": True, "hits": 300, "wrong": 0, "size": 2 * MIB, "links": 0}
    assert r["attach_b"]["hits"] == 300 and r["attach_b"]["wrong"] == 0
    # A reader that read slots and tail just before the writer evicted those records and
    # gave their pages back (tmpfs full again) copies holes: misses, no signal.
    assert r["shrink"]["resident_after"] < r["shrink"]["resident_before"] // 4
    assert r["free"] == 0
    released = r["released"]
    assert released["walked"] == 300 and released["below_tail"] > 250
    assert released["misses"] >= released["below_tail"] and released["wrong"] == 0
    assert released["api_hits"] > 0 and released["api_wrong"] == 0
    assert r["stop"] == "stopped" and r["reader_exit"] == 0


def test_restart_on_a_segment_the_tmpfs_cannot_back() -> None:
    r = _scenario("restart")
    # A sparse 64 MiB segment (as created before this check) on 8 MiB: attaching it as is
    # fails on its index, not later with SIGBUS; sized first, it is replaced by one that fits.
    assert r["attach_sparse"].startswith("SegmentFull: ")
    assert r["size"] < 8 * MIB and "4096 held by" in r["why"]
    assert r["replaced_sparse"] and r["stored_1"] == 2500
    # A valid segment with pages given back, re-attached warm on a full tmpfs: puts evict
    # (or fail) instead of SIGBUS, and reads stay exact.
    assert r["warm"]
    assert r["stored_2"] + r["full_2"] == 1000 and r["stored_2"] > 0
    assert r["pressure_evictions_2"] > 0
    assert r["hits_2"] > 0 and r["wrong_2"] == 0 and r["old_wrong"] == 0
