"""PluginStats mirrored into prometheus_client: one registry, and vLLM's multiprocess mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from sidecar_client.vllm._stats import PluginStats, install_prometheus

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Status:
    breaker: str = "closed"
    breaker_opens: int = 0
    model: str = "qwen3"
    handshake: str = "pending"
    fingerprint: str = "f" * 32


def value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


def test_increases_are_mirrored_into_a_registry_and_the_interface_is_unchanged() -> None:
    reg = CollectorRegistry()
    stats = PluginStats()
    stats.tokenize["miss"] += 2  # before binding: carried over
    stats.cached_tokens += 7
    stats.observe_record_wait(0.004, timed_out=False)
    status = Status()
    assert install_prometheus(stats, lambda: status, registry=reg)
    assert install_prometheus(stats, lambda: status, registry=reg)  # idempotent: no double counting

    stats.tokenize["miss"] += 1
    stats.tokenize["ar"] += 3
    stats.fallbacks["deadline"] += 1
    stats.records["recorded"] += 5
    stats.record_skips["stop_string"] += 1
    stats.paths["native"] += 4
    stats.paths["python"] += 1
    stats.declines["no_base"] += 1
    stats.cached_tokens += 3
    stats.ar_spliced_tokens += 40
    stats.record_waits += 1
    stats.observe_record_wait(0.0015, timed_out=False)
    stats.observe_record_wait(1.0, timed_out=True)

    assert value(reg, "tokcache_vllm_tokenize_total", source="miss") == 3
    assert value(reg, "tokcache_vllm_tokenize_total", source="ar") == 3
    assert value(reg, "tokcache_vllm_tokenize_total", source="l0") == 0  # the usual sources exist at 0
    assert value(reg, "tokcache_vllm_fallback_total", reason="deadline") == 1
    assert value(reg, "tokcache_vllm_records_total", result="recorded") == 5
    assert value(reg, "tokcache_vllm_records_total", result="dropped") == 0
    assert value(reg, "tokcache_vllm_record_skips_total", reason="stop_string") == 1
    assert value(reg, "tokcache_vllm_read_path_total", path="native") == 4
    assert value(reg, "tokcache_vllm_read_path_total", path="python") == 1
    assert value(reg, "tokcache_vllm_native_declines_total", reason="no_base") == 1
    assert value(reg, "tokcache_vllm_cached_tokens_total") == 10
    assert value(reg, "tokcache_vllm_ar_spliced_tokens_total") == 40
    assert value(reg, "tokcache_vllm_record_waits_total") == 1
    assert value(reg, "tokcache_vllm_response_wait_timeouts_total") == 1
    assert value(reg, "tokcache_vllm_response_wait_seconds_count") == 3
    assert value(reg, "tokcache_vllm_response_wait_seconds_sum") == pytest.approx(1.0055)
    assert value(reg, "tokcache_vllm_response_wait_seconds_bucket", le="0.002") == 1
    assert value(reg, "tokcache_vllm_response_wait_seconds_bucket", le="0.005") == 2
    # PluginStats itself is what it was: plain counters and numbers.
    snap = stats.snapshot()
    assert snap["tokenize"] == {"miss": 3, "ar": 3} and snap["cached_tokens"] == 10
    assert snap["paths"] == {"native": 4, "python": 1} and snap["declines"] == {"no_base": 1}
    assert snap["response_waits"] == 3 and snap["response_wait_timeouts"] == 1
    assert snap["response_wait_seconds"] == pytest.approx(1.0055)
    assert list(stats.recent_response_waits) == [0.004, 0.0015, 1.0]
    json.dumps(snap)


def test_gauges_follow_the_status_after_events_and_at_scrape_time() -> None:
    reg = CollectorRegistry()
    stats = PluginStats()
    status = Status()
    install_prometheus(stats, lambda: status, registry=reg)
    assert value(reg, "tokcache_vllm_breaker_state") == 0
    assert value(reg, "tokcache_vllm_sidecar_info", model="qwen3", handshake="pending", fingerprint="f" * 32) == 1

    status.breaker, status.breaker_opens = "open", 1
    stats.fallbacks["unavailable"] += 1  # an event: gauges refreshed
    assert value(reg, "tokcache_vllm_breaker_state") == 2
    assert value(reg, "tokcache_vllm_breaker_opens_total") == 1

    status.breaker, status.handshake = "half_open", "ready"  # no event: a scrape refreshes
    text = generate_latest(reg).decode()
    assert "tokcache_vllm_breaker_state 1.0" in text
    assert 'handshake="ready"' in text and 'handshake="pending"' not in text  # the old series is removed


def test_a_failing_status_never_raises_into_the_plugin() -> None:
    reg = CollectorRegistry()
    stats = PluginStats()

    def broken() -> Status:
        raise RuntimeError("link gone")

    assert install_prometheus(stats, broken, registry=reg)
    stats.tokenize["l1"] += 1
    stats.cached_tokens += 2
    assert value(reg, "tokcache_vllm_tokenize_total", source="l1") == 1
    assert value(reg, "tokcache_vllm_cached_tokens_total") == 2
    generate_latest(reg)  # the scrape still works


def test_without_prometheus_binding_stats_are_plain() -> None:
    stats = PluginStats()
    stats.fallbacks["too_long"] += 1
    stats.observe_record_wait(0.01, timed_out=False)
    assert stats.snapshot()["fallbacks"] == {"too_long": 1} and stats.response_waits == 1


# One API server process of `vllm serve --api-server-count 2`: prometheus_client is imported
# with PROMETHEUS_MULTIPROC_DIR set (vLLM sets it before spawning), so values go to mmap files.
CHILD = textwrap.dedent("""
    import json, sys
    from dataclasses import dataclass
    from sidecar_client.vllm._stats import PluginStats, install_prometheus

    spec = json.loads(sys.argv[1])

    @dataclass
    class Status:
        breaker: str
        breaker_opens: int
        model: str = "qwen3"
        handshake: str = "ready"
        fingerprint: str = "f" * 32

    stats = PluginStats()
    assert install_prometheus(stats, lambda: Status(spec["breaker"], spec["opens"]))
    for source, n in spec["tokenize"].items():
        for _ in range(n):
            stats.tokenize[source] += 1
    stats.cached_tokens += spec["cached"]
    stats.records["recorded"] += sum(spec["tokenize"].values())
    for seconds in spec["waits"]:
        stats.observe_record_wait(seconds, timed_out=False)
""")


def test_two_processes_in_multiprocess_mode_are_summed(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])}
    specs = [{"tokenize": {"miss": 3, "ar": 2}, "cached": 10, "waits": [0.001, 0.004], "breaker": "closed",
              "opens": 0},
             {"tokenize": {"ar": 4}, "cached": 5, "waits": [0.02], "breaker": "open", "opens": 1}]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(s)], env=env, cwd=ROOT,
                              stderr=subprocess.PIPE) for s in specs]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
    assert len(list(tmp_path.glob("counter_*.db"))) == 2  # one file per process

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path))  # type: ignore[no-untyped-call]
    assert value(reg, "tokcache_vllm_tokenize_total", source="miss") == 3
    assert value(reg, "tokcache_vllm_tokenize_total", source="ar") == 6
    assert value(reg, "tokcache_vllm_tokenize_total", source="l0") == 0
    assert value(reg, "tokcache_vllm_records_total", result="recorded") == 9
    assert value(reg, "tokcache_vllm_cached_tokens_total") == 15
    assert value(reg, "tokcache_vllm_response_wait_seconds_count") == 3
    assert value(reg, "tokcache_vllm_response_wait_seconds_sum") == pytest.approx(0.025)
    assert value(reg, "tokcache_vllm_response_wait_seconds_bucket", le="0.005") == 2
    assert value(reg, "tokcache_vllm_breaker_opens_total") == 1
    assert value(reg, "tokcache_vllm_breaker_state") == 2  # livemax: the worst process
    assert value(reg, "tokcache_vllm_sidecar_info", model="qwen3", handshake="ready", fingerprint="f" * 32) == 1
