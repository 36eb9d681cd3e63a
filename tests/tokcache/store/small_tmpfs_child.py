"""Bodies of the small-tmpfs store tests: ``python -m tests.tokcache.store.small_tmpfs_child SCENARIO``.

Run inside a private mount namespace whose /dev/shm is a small tmpfs (``small_tmpfs``),
so "the tmpfs is full" is real and cheap. Each scenario prints one JSON object of what it
observed and the test asserts on it. A SIGBUS kills the process before it prints: the
test then sees the signal in the return code. Everything here is the real store on the
real tmpfs; nothing is mocked.
"""

from __future__ import annotations

import json
import mmap
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import posix_ipc

from tests.tokcache.store.small_tmpfs import fill
from tests.tokcache.store.store_helpers import FINGERPRINT, ids_of, key
from tokcache.store import Kind, SegmentFull, Store, StoreReader, _layout, segment_name, usable_size
from tokcache.store._log import Log
from tokcache.store._segment import SHM_DIR

PREFIX = "tksmall"
NAME = segment_name(PREFIX, FINGERPRINT)
FILLER = os.path.join(SHM_DIR, "filler")
N_IDS = 2000  # 6 KB a record at 3 bytes an id


def free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def put(store: Store, tag: str, i: int, n: int = N_IDS) -> bool:
    return store.put(None, 0, ids_of(tag, i, n=n), [(key(tag, i), n)], Kind.L1) is not None


def wrong_reads(get: Callable[[bytes], bytes | None], tag: str, count: int, n: int = N_IDS) -> tuple[int, int]:
    """(hits, hits with ids other than the ones put) over keys 0..count-1 of ``tag``."""
    hits = wrong = 0
    for i in range(count):
        got = get(key(tag, i))
        if got is not None:
            hits += 1
            wrong += got != ids_of(tag, i, n=n)
    return hits, wrong


# --- scenarios ---------------------------------------------------------------------------


def create() -> dict[str, Any]:
    """A segment larger than the tmpfs: refused at creation; sized to fit, it takes laps."""
    out: dict[str, Any] = {"tmpfs": os.statvfs(SHM_DIR).f_blocks * os.statvfs(SHM_DIR).f_frsize}
    try:
        Store.open(prefix=PREFIX, fingerprint=FINGERPRINT, size=64 << 20, id_bytes=3)
        out["open_64mib"] = "opened"
    except SegmentFull as exc:
        out["open_64mib"] = f"SegmentFull: {exc}"
    out["leftovers"] = sorted(os.listdir(SHM_DIR))
    try:
        usable_size(NAME, 64 << 20, minimum=16 << 20)
        out["refused"] = None
    except SegmentFull as exc:
        out["refused"] = str(exc)
    size, why = usable_size(NAME, 64 << 20)
    out["size"], out["why"] = size, why
    store = Store.open(prefix=PREFIX, fingerprint=FINGERPRINT, size=size, id_bytes=3)
    out["resident_at_open"] = store.resident_bytes()
    n = 4000  # ~24 MB of records: several laps of the arena
    out["puts"] = n
    out["stored"] = sum(put(store, "create", i) for i in range(n))
    stats = store.stats()
    out["arena"], out["evictions"], out["resident"] = stats.arena_bytes, stats.evictions, stats.resident_bytes
    out["hits"], out["wrong"] = wrong_reads(store.get, "create", n)
    store.close()
    # A restart: the same check keeps the segment it made, which re-attaches warm.
    out["restart_size"], out["restart_why"] = usable_size(NAME, 64 << 20)
    again = Store.open(prefix=PREFIX, fingerprint=FINGERPRINT, size=out["restart_size"], id_bytes=3)
    out["restart_warm"] = again.attached_existing
    out["restart_last"] = again.get(key("create", n - 1)) == ids_of("create", n - 1, n=N_IDS)
    again.unlink()
    again.close()
    return out


def runtime_full() -> dict[str, Any]:
    """Another process fills the tmpfs while the store is in use."""
    out: dict[str, Any] = {}
    store = Store.open(prefix=PREFIX, fingerprint=FINGERPRINT, size=4 << 20, id_bytes=3)
    out["resident_at_open"], out["size"] = store.resident_bytes(), store.size
    # 1. Allocated whole at creation: a full tmpfs changes nothing.
    out["filler_1"] = fill(FILLER)
    out["free_1"] = free_bytes()
    out["stored_1"] = sum(put(store, "p1", i) for i in range(1500))
    # 2. Memory pressure gives pages back; the filler takes them too; pressure ends and the
    #    log grows back into pages the tmpfs cannot allocate: evictions, or SegmentFull.
    store.shrink(0)
    out["resident_shrunk"] = store.resident_bytes()
    out["filler_2"] = fill(FILLER)
    store.set_soft_cap(None)
    before = store.stats().pressure_evictions
    stored = full = 0
    for i in range(1500):
        try:
            stored += put(store, "p2", i)
        except SegmentFull:
            full += 1
    out["stored_2"], out["full_2"] = stored, full
    out["pressure_evictions_2"] = store.stats().pressure_evictions - before
    out["hits_2"], out["wrong_2"] = wrong_reads(store.get, "p2", 1500)
    out["resident_2"] = store.resident_bytes()
    # 3. A record larger than all the live log's pages: SegmentFull, nothing written, and the
    #    store goes on (the pages freed trying are there for the next put).
    store.shrink(0)
    fill(FILLER)
    store.set_soft_cap(None)
    try:
        out["big"] = "stored" if put(store, "big", 0, n=200_000) else "refused"
    except SegmentFull as exc:
        out["big"] = f"SegmentFull: {exc}"
    out["big_get"] = store.get(key("big", 0))
    out["after_big"] = put(store, "after", 0) and store.get(key("after", 0)) == ids_of("after", 0, n=N_IDS)
    out["free_end"] = free_bytes()
    store.unlink()
    store.close()
    return out


def _reader(conn: Connection) -> None:
    """The reader process of ``readers``: a StoreReader (PROT_READ mapping), driven by ``conn``."""
    reader: StoreReader | None = None
    old: list[StoreReader] = []
    snapshot: dict[str, Any] = {}
    while True:
        cmd, arg = conn.recv()
        if cmd == "attach":
            if reader is not None:
                old.append(reader)
            reader = StoreReader.attach(prefix=PREFIX, fingerprint=FINGERPRINT)
            hits, wrong = wrong_reads(reader.get, *arg)
            conn.send({"hits": hits, "wrong": wrong, "size": os.fstat(reader._segment.fd).st_size})
        elif cmd == "check":
            assert reader is not None
            hits, wrong = wrong_reads(reader.get, *arg)
            conn.send({"replaced": reader.replaced, "hits": hits, "wrong": wrong,
                       "size": os.fstat(reader._segment.fd).st_size, "links": os.fstat(reader._segment.fd).st_nlink})
        elif cmd == "snapshot":
            # What a reader racing the writer holds: slots and tail read before the writer
            # moved tail and gave the pages back.
            assert reader is not None
            slots = {}
            for i in range(300):
                soff = reader._index.find(key(arg, i))
                if soff >= 0:
                    slots[i] = reader._index.read(soff)[0]
            snapshot = {"header": bytearray(reader._segment.mm[: _layout.HEADER_SIZE]), "slots": slots, "tag": arg}
            conn.send(len(slots))
        elif cmd == "read_released":
            assert reader is not None
            seg = reader._segment
            g = seg.geometry
            stale = Log(seg.mm, g.arena_off, g.arena_size, memoryview(snapshot["header"]).cast("Q"), seg.name,
                        seg.id_bytes, fd=seg.fd)
            tail_now = reader._words[_layout.W_TAIL]
            walked = below = misses = wrong = 0
            tag = snapshot["tag"]
            for i, lsn_kind in snapshot["slots"].items():
                below += (lsn_kind & _layout.LSN_MASK) < tail_now
                found = stale.walk(key(tag, i), lsn_kind)  # copies the record's pages
                walked += 1
                if isinstance(found, int):
                    misses += 1
                else:
                    wrong += _layout.widen(found[0], seg.id_bytes) != ids_of(tag, i, n=N_IDS)
            hits, wrong_api = wrong_reads(reader.get, tag, 300)
            conn.send({"walked": walked, "below_tail": below, "misses": misses, "wrong": wrong,
                       "api_hits": hits, "api_wrong": wrong_api})
        elif cmd == "stop":
            for r in [*old, reader]:
                if r is not None:
                    r.close()
            conn.send("stopped")
            return


def readers() -> dict[str, Any]:
    """A reader process keeps running while its segment is replaced, and while the pages
    of records it is about to copy are given back on a full tmpfs."""
    out: dict[str, Any] = {}
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(child,), daemon=True)
    proc.start()

    def ask(cmd: str, arg: Any = None) -> Any:
        parent.send((cmd, arg))
        if not parent.poll(60):
            raise RuntimeError(f"reader did not answer {cmd} (exit code {proc.exitcode})")
        return parent.recv()

    try:
        a = Store.open(prefix=PREFIX, fingerprint=FINGERPRINT, size=2 << 20, id_bytes=3)
        for i in range(300):
            put(a, "a", i, n=200)
        out["attach_a"] = ask("attach", ("a", 300, 200))
        # Replaced (another size): unlinked, never truncated; then the tmpfs fills up.
        b = Store.open(prefix=PREFIX, fingerprint=FINGERPRINT, size=3 << 20, id_bytes=3)
        out["b_created"] = not b.attached_existing
        out["a_retired"] = a.replaced
        a.close()
        out["filler"] = fill(FILLER)
        out["old_after_replace"] = ask("check", ("a", 300, 200))
        # The new segment: the reader attaches it and holds slots and tail of 300 records...
        os.unlink(FILLER)
        for i in range(300):
            put(b, "b", i)
        out["attach_b"] = ask("attach", ("b", 300))
        out["snapshot"] = ask("snapshot", "b")
        # ...when the writer evicts them and gives their pages back, and the tmpfs fills up.
        out["shrink"] = b.shrink(0)._asdict()
        out["filler_2"] = fill(FILLER)
        out["free"] = free_bytes()
        out["released"] = ask("read_released")
        out["stop"] = ask("stop")
        proc.join(30)
        out["reader_exit"] = proc.exitcode
        b.unlink()
        b.close()
    finally:
        if proc.is_alive():
            proc.kill()
    return out


def restart() -> dict[str, Any]:
    """A restarted server finds a segment the tmpfs cannot back."""
    out: dict[str, Any] = {}
    # 1. A sparse 64 MiB segment, as versions before this check created them on an 8 MiB
    #    tmpfs (header written, nothing else allocated).
    geometry = _layout.geometry_for(64 << 20)
    shm = posix_ipc.SharedMemory(NAME, posix_ipc.O_CREX, mode=0o600, size=geometry.size)
    with mmap.mmap(shm.fd, geometry.size) as mm:
        static = _layout.pack_static(geometry, bytes.fromhex(FINGERPRINT), int(time.time()), 3)
        mm[: len(static)] = static
    shm.close_fd()
    try:  # attached as is (no size check first): its index cannot be allocated
        Store.open(prefix=PREFIX, fingerprint=FINGERPRINT, size=64 << 20, id_bytes=3)
        out["attach_sparse"] = "attached"
    except SegmentFull as exc:
        out["attach_sparse"] = f"SegmentFull: {exc}"
    size, why = usable_size(NAME, 64 << 20)
    out["size"], out["why"] = size, why
    store = Store.open(prefix=PREFIX, fingerprint=FINGERPRINT, size=size, id_bytes=3)
    out["replaced_sparse"] = not store.attached_existing
    out["stored_1"] = sum(put(store, "r1", i) for i in range(2500))
    store.unlink()
    store.close()
    # 2. A valid segment whose pages were given back (memory pressure) when the server
    #    stopped; the tmpfs filled up meanwhile. The new server re-attaches it warm.
    first = Store.open(prefix=PREFIX, fingerprint=FINGERPRINT, size=4 << 20, id_bytes=3)
    for i in range(600):
        put(first, "r2", i)
    first.shrink(0)
    first.close()
    out["filler"] = fill(FILLER)
    second = Store.open(prefix=PREFIX, fingerprint=FINGERPRINT, size=4 << 20, id_bytes=3)
    out["warm"] = second.attached_existing
    before = second.stats().pressure_evictions
    stored = full = 0
    for i in range(1000):
        try:
            stored += put(second, "r3", i)
        except SegmentFull:
            full += 1
    out["stored_2"], out["full_2"] = stored, full
    out["pressure_evictions_2"] = second.stats().pressure_evictions - before
    out["hits_2"], out["wrong_2"] = wrong_reads(second.get, "r3", 1000)
    out["old_hits"], out["old_wrong"] = wrong_reads(second.get, "r2", 600)
    second.unlink()
    second.close()
    return out


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "create": create,
    "runtime_full": runtime_full,
    "readers": readers,
    "restart": restart,
}


def main(argv: list[str]) -> int:
    result = SCENARIOS[argv[0]]()
    print(json.dumps(result, default=repr), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
