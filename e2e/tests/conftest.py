"""Session fixtures: the tiny model, three sidecars, five vLLM servers and a render server started in parallel.

- ``sidecar``: serves the model's own tokenizer (Qwen3) as ``qwen3``.
- ``wrong_sidecar``: serves the Llama 3.2 tokenizer under the same name ``qwen3``.
- ``node_sidecar``: the model's tokenizer again, for ``api2`` (the fail-open test kills ``sidecar``).
- ``baseline``: vLLM's own tokenizer: ``--tokenizer-mode tokcache`` with ``TOKCACHE_OBSERVE_ONLY=1``,
  i.e. the plugin never uses a sidecar and only times vLLM's tokenization (its ids are vLLM's).
- ``fastokens``: the same with ``VLLM_USE_FASTOKENS=1`` and ``FASTOKENS_SEGMENT_CACHE=64`` (MiB).
- ``plugin``: ``--tokenizer-mode tokcache`` against ``sidecar``.
- ``mismatch``: ``--tokenizer-mode tokcache`` against ``wrong_sidecar`` (``TOKCACHE_MODEL=qwen3``).
- ``render``: ``vllm launch render --tokenizer-mode tokcache`` against ``sidecar``: the GPU-less
  render server of vLLM's scale-out layout, whose generate server is ``plugin`` (``--enable-scale-out``).
- ``api2``: ``--tokenizer-mode tokcache --api-server-count 2`` against ``node_sidecar``, its
  prometheus multiprocess directory at ``<workdir>/prom-api2`` (read per process by a test).

``baseline``, ``fastokens``, ``plugin`` and ``api2`` run vLLM's CLI (``vllm serve``; all but
``api2`` with ``--api-server-count 1``) with ``--enable-prompt-tokens-details``; ``mismatch`` runs
``python -m vllm.entrypoints.openai.api_server``.

The vLLM servers are launched together at the start of the session (startup
dominates the run time); every process is stopped at the end, whatever happens.
Tables and counters the tests produce are printed in pytest's terminal summary.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from e2e.tests.harness import DEADLINE_S, ROOT, Sidecar, VllmServer

REPORT: list[str] = []

# The plugin's knobs in these runs: a generous deadline and record wait (DEADLINE_S, see harness)
# and a short breaker reset so recovery is quick to observe.
PLUGIN_ENV = {"TOKCACHE_TIMEOUT_MS": f"{DEADLINE_S * 1000:.0f}", "TOKCACHE_RECORD_WAIT_MS": f"{DEADLINE_S * 1000:.0f}",
              "TOKCACHE_BREAKER_FAILURES": "3", "TOKCACHE_BREAKER_RESET_S": "1"}


def pytest_configure(config: pytest.Config) -> None:
    # `timeout` (or CI) stops the run with SIGTERM: turn it into KeyboardInterrupt so the
    # session fixtures still stop the servers (they run in their own sessions, not ours).
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REPORT:
        terminalreporter.section("tokcache e2e report")
        for block in REPORT:
            terminalreporter.write_line(block)
            terminalreporter.write_line("")


@pytest.fixture(scope="session")
def report(workdir: Path) -> Callable[[str], None]:
    """Add a block of text to the end-of-run report (also written to <workdir>/report.txt)."""

    def add(text: str) -> None:
        REPORT.append(text)
        with (workdir / "report.txt").open("a") as f:
            f.write(text + "\n\n")

    return add


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = os.environ.get("TOKCACHE_E2E_OUT")
    path = Path(out) if out else tmp_path_factory.mktemp("tokcache-e2e")
    path.mkdir(parents=True, exist_ok=True)
    (path / "report.txt").unlink(missing_ok=True)
    return path


@pytest.fixture(scope="session")
def model_dir(workdir: Path) -> Path:
    out = workdir / "tiny-qwen3"
    subprocess.run([sys.executable, str(ROOT / "e2e" / "make_tiny_model.py"), str(out)], check=True,
                   capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="session")
def decode(model_dir: Path) -> Callable[[list[int]], str]:
    """The model's tokenizer's decode (special tokens kept), as the sidecar verifies with."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return lambda ids: str(tok.decode(ids, skip_special_tokens=False))


@pytest.fixture(scope="session")
def shm_prefix() -> Iterator[str]:
    prefix = f"tke2e{os.getpid()}-{uuid.uuid4().hex[:6]}"
    yield prefix
    for entry in [*Path("/dev/shm").glob(f"{prefix}*"), *Path("/dev/shm").glob(f"sem.{prefix}*")]:
        entry.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    from tokcache.sidecar.bundled import llama32_dir

    return llama32_dir()


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest, workdir: Path, model_dir: Path, shm_prefix: str,
          llama_dir: Path) -> Iterator[dict[str, object]]:
    """Start the sidecars, launch the vLLM servers at once (no waiting); stop everything after.

    Only the servers the selected tests use are launched (all six in ``make e2e``).
    """
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    procs: dict[str, object] = {}
    try:
        # Console span exporter: the trace test finds the sidecar's spans in its log.
        sidecar = Sidecar(workdir, "sidecar", {"qwen3": model_dir}, shm_prefix + "-a",
                          env={"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"})
        wrong = Sidecar(workdir, "wrong-sidecar", {"qwen3": llama_dir}, shm_prefix + "-b")
        node = Sidecar(workdir, "node-sidecar", {"qwen3": model_dir}, shm_prefix + "-c")
        procs.update(sidecar=sidecar.start(), wrong_sidecar=wrong.start(), node_sidecar=node.start())
        details = ["--enable-prompt-tokens-details"]
        prom = workdir / "prom-api2"  # vLLM wants it empty at start
        shutil.rmtree(prom, ignore_errors=True)
        prom.mkdir()
        # vLLM tokenizes every prompt itself; the plugin only times it (path "vllm"). No
        # sidecar is used: the address names a socket nobody listens on.
        observe = {"TOKCACHE_OBSERVE_ONLY": "1", "TOKCACHE_ADDRESS": f"unix://{workdir}/no-sidecar.sock"}
        servers = {
            "baseline": lambda: VllmServer(workdir, "baseline", model_dir, ["--tokenizer-mode", "tokcache", *details],
                                           env=observe, api_servers=1),
            "fastokens": lambda: VllmServer(workdir, "fastokens", model_dir,
                                            ["--tokenizer-mode", "tokcache", *details],
                                            env={**observe, "VLLM_USE_FASTOKENS": "1",
                                                 "FASTOKENS_SEGMENT_CACHE": "64"}, api_servers=1),
            # Also a scale-out generate server (/inference/v1/generate: token ids in) for `render`.
            "plugin": lambda: VllmServer(workdir, "plugin", model_dir, ["--tokenizer-mode", "tokcache", *details,
                                                                        "--enable-scale-out"],
                                         env={**PLUGIN_ENV, "TOKCACHE_ADDRESS": sidecar.address,
                                              # in-process decisions as spans on vLLM's log (the trace test)
                                              "OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"},
                                         api_servers=1),
            "mismatch": lambda: VllmServer(workdir, "mismatch", model_dir, ["--tokenizer-mode", "tokcache"],
                                           env={**PLUGIN_ENV, "TOKCACHE_ADDRESS": wrong.address,
                                                "TOKCACHE_MODEL": "qwen3"}),
            # vLLM's GPU-less render server (`vllm launch render`) of the scale-out layout.
            "render": lambda: VllmServer(workdir, "render", model_dir, ["--tokenizer-mode", "tokcache"],
                                         env={**PLUGIN_ENV, "TOKCACHE_ADDRESS": sidecar.address}, render=True),
            "api2": lambda: VllmServer(workdir, "api2", model_dir, ["--tokenizer-mode", "tokcache", *details],
                                       env={**PLUGIN_ENV, "TOKCACHE_ADDRESS": node.address,
                                            "PROMETHEUS_MULTIPROC_DIR": str(prom)}, api_servers=2),
        }
        for name, make in servers.items():
            if name in wanted:
                procs[name] = make().launch()
        yield procs
    finally:
        for name in ("baseline", "fastokens", "plugin", "mismatch", "render", "api2", "sidecar", "wrong_sidecar",
                     "node_sidecar"):
            proc = procs.get(name)
            if proc is not None:
                proc.stop()  # type: ignore[attr-defined]


def _server(stack: dict[str, object], name: str, report: Callable[[str], None]) -> VllmServer:
    server = stack[name]
    assert isinstance(server, VllmServer)
    first = server.ready_s is None
    server.wait_ready()
    if first:
        report(f"vLLM '{name}' ready in {server.ready_s:.1f}s (log {server.log_path})")
    return server


@pytest.fixture(scope="session")
def sidecar(stack: dict[str, object]) -> Sidecar:
    s = stack["sidecar"]
    assert isinstance(s, Sidecar)
    return s


@pytest.fixture(scope="session")
def baseline(stack: dict[str, object], report: Callable[[str], None]) -> VllmServer:
    return _server(stack, "baseline", report)


@pytest.fixture(scope="session")
def fastokens(stack: dict[str, object], report: Callable[[str], None]) -> VllmServer:
    return _server(stack, "fastokens", report)


@pytest.fixture(scope="session")
def plugin(stack: dict[str, object], report: Callable[[str], None]) -> VllmServer:
    return _server(stack, "plugin", report)


@pytest.fixture(scope="session")
def mismatch(stack: dict[str, object], report: Callable[[str], None]) -> VllmServer:
    return _server(stack, "mismatch", report)


@pytest.fixture(scope="session")
def render(stack: dict[str, object], report: Callable[[str], None]) -> VllmServer:
    return _server(stack, "render", report)


@pytest.fixture(scope="session")
def api2(stack: dict[str, object], report: Callable[[str], None]) -> VllmServer:
    return _server(stack, "api2", report)


@pytest.fixture(scope="session")
def node_sidecar(stack: dict[str, object]) -> Sidecar:
    s = stack["node_sidecar"]
    assert isinstance(s, Sidecar)
    return s
