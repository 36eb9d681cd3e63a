"""``tokcache-sidecar stats`` and ``clean`` on real segments in /dev/shm (the real CLI, in a subprocess).

Segments outlive a clean stop by design (a restarted sidecar re-attaches warm). ``stats``
without ``--shm-prefix`` used to print ``[]`` unless the prefix was the default; ``clean``
removes what a prefix left behind and keeps what a live process still maps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from tokcache.store import Store

SHM = Path("/dev/shm")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TOKCACHE_SHM_PREFIX"}
    return subprocess.run([sys.executable, "-m", "tokcache.sidecar.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def _open(prefix: str) -> Store:
    return Store.open(prefix=prefix, fingerprint=uuid.uuid4().hex, size=2 << 20)


def test_stats_without_a_prefix_lists_every_prefix(shm_prefix: str) -> None:
    stores = [_open(shm_prefix), _open(f"{shm_prefix}.other")]
    try:
        out = _cli("stats")
        assert out.returncode == 0, out.stderr
        names = {item["name"] for item in json.loads(out.stdout)}
        assert {s.name.lstrip("/") for s in stores} <= names
        only = _cli("stats", "--shm-prefix", shm_prefix)
        assert [item["name"] for item in json.loads(only.stdout)] == [stores[0].name.lstrip("/")]
        assert json.loads(only.stdout)[0]["capacity"] > 0
        none = _cli("stats", "--shm-prefix", f"{shm_prefix}-none")
        assert none.returncode == 0 and json.loads(none.stdout) == []
        assert "no tokcache segments under the prefix" in none.stderr
    finally:
        for store in stores:
            store.close()


def test_clean_keeps_what_a_live_process_maps_and_removes_the_rest(shm_prefix: str) -> None:
    store = _open(shm_prefix)
    name = store.name.lstrip("/")
    files = [SHM / name, SHM / f"sem.{name}.lock"]
    assert all(f.exists() for f in files)
    try:
        kept = _cli("clean", "--shm-prefix", shm_prefix)
        assert kept.returncode == 1, kept.stdout + kept.stderr
        assert f"kept {SHM / name}: mapped by pid {os.getpid()} " in kept.stdout
        assert all(f.exists() for f in files)
    finally:
        store.close()
    removed = _cli("clean", "--shm-prefix", shm_prefix)
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert removed.stdout.splitlines() == [f"removed {SHM / name} ({2 << 20} bytes)",
                                           f"removed {SHM / f'sem.{name}.lock'} (32 bytes)"]
    assert not any(f.exists() for f in files)
    again = _cli("clean", "--shm-prefix", shm_prefix)
    assert again.returncode == 0 and again.stdout.startswith("nothing to clean")


def test_clean_force_removes_mapped_segments_and_leaves_other_prefixes(shm_prefix: str) -> None:
    mine, other = _open(shm_prefix), _open(f"{shm_prefix}.other")
    try:
        out = _cli("clean", "--shm-prefix", shm_prefix, "--force")
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"(still mapped by pid {os.getpid()} " in out.stdout
        assert not (SHM / mine.name.lstrip("/")).exists()
        assert (SHM / other.name.lstrip("/")).exists()  # a prefix is matched whole, not as a string prefix
    finally:
        mine.close()
        other.close()


def test_stats_names_the_models_a_segment_serves(shm_prefix: str) -> None:
    """A segment's fingerprint alone does not say which model it is: stats adds the models,
    their directories and the encoder from the manifest the sidecar published."""
    store = _open(shm_prefix)
    try:
        store.publish(json.dumps({"models": ["qwen3", "qwen3-chat"], "model_dirs": ["/models/qwen3"],
                                  "backend": "fastokens", "vocab_size": 151669}).encode())
        [item] = json.loads(_cli("stats", "--shm-prefix", shm_prefix).stdout)
        assert item["models"] == ["qwen3", "qwen3-chat"] and item["model_dirs"] == ["/models/qwen3"]
        assert item["backend"] == "fastokens" and "vocab_size" not in item
    finally:
        store.close()
