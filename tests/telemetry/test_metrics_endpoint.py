"""Scrape /metrics of a real running sidecar: every documented metric is there and moves."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar_client import InvalidArgumentError, SidecarClient
from tests.integration.sidecar_proc import SidecarProcess

ROOT = Path(__file__).resolve().parents[2]


def _documented() -> list[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    return re.findall(r"^\| `(tokcache_[a-z_]+)` \|", text, flags=re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory, qwen3_path: Path) -> Iterator[tuple[SidecarProcess, int]]:
    port = _free_port()
    prefix = f"tkt-metrics-{uuid.uuid4().hex[:8]}"
    proc = SidecarProcess(tmp_path_factory.mktemp("m"), {"qwen3": qwen3_path}, prefix,
                          "--metrics-port", str(port), "--metrics-addr", "127.0.0.1").start()
    yield proc, port
    assert proc.stop() == 0
    for p in Path("/dev/shm").glob(f"*{prefix}*"):
        p.unlink()


def _scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _total(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k == prefix or k.startswith(prefix + "{"))


def test_every_documented_metric_is_exposed_and_moves(sidecar: tuple[SidecarProcess, int]) -> None:
    proc, port = sidecar
    before = _scrape(port)
    salt = uuid.uuid4().hex
    with SidecarClient(proc.address, zero_rpc=False) as c:  # the sidecar's own RPC metrics
        msgs = [{"role": "user", "content": "metrics " * 50}]
        r = c.tokenize("qwen3", messages=msgs, add_generation_prompt=True, cache_salt=salt, return_prompt_text=True)
        c.tokenize("qwen3", messages=msgs, add_generation_prompt=True, cache_salt=salt)
        c.record_output("qwen3", prompt_text=r.prompt_text or "", prompt_token_ids=r.token_ids,
                        output_text="hello", output_token_ids=[14990], cache_salt=salt)
        with pytest.raises(InvalidArgumentError):
            c.record_output("qwen3", prompt_text=r.prompt_text or "", prompt_token_ids=r.token_ids,
                            output_text="nope", output_token_ids=[14990], cache_salt=salt)
        more = msgs + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
        c.tokenize("qwen3", messages=more, add_generation_prompt=True, cache_salt=salt)
    # A streamed Tokenize is counted once its reply is written, which can be after the client
    # has read it: scrape until all five RPCs are counted, not just once.
    want = _total(before, "tokcache_rpc_requests_total") + 5
    deadline = time.monotonic() + 10
    after = _scrape(port)
    while _total(after, "tokcache_rpc_requests_total") < want and time.monotonic() < deadline:
        time.sleep(0.05)
        after = _scrape(port)
    names = {re.sub(r"\{.*", "", k) for k in after}
    for metric in _documented():
        exposed = {metric, metric + "_total", metric + "_bucket", metric + "_count"}
        assert exposed & names, f"{metric} is documented but not exposed"
    assert _total(after, "tokcache_rpc_requests_total") >= want
    assert after['tokcache_decisions_total{model="qwen3",source="l0"}'] >= 1
    assert after['tokcache_decisions_total{model="qwen3",source="ar"}'] >= 1
    assert after['tokcache_lookups_total{layer="l0",result="hit"}'] >= 1
    assert after['tokcache_records_total{model="qwen3",result="recorded"}'] >= 1
    assert after['tokcache_records_total{model="qwen3",result="refused"}'] >= 1
    assert _total(after, "tokcache_reused_tokens_total") > _total(before, "tokcache_reused_tokens_total")
    assert after['tokcache_rpc_requests_total{code="INVALID_ARGUMENT",method="RecordOutput"}'] >= 1
    used = _total(after, "tokcache_shm_used_bytes")
    assert 0 < used <= _total(after, "tokcache_shm_capacity_bytes")
    assert _total(after, 'tokcache_model_info') == 1


def test_dashboard_uses_only_real_metrics() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "tokcache-dashboard.json").read_text())
    documented = {re.sub(r"_total$", "", m) for m in _documented()}
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"tokcache_[a-z_]+", t["expr"])}
    stripped = {re.sub(r"_(total|bucket|count|sum)$", "", m) for m in used}
    assert stripped <= documented, stripped - documented
    assert len(stripped) >= 12


def test_health_command(sidecar: tuple[SidecarProcess, int], tmp_path: Path) -> None:
    proc, _ = sidecar
    ok = subprocess.run([sys.executable, "-m", "tokcache.sidecar.cli", "health", "--address", proc.address],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and ok.stdout.strip() == "SERVING"
    bad = subprocess.run([sys.executable, "-m", "tokcache.sidecar.cli", "health", "--address", f"unix://{tmp_path}/x.sock",
                          "--timeout", "1"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "unhealthy" in bad.stderr


def test_logs_are_json(sidecar: tuple[SidecarProcess, int]) -> None:
    proc, _ = sidecar
    lines = [line for line in proc.log().splitlines() if line.startswith("{")]
    assert lines
    records = [json.loads(line) for line in lines]
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    assert any("serving 1 model" in r["msg"] for r in records)
