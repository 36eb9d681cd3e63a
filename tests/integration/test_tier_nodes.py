"""Two "nodes" — two real sidecars, each with its own shared memory (``--shm-prefix``) — and one
cluster tier: a real ``redis-server`` (or a real three-node Redis cluster) on loopback.

Turn N is tokenized through A, the model's (non-canonical) output recorded through A; turn
N+1 is tokenized through B, which never saw the conversation. With the tier, B's ids extend
turn N's prompt + output ids exactly (the KV the conversation already has); without it they
do not. The tier then fails (SIGKILL of the server, of one cluster node) and comes back:
no Tokenize fails, and B's hits resume. A tampered value in the tier is never spliced.
"""

from __future__ import annotations

import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import redis

from sidecar_client import SidecarClient, TokcacheError
from tests.ar_helpers import noncanonical
from tests.integration.sidecar_proc import SidecarProcess
from tests.redis_servers import RedisCluster, RedisServer, free_port, need_redis
from tokcache.sidecar.engine.model import ModelEngine
from tokcache.sidecar.tier import encode_value
from tokcache.store.keys import MODE_KV_STABLE, segment_key

EOS = 151645
ANSWERS = ["Step one:\n\n    run `make`\n\n", "Result: 100 passed\n\n\n  ok", "完成了。\n\n🎉 Done.",
           "Plan:\n\n1. read\n2. write\n\n", "  indented answer\n\n\nwith blank lines  ", "Fine.\n\n"]


class Node:
    """One sidecar ("node") with its own shm prefix and metrics port."""

    def __init__(self, tmp: Path, qwen3: Path, name: str, tier_url: str | None) -> None:
        self.metrics_port = free_port()
        extra = ["--metrics-port", str(self.metrics_port), "--metrics-addr", "127.0.0.1"]
        if tier_url:
            extra += ["--ar-store", tier_url, "--ar-store-timeout-ms", "50"]
        (tmp / name).mkdir(parents=True, exist_ok=True)
        self.prefix = f"tkt-tier-{name}-{uuid.uuid4().hex[:6]}"
        self.proc = SidecarProcess(tmp / name, {"qwen3": qwen3}, self.prefix, *extra)

    def start(self) -> Node:
        self.proc.start()
        return self

    @property
    def address(self) -> str:
        return self.proc.address

    def metrics(self) -> dict[str, float]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        out = {}
        for line in body.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        self.proc.stop()
        for p in Path("/dev/shm").glob(f"*{self.prefix}*"):
            p.unlink(missing_ok=True)


WRITES_OK = 'tokcache_tier_writes_total{result="ok"}'


def _value(node: Node, sample: str) -> float:
    return node.metrics().get(sample, 0.0)


def _wait_writes(node: Node, at_least: float, timeout: float = 10.0) -> None:
    """Until ``node`` has written ``at_least`` records through to the tier (writes are async)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _value(node, WRITES_OK) >= at_least:
            return
        time.sleep(0.02)
    raise AssertionError(f"tier writes stuck at {_value(node, WRITES_OK)}, expected {at_least}")


@pytest.fixture(scope="module")
def engine(qwen3_path: Path) -> ModelEngine:
    return ModelEngine("qwen3", qwen3_path, store=None)  # its tokenizer, for non-canonical outputs


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    need_redis()
    node = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield node
    node.stop()


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    need_redis()
    c = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


def _pair(tmp: Path, qwen3: Path, url: str | None) -> Iterator[tuple[Node, Node]]:
    with ExitStack() as stack:
        a = Node(tmp, qwen3, "a", url).start()
        stack.callback(a.stop)
        b = Node(tmp, qwen3, "b", url).start()
        stack.callback(b.stop)
        yield a, b


@pytest.fixture(scope="module")
def nodes_single(tmp_path_factory: pytest.TempPathFactory, qwen3_path: Path,
                 single: RedisServer) -> Iterator[tuple[Node, Node]]:
    yield from _pair(tmp_path_factory.mktemp("pair1"), qwen3_path, single.url)


@pytest.fixture(scope="module")
def nodes_cluster(tmp_path_factory: pytest.TempPathFactory, qwen3_path: Path,
                  three: RedisCluster) -> Iterator[tuple[Node, Node]]:
    yield from _pair(tmp_path_factory.mktemp("pair3"), qwen3_path, three.url)


class Conversation:
    """A chat whose turns are tokenized (and outputs recorded) through whichever node is given."""

    def __init__(self, engine: ModelEngine, salt: str | None = None) -> None:
        self.engine = engine
        self.salt = salt or uuid.uuid4().hex
        self.msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "go"}]
        self.turn = 0

    def prompt(self, c: SidecarClient) -> str:
        return c.render("qwen3", self.msgs, add_generation_prompt=True)

    def tokenize(self, c: SidecarClient, text: str) -> list[int]:
        return c.tokenize("qwen3", text=text, add_special_tokens=False, cache_salt=self.salt).token_ids

    def generate(self, c: SidecarClient, text: str, ids: list[int]) -> list[int]:
        """The model's answer (non-canonical ids + EOS), recorded through ``c``; the ids without EOS."""
        answer = ANSWERS[self.turn % len(ANSWERS)] + f" (turn {self.turn})"
        gen = noncanonical(self.engine, answer)
        c.record_output("qwen3", prompt_text=text, prompt_token_ids=ids, output_text=answer,
                        output_token_ids=gen + [EOS], finish_reason="stop", cache_salt=self.salt)
        self.msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"next {self.turn}"}]
        self.turn += 1
        return gen


def _extends(new: list[int], old: list[int], gen: list[int]) -> bool:
    return new[:len(old) + len(gen)] == old + gen


def _moves(a: Node, b: Node, engine: ModelEngine, turns: int, *, zero_rpc: bool) -> list[bool]:
    """Each turn generated and recorded through A, the next tokenized through B: extends?"""
    conv = Conversation(engine)
    out = []
    with SidecarClient(a.address, zero_rpc=zero_rpc) as ca, SidecarClient(b.address, zero_rpc=zero_rpc) as cb:
        for _ in range(turns):
            text = conv.prompt(ca)
            ids = conv.tokenize(ca, text)
            written = _value(a, WRITES_OK) if a.metrics_port else 0
            gen = conv.generate(ca, text, ids)
            if "--ar-store" in a.proc.cmd:
                _wait_writes(a, written + 1)
            out.append(_extends(conv.tokenize(cb, conv.prompt(cb)), ids, gen))
    return out


# -- the measured property -------------------------------------------------------------------


@pytest.mark.parametrize("zero_rpc", [False, True], ids=["rpc-client", "default-client"])
def test_a_turn_that_moves_to_another_node_extends_the_ids_with_a_tier(
        nodes_single: tuple[Node, Node], engine: ModelEngine, zero_rpc: bool) -> None:
    a, b = nodes_single
    before = _value(b, 'tokcache_tier_lookups_total{result="hit"}')
    assert _moves(a, b, engine, 5, zero_rpc=zero_rpc) == [True] * 5
    assert _value(b, 'tokcache_tier_lookups_total{result="hit"}') >= before + 5
    assert _value(b, 'tokcache_tier_records_total{model="qwen3",result="stored"}') >= 5


def test_an_output_recorded_in_a_client_process_reaches_the_tier_through_the_sidecars_feed(
        nodes_single: tuple[Node, Node], single: RedisServer, engine: ModelEngine) -> None:
    """The default client records in its own process (vLLM's API servers do): no RecordOutput
    reaches node A's sidecar, whose feed follows the segment's log and writes the output's
    segment entry to the tier. Within a bounded wait, Redis holds the generated ids under the
    output's segment key, and node B extends the conversation with them."""
    a, b = nodes_single
    r = redis.Redis.from_url(single.url)
    conv = Conversation(engine)
    written = _value(a, WRITES_OK)
    with SidecarClient(a.address) as ca:
        fp = ca.list_models()[0].fingerprint
        text = conv.prompt(ca)
        ids = conv.tokenize(ca, text)
        gen = conv.generate(ca, text, ids)
        assert ca.stats()["records"] == {"recorded": 1}  # stored by this process, not the sidecar
    answer = conv.msgs[-2]["content"]
    name = b"tokcache:ar:" + fp.encode() + b":" + segment_key(conv.salt, MODE_KV_STABLE, answer.encode()).hex().encode()
    deadline = time.monotonic() + 10
    while r.get(name) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert r.get(name) == encode_value(fp, gen)
    assert _value(a, WRITES_OK) >= written + 1
    r.close()
    with SidecarClient(b.address, zero_rpc=False) as cb:
        assert _extends(conv.tokenize(cb, conv.prompt(cb)), ids, gen)


def test_without_a_tier_the_moved_turn_does_not_extend(tmp_path: Path, qwen3_path: Path, engine: ModelEngine) -> None:
    for a, b in _pair(tmp_path, qwen3_path, None):
        assert _moves(a, b, engine, 3, zero_rpc=False) == [False] * 3


def test_the_default_client_reads_in_process_once_the_conversation_is_here(
        nodes_single: tuple[Node, Node], engine: ModelEngine) -> None:
    """The first turn on B goes to B's sidecar (fallback "tier"), which asks the tier; once B
    records the conversation's outputs itself, its turns are read in the client's process."""
    a, b = nodes_single
    conv = Conversation(engine)
    with SidecarClient(a.address) as ca, SidecarClient(b.address) as cb:
        text = conv.prompt(ca)
        ids = conv.tokenize(ca, text)
        written = _value(a, WRITES_OK)
        gen = conv.generate(ca, text, ids)
        _wait_writes(a, written + 1)
        text = conv.prompt(cb)
        first = cb.tokenize("qwen3", text=text, add_special_tokens=False, cache_salt=conv.salt)
        assert first.served_by == "sidecar" and first.decision.source == "ar"
        assert _extends(first.token_ids, ids, gen)
        assert cb.stats()["fallbacks"].get("tier") == 1
        gen2 = conv.generate(cb, text, first.token_ids)  # the conversation now lives on B
        again = cb.tokenize("qwen3", text=conv.prompt(cb), add_special_tokens=False, cache_salt=conv.salt)
        assert again.served_by == "local" and again.decision.source == "ar"
        assert _extends(again.token_ids, first.token_ids, gen2)
        assert cb.stats()["fallbacks"].get("tier") == 1  # no second trip


def test_exact_mode_never_asks_the_tier(nodes_single: tuple[Node, Node]) -> None:
    _, b = nodes_single
    before = sum(_value(b, f'tokcache_tier_lookups_total{{result="{r}"}}') for r in ("hit", "miss", "error"))
    with SidecarClient(b.address, zero_rpc=False) as c:
        c.tokenize("qwen3", text="<|im_start|>user\nexact please<|im_end|>\n", mode="exact")
    after = sum(_value(b, f'tokcache_tier_lookups_total{{result="{r}"}}') for r in ("hit", "miss", "error"))
    assert after == before


def test_cluster_tier(nodes_cluster: tuple[Node, Node], engine: ModelEngine) -> None:
    a, b = nodes_cluster
    assert _moves(a, b, engine, 4, zero_rpc=False) == [True] * 4


# -- a tampered tier -------------------------------------------------------------------------


def test_a_tampered_or_foreign_record_is_never_served(nodes_single: tuple[Node, Node], single: RedisServer,
                                                      engine: ModelEngine) -> None:
    a, b = nodes_single
    r = redis.Redis.from_url(single.url)
    invalid = 'tokcache_tier_records_total{model="qwen3",result="invalid"}'
    with SidecarClient(a.address, zero_rpc=False) as ca, SidecarClient(b.address, zero_rpc=False) as cb:
        fp = cb.list_models()[0].fingerprint
        # Tampered: other ids (they do not spell the answer); foreign: another tokenizer's record.
        for name_of_case, tamper in (("tampered", lambda gen: encode_value(fp, list(reversed(gen)))),
                                     ("foreign", lambda gen: encode_value("e" * 32, gen))):
            conv = Conversation(engine)  # a new conversation (salt) per case: B has never seen it
            text = conv.prompt(ca)
            ids = conv.tokenize(ca, text)
            written = _value(a, WRITES_OK)
            gen = conv.generate(ca, text, ids)
            _wait_writes(a, written + 1)
            answer = conv.msgs[-2]["content"]
            key = segment_key(conv.salt, MODE_KV_STABLE, answer.encode())
            name = b"tokcache:ar:" + fp.encode() + b":" + key.hex().encode()
            assert r.exists(name), "the recorded output is not in the tier under its segment key"
            r.set(name, tamper(gen))
            before = _value(b, invalid)
            got = conv.tokenize(cb, conv.prompt(cb))
            assert not _extends(got, ids, gen), name_of_case
            canonical = engine.reference.encode(answer)
            assert got[len(ids):len(ids) + len(canonical)] == canonical, name_of_case  # encoded, not spliced
            assert _value(b, invalid) == before + 1, name_of_case  # counted
    r.close()


# -- the tier fails mid-run ------------------------------------------------------------------


def _run_through_outage(a: Node, b: Node, engine: ModelEngine, kill: Any, revive: Any) -> tuple[list[bool], int]:
    """Moves A -> B before, during and after an outage; (extends per move, failed Tokenize calls).

    Each move is a new conversation: one that moved while the tier was down keeps, on B,
    the ids B served it then (B's own KV), so it never extends A's ids again — by design.
    """
    failures = 0
    out: list[bool] = []
    with SidecarClient(a.address, zero_rpc=False, timeout=5) as ca, \
            SidecarClient(b.address, zero_rpc=False, timeout=5) as cb:

        def move(wait: bool) -> bool:
            nonlocal failures
            conv = Conversation(engine)
            try:
                text = conv.prompt(ca)
                ids = conv.tokenize(ca, text)
                written = _value(a, WRITES_OK)
                gen = conv.generate(ca, text, ids)
                if wait:
                    _wait_writes(a, written + 1, timeout=3)
                return _extends(conv.tokenize(cb, conv.prompt(cb)), ids, gen)
            except TokcacheError:
                failures += 1
                return False

        out += [move(True), move(True)]
        kill()
        out += [move(False) for _ in range(3)]
        revive()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ok = move(True)
            except AssertionError:  # A's breaker still open: the write did not happen yet
                ok = False
            out.append(ok)
            if out[-2:] == [True, True] and len(out) > 6:
                break
            time.sleep(0.3)
    return out, failures


def test_single_node_tier_killed_mid_run(nodes_single: tuple[Node, Node], single: RedisServer,
                                         engine: ModelEngine) -> None:
    a, b = nodes_single
    out, failures = _run_through_outage(a, b, engine, single.kill, single.start)
    assert failures == 0
    assert out[:2] == [True, True] and out[-2:] == [True, True], out
    assert _value(b, 'tokcache_tier_lookups_total{result="error"}') + \
        _value(b, 'tokcache_tier_lookups_total{result="refused"}') >= 1


def test_cluster_node_killed_mid_run(nodes_cluster: tuple[Node, Node], three: RedisCluster,
                                     engine: ModelEngine) -> None:
    a, b = nodes_cluster
    victim = three.nodes[2]

    def revive() -> None:
        victim.start()
        three.wait_ok()

    out, failures = _run_through_outage(a, b, engine, victim.kill, revive)
    assert failures == 0
    assert out[:2] == [True, True] and out[-2:] == [True, True], out
