"""Smoke test of the main benchmark: one short run, every contender's ids checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "multiturn_latency.py"
IN_PROCESS = ("tokenizers", "fastokens", "fastokens+seg")


def _whole(x: float) -> bool:
    """``x`` is a whole number, up to the rounding of a division and a multiplication."""
    return abs(x - round(x)) < 1e-6 * max(1.0, abs(x))


def _concurrency(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """Run bench/concurrency.py with ``args`` into ``tmp_path``; (the process, its JSON), once it exited 0."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "concurrency.py"), *args, "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc, json.loads((tmp_path / "concurrency.json").read_text())


def test_quick_run_checks_every_contender(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--no-smg", "--ar", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    result = json.loads((tmp_path / "multiturn_latency.json").read_text())
    turns = result["config"]["turns"]
    assert result["config"]["conversations"] == 1 and turns == 10
    contenders = result["contenders"]
    for name in (*IN_PROCESS, "tokcache", "tokcache-ar", "tokcache-rpc"):
        c = contenders[name]
        assert c["status"] == "ok", c["reason"]
        assert c["ids_checked"] and c["checked_calls"] == turns and c["mismatches"] == 0, name
        assert len(c["samples"]) == turns and all(s["us"] > 0 for s in c["samples"]), name
    assert "smg" not in contenders
    assert contenders["tokcache-rpc-floor"]["status"] == "ok"
    # The default client answered every turn in its own process; the RPC contender over gRPC.
    assert {s["served_by"] for s in contenders["tokcache"]["samples"]} == {"local"}
    assert {s["served_by"] for s in contenders["tokcache-rpc"]["samples"]} == {"sidecar"}
    # tokcache-ar recorded each turn's output before the next: its reads took them (AR), with
    # the same ids as the reference (outputs are recorded as their canonical encoding).
    ar_turns = [s for s in contenders["tokcache-ar"]["samples"] if s["turn"] >= 2]
    assert sum(s["source"] == "ar" for s in ar_turns) >= len(ar_turns) // 2, ar_turns
    assert not any(s["source"] == "ar" for s in contenders["tokcache"]["samples"])
    assert result["mismatches"] == [] and result["exit_code"] == 0
    # Each turn extends the last, whose write the harness let land between timed calls.
    assert result["tokcache"]["l1_hit_share_turns_ge2"] == 1.0, result["tokcache"]["sources_turns_ge2"]
    assert (tmp_path / "multiturn_latency.png").stat().st_size > 0
    # Nothing of the run's sidecar is left behind.
    prefix = result["tokcache"]["shm_prefix"]
    assert not list(Path("/dev/shm").glob(f"{prefix}*"))
    assert not list(Path("/dev/shm").glob(f"sem.{prefix}*"))


def test_concurrency_quick_run_counts_requests_and_cpu(tmp_path: Path) -> None:
    """bench/concurrency.py: every run answers with the reference's ids, and CPU per request
    is accounted on both sides (the sidecar's shows when it serves RPCs or records)."""
    proc, result = _concurrency(tmp_path, "--quick", "--procs", "1,2", "--contenders",
                                "fastokens+seg,tokcache,tokcache-rpc,tokcache-ar", "--check", "1")
    assert set(result["runs"]) == {"1", "2"}  # (2, not --quick's 4: the same checks, half the start-up)
    assert result["config"]["gc_freeze"] is True
    for procs, runs in result["runs"].items():
        for name, r in runs.items():
            assert r["status"] == "ok" and r["mismatches"] == 0, (procs, name, r)
            assert r["requests"] == int(procs) * 12 and r["client_cpu_us_per_req"] > 0, (procs, name)
            # Per-request figures of whole counts over every client process's loop.
            assert _whole(r["vol_csw_per_req"] * r["requests"]), (procs, name, r["vol_csw_per_req"])
            assert _whole(r["minflt_per_req"] * r["requests"]), (procs, name, r["minflt_per_req"])
            # The kernel's share of the CPU is part of the CPU (the rusage split of the same clock).
            assert r["client_sys_us_per_req"] <= r["client_cpu_us_per_req"], (procs, name, r)
            assert r["gc_frozen_objects"] > 1000, (procs, name)  # each client froze its start-up heap
        assert runs["tokcache"]["served_by_local"] >= runs["tokcache"]["requests"]  # no RPC for reads
        assert runs["tokcache-rpc"]["served_by_local"] == 0
        # A reader maps the segment and writes records into pages it has not touched yet.
        assert runs["tokcache"]["minflt_per_req"] > 0, runs["tokcache"]
        assert runs["tokcache-rpc"]["server_cpu_us_per_req"] > 0  # the sidecar encodes
        assert "tokcache/fastokens+seg CPU/req" in result["ratios"][procs]
        # tokcache-ar records each turn's output (derived before the clock): the reader stores the
        # prompts its records chain to, and the sidecar verifies and stores the records.
        assert runs["tokcache-ar"]["writes"].get("for_record", 0) > 0, runs["tokcache-ar"]["writes"]
        assert runs["tokcache-ar"]["server_cpu_us_per_req"] > 0
    assert "CPU per request" in proc.stdout
    assert "voluntary context switches" in proc.stdout and "minor page faults" in proc.stdout
    # Every tokcache-rpc request waits for its reply (about a millisecond): a switch or more each.
    assert all(runs["tokcache-rpc"]["vol_csw_per_req"] >= 0.5 for runs in result["runs"].values())


def test_concurrency_rounds_report_medians(tmp_path: Path) -> None:
    """bench/concurrency.py --rounds: every contender runs once per round, is reported by its
    median run (the lower middle of two), and each round's req/s is kept. (The ratios' medians:
    test_concurrency_ratio_and_median_helpers, without processes.)"""
    proc, result = _concurrency(tmp_path, "--quick", "--procs", "1", "--rounds", "2", "--contenders",
                                "fastokens+seg", "--check", "1", "--prime-mb", "16")
    assert "(round 2/2)" in proc.stderr and "Each round's ratios (2 rounds" in proc.stdout
    assert result["config"]["rounds"] == 2
    rps = result["rounds"]["1"]["req_per_s"]["fastokens+seg"]
    assert len(rps) == 2 and all(v > 0 for v in rps)
    run = result["runs"]["1"]["fastokens+seg"]
    assert run["req_per_s"] == min(rps) and run["mismatches"] == 0
    assert result["ratios"]["1"] == {}  # one contender: no ratio
    assert result["config"]["procs"] == [1]  # --quick keeps an explicit --procs
    # --prime-mb: recorded, and said in the report (each run primed before its clock).
    assert result["config"]["prime_mb"] == 16 and "16 MiB primed before each run" in proc.stdout


def test_concurrency_min_write_bytes_reaches_the_tokcache_clients(tmp_path: Path) -> None:
    """--min-write-bytes 0: every tokcache read offers its write (none skipped for its size), the
    setting recorded in the JSON and the report's header; a negative value is refused."""
    from bench.concurrency import parse_args

    proc, result = _concurrency(tmp_path, "--quick", "--procs", "1", "--contenders", "tokcache",
                                "--min-write-bytes", "0")
    assert result["config"]["min_write_bytes"] == 0
    run = result["runs"]["1"]["tokcache"]
    assert run["status"] == "ok" and run["mismatches"] == 0, run
    assert run["writes"].get("skipped", 0) == 0 and run["writes"].get("stored", 0) > 0, run["writes"]
    assert "tokcache min_write_bytes 0" in proc.stdout
    assert parse_args([]).min_write_bytes is None  # the client's own default
    with pytest.raises(SystemExit):
        parse_args(["--min-write-bytes", "-1"])


def test_concurrency_ratio_and_median_helpers() -> None:
    """ratios_of / median_run, on runs made up here: the arithmetic the report rests on."""
    import statistics

    from bench.concurrency import median_run, parse_args, ratios_of

    def run(rps: float, cpu: float, status: str = "ok") -> dict[str, object]:
        return {"status": status, "req_per_s": rps, "client_cpu_us_per_req": cpu, "server_cpu_us_per_req": 10.0}

    got = ratios_of({"tokcache": run(300, 490), "fastokens+seg": run(600, 240), "smg": run(100, 1, "failed")})
    assert got == {"tokcache/fastokens+seg req/s": 0.5, "tokcache/fastokens+seg CPU/req": 2.0}
    runs = [run(5, 1), run(3, 1), run(4, 1), run(9, 1)]
    assert median_run(runs)["req_per_s"] == 4  # the lower middle of an even count
    assert median_run(runs[:3])["req_per_s"] == statistics.median([5, 3, 4])
    failed = run(0, 0, "failed")
    assert median_run([run(5, 1), failed, run(4, 1)]) is failed  # a failure is never hidden
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])
    assert parse_args([]).gc_freeze and not parse_args(["--no-gc-freeze"]).gc_freeze
    with pytest.raises(SystemExit):
        parse_args(["--prime-mb", "-1"])
    assert parse_args([]).prime_mb == 0  # off unless asked


def test_concurrency_deals_the_same_conversations_at_every_p() -> None:
    """--conversations: every P replays each conversation once, whole and in turn order, its
    processes within one conversation of each other; fewer conversations than processes is refused."""
    from bench.concurrency import deal, parse_args

    convs = [[f"c{c} t{t}" for t in range(3)] for c in range(10)]
    for procs in (1, 4, 10):
        dealt = deal(convs, procs)
        assert len(dealt) == procs
        assert sorted(t for texts in dealt for t in texts) == sorted(t for conv in convs for t in conv)
        for texts in dealt:  # each conversation's turns together and in order
            assert all(texts[k:k + 3] == convs[int(texts[k].split()[0][1:])] for k in range(0, len(texts), 3))
        sizes = [len(texts) // 3 for texts in dealt]
        assert max(sizes) - min(sizes) <= 1
    assert parse_args(["--procs", "1,4", "--conversations", "8"]).conversations == 8
    assert parse_args([]).conversations == 0  # --passes, as before
    with pytest.raises(SystemExit):
        parse_args(["--procs", "1,16", "--conversations", "8"])


def test_concurrency_serves_in_flight_conversations_turn_about() -> None:
    """--in-flight K: a process takes its conversations K at a time, turn t of each before turn
    t + 1 of any (as an API server serving K agents sees them), every prompt once, each
    conversation's turns in order; 1 is one conversation after another; 0 is refused."""
    from bench.concurrency import deal, interleave, parse_args

    convs = [[f"c{c} t{t}" for t in range(3 + c % 2)] for c in range(7)]
    assert interleave(convs, 1) == [t for conv in convs for t in conv]
    got = interleave(convs, 3)
    assert sorted(got) == sorted(t for conv in convs for t in conv)
    assert got[:3] == ["c0 t0", "c1 t0", "c2 t0"] and got[3:6] == ["c0 t1", "c1 t1", "c2 t1"]
    for conv in convs:  # each conversation's turns in order
        assert [t for t in got if t.split()[0] == conv[0].split()[0]] == conv
    assert deal(convs, 2, 3) == [interleave(convs[0::2], 3), interleave(convs[1::2], 3)]
    assert parse_args([]).in_flight == 1
    with pytest.raises(SystemExit):
        parse_args(["--in-flight", "0"])


def test_cold_read_quick_run_reads_in_process_with_exact_ids(tmp_path: Path) -> None:
    """bench/cold_read.py: every read after each warm-up answered in this process, its ids the
    reference's, a figure per variant and the contenders alongside."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cold_read.py"), "--quick", "--check", "1", "--thrash-mib", "2",
         "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    result = json.loads((tmp_path / "cold_read.json").read_text())
    assert result["checked"] == 10 and result["mismatches"] == 0 and result["rpc_reads"] == 0
    variants = result["variants"]
    assert set(variants) == {"cold", "encoder", "python", "lookup", "client", "direct"}
    assert sum(v["n"] for v in variants.values()) == 9  # turns >= 2
    assert all(s > 0 for v in variants.values() for s in v["samples_us"])
    assert sum(result["sources"].values()) == 9 and result["sources"].get("l1", 0) >= 6, result["sources"]
    assert all(v["p50_us"] and v["p50_us"] > 0 for v in result["alongside"].values())
    assert (tmp_path / "cold_read.png").stat().st_size > 0


def test_first_touch_quick_run_times_every_chunk(tmp_path: Path) -> None:
    """bench/first_touch.py: a figure per chunk and pass, the loop's own cost apart, a verdict."""
    from bench.first_touch import balloon_reporting

    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "first_touch.py"), "--quick", "--passes", "2",
         "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    r = json.loads((tmp_path / "first_touch.json").read_text())
    assert r["config"]["chunks"] == 1 and len(r["us_per_page"]) == 2
    assert all(len(row) == 1 and row[0] > 0 for row in r["us_per_page"])
    assert 0 < r["baseline_us_per_page"] and r["median_us_per_page"] <= r["max_us_per_page"]
    assert r["slow_chunks"] == sum(us > r["slow_threshold_us"] for row in r["us_per_page"] for us in row)
    assert r["environment"]["balloon_free_page_reporting"] is balloon_reporting()
    assert "µs/page by chunk" in proc.stdout and (tmp_path / "first_touch.png").stat().st_size > 0


def test_first_touch_refuses_more_than_the_machine_has(tmp_path: Path) -> None:
    """Asking for more memory than is available is a clear error before anything is touched."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "first_touch.py"), "--gib", "100000", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert proc.returncode != 0 and "MiB available" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "first_touch.json").exists()


def _virtio(root: Path, name: str, device: int, features: str) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "device").write_text(f"0x{device:04x}\n")
    (d / "features").write_text(features + "\n")


def test_balloon_reporting_reads_the_balloon_feature_bit(tmp_path: Path) -> None:
    """Bit 5 of the balloon's features (VIRTIO_BALLOON_F_REPORTING), other devices ignored."""
    from bench.first_touch import balloon_reporting

    assert balloon_reporting(tmp_path / "absent") is None
    net = "1" * 64
    _virtio(tmp_path / "a", "virtio0", 1, net)  # a net device with every bit set: not a balloon
    assert balloon_reporting(tmp_path / "a") is None
    _virtio(tmp_path / "b", "virtio0", 1, net)
    _virtio(tmp_path / "b", "virtio1", 5, "01100101" + "0" * 56)
    assert balloon_reporting(tmp_path / "b") is True
    _virtio(tmp_path / "c", "virtio0", 5, "01100001" + "0" * 56)
    assert balloon_reporting(tmp_path / "c") is False
