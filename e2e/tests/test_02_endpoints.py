"""Other ways prompts reach the sidecar, and what is (not) recorded.

Decisions are observed two ways: the plugin's own counters on vLLM's
``/metrics`` (``tokcache_vllm_*``), and the sidecar itself, asked directly for
the same text (a second identical request is an L0 hit).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from e2e.tests.harness import BANNED, Sidecar, VllmServer, common_prefix, held_back, span_objects, wait_until
from sidecar_client import SidecarClient

TOK = "tokcache_vllm_tokenize_total"


def served(m: dict[str, float], source: str | None = None) -> float:
    return m.get(f'{TOK}{{source="{source}"}}', 0.0) if source else m.get(TOK, 0.0)


def counter(m: dict[str, float], family: str, label: str, value: str) -> float:
    return m.get(f'tokcache_vllm_{family}_total{{{label}="{value}"}}', 0.0)


def test_completions_text_prompt_goes_through_the_sidecar(plugin: VllmServer, sidecar: Sidecar,
                                                          report: Callable[[str], None]) -> None:
    text = f"Once upon a time, in a cache far away ({uuid.uuid4().hex[:8]}), there was"
    body = {"model": plugin.model, "prompt": text, "max_tokens": 4, "return_token_ids": True}
    m0 = plugin.metrics()
    first = plugin.post("/v1/completions", body)
    m1 = plugin.metrics()
    second = plugin.post("/v1/completions", body)
    m2 = plugin.metrics()
    assert served(m1) - served(m0) == 1 and served(m1, "miss") - served(m0, "miss") == 1
    assert served(m2) - served(m1) == 1 and served(m2, "l0") - served(m1, "l0") == 1  # the repeat: exact hit
    assert m2.get("tokcache_vllm_fallback_total", 0) == m0.get("tokcache_vllm_fallback_total", 0)
    with SidecarClient(sidecar.address) as c:
        direct = c.tokenize("qwen3", text=text, add_special_tokens=True)
    assert first["choices"][0]["prompt_token_ids"] == second["choices"][0]["prompt_token_ids"] == direct.token_ids
    assert direct.decision.source == "l0"
    report(f"/v1/completions: 1st Tokenize decision 'miss', 2nd 'l0' (plugin counters); direct Tokenize of the "
           f"same text afterwards: {direct.decision.source}, {len(direct.token_ids)} ids = vLLM's prompt_token_ids")


def test_tokenize_endpoint_reads_and_fills_the_node_cache(plugin: VllmServer, sidecar: Sidecar) -> None:
    """vLLM's /tokenize reads the node's cache in vLLM's process. No record follows such a
    read: what it learned waits RECORD_DEFER_S for one, then the process's next read stores
    it, and every process on the node (here the sidecar) has the texts as L0 entries."""
    from sidecar_client._local import RECORD_DEFER_S

    # Over 4 KiB each: a read stores what it learned once its uncached tail is that long (the
    # client's MIN_WRITE_BYTES).
    filler = " ".join(f"word{i}" for i in range(800))
    text = f"Tokenize me, {uuid.uuid4().hex[:8]}:\n\n  spaced   out {filler}"
    messages = [{"role": "user", "content": f"Hello there {uuid.uuid4().hex[:8]} {filler}"}]
    m0 = plugin.metrics()
    by_prompt = plugin.post("/tokenize", {"model": plugin.model, "prompt": text})
    by_messages = plugin.post("/tokenize", {"model": plugin.model, "messages": messages})
    m1 = plugin.metrics()
    assert served(m1) - served(m0) == 2
    time.sleep(RECORD_DEFER_S + 0.5)
    plugin.post("/tokenize", {"model": plugin.model, "prompt": f"a later read {uuid.uuid4().hex[:8]}"})
    with SidecarClient(sidecar.address) as c:
        direct_text = c.tokenize("qwen3", text=text, add_special_tokens=True)
        direct_chat = c.tokenize("qwen3", messages=messages, add_generation_prompt=True)
    assert by_prompt["tokens"] == direct_text.token_ids
    assert direct_text.decision.source == "l0"  # stored by vLLM's process
    assert by_messages["tokens"] == direct_chat.token_ids
    assert direct_chat.decision.source == "l0"


Choices = dict[int, tuple[str, list[int]]]


def _choices(server: VllmServer, body: dict[str, Any], stream: bool) -> tuple[list[int], Choices]:
    if not stream:
        resp = server.post("/v1/chat/completions", body)
        return resp["prompt_token_ids"], {c["index"]: (c["message"]["content"] or "", c["token_ids"])
                                          for c in resp["choices"]}
    prompt: list[int] = []
    acc: dict[int, tuple[list[str], list[int]]] = {}
    for chunk in server.stream("/v1/chat/completions", body):
        prompt = chunk.get("prompt_token_ids") or prompt
        for c in chunk.get("choices", []):
            texts, ids = acc.setdefault(c["index"], ([], []))
            texts.append((c.get("delta") or {}).get("content") or "")
            ids.extend(c.get("token_ids") or [])
    return prompt, {i: ("".join(t), ids) for i, (t, ids) in acc.items()}


def test_n2_every_choice_is_recorded(plugin: VllmServer, decode: Callable[[list[int]], str],
                                     report: Callable[[str], None]) -> None:
    """n=2, streamed (DELTA, chunks of both choices interleaved) and not (FINAL_ONLY):
    continuing the conversation with the SECOND choice is still an exact extension."""
    lines = []
    for stream in (True, False):
        messages = [{"role": "user", "content": f"Two answers please ({'stream' if stream else 'final'})."}]
        body = {"model": plugin.model, "messages": messages, "n": 2, "temperature": 1.0, "max_tokens": 24,
                "seed": 7, "return_token_ids": True, "logit_bias": BANNED}
        m0 = plugin.metrics()
        prompt, choices = _choices(plugin, body, stream)
        assert sorted(choices) == [0, 1] and choices[0][1] != choices[1][1]
        assert wait_until(lambda m0=m0: counter(plugin.metrics(), "records", "result", "recorded")
                          - counter(m0, "records", "result", "recorded") >= 2, 10), \
            ({k: v for k, v in plugin.metrics().items() if "record" in k}, m0)
        content, gen = choices[1]
        follow = {"model": plugin.model, "max_tokens": 4, "return_token_ids": True,
                  "messages": [*messages, {"role": "assistant", "content": content},
                               {"role": "user", "content": "And then?"}]}
        nxt = plugin.post("/v1/chat/completions", follow)["prompt_token_ids"]
        expected = prompt + gen[:len(gen) - held_back(gen, content, decode)]
        assert common_prefix(nxt, expected) == len(expected)
        lines.append(f"n=2 {'stream (DELTA)' if stream else 'non-stream (FINAL_ONLY)'}: both choices recorded; "
                     f"follow-up on choice 1 extends prompt+output exactly ({len(expected)}/{len(expected)} ids)")
    report("\n".join(lines))


def test_stop_string_finish_is_not_sent(plugin: VllmServer) -> None:
    # Random text has spaces everywhere: the stop string ends the generation within a few tokens.
    body = {"model": plugin.model, "messages": [{"role": "user", "content": "stop early"}], "max_tokens": 30,
            "temperature": 1.0, "seed": 3, "stop": [" "], "logit_bias": BANNED}
    m0 = plugin.metrics()
    resp = plugin.post("/v1/chat/completions", body)
    assert resp["choices"][0]["finish_reason"] == "stop" and resp["choices"][0]["stop_reason"] == " "
    assert wait_until(lambda: counter(plugin.metrics(), "record_skips", "reason", "stop_string")
                      - counter(m0, "record_skips", "reason", "stop_string") == 1, 5)
    m1 = plugin.metrics()
    assert counter(m1, "records", "result", "queued") == counter(m0, "records", "result", "queued")


def test_cache_salt_reaches_the_sidecar(plugin: VllmServer, sidecar: Sidecar) -> None:
    salt = f"tenant-{uuid.uuid4().hex[:8]}"
    text = f"A salted prompt {uuid.uuid4().hex[:8]}"
    plugin.post("/v1/completions", {"model": plugin.model, "prompt": text, "max_tokens": 2, "cache_salt": salt})
    with SidecarClient(sidecar.address) as c:
        same = c.tokenize("qwen3", text=text, add_special_tokens=True, cache_salt=salt)
        other = c.tokenize("qwen3", text=text, add_special_tokens=True, cache_salt=salt + "-other")
    assert same.decision.source == "l0"  # the plugin's Tokenize carried this salt
    assert other.decision.source == "miss"  # and entries are per salt


def test_salted_conversation_is_exact(plugin: VllmServer, decode: Callable[[list[int]], str],
                                     report: Callable[[str], None]) -> None:
    from e2e.tests.harness import run_chat

    run = run_chat(plugin, "plugin, cache_salt=tenant-a", stream=False, decode=decode, turns=3, seed=11,
                   cache_salt="tenant-a")
    report(run.table())
    assert all(t.agree == 100.0 for t in run.turns[1:]), run.table()


def test_trace_context_reaches_both_halves_of_the_work(plugin: VllmServer, sidecar: Sidecar,
                                                      report: Callable[[str], None]) -> None:
    """The request's W3C context reaches both halves of the work, both done in vLLM's process
    from shared memory (spans exported by the plugin, OTEL_TRACES_EXPORTER=console): the cache
    decision (``tokcache.Tokenize``) and the record of the output (``tokcache.RecordOutput``).
    The sidecar sees neither: no RPC."""
    trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    body = {"model": plugin.model, "messages": [{"role": "user", "content": f"trace me {trace_id[:6]}"}],
            "max_tokens": 4, "logit_bias": BANNED}
    plugin.post("/v1/chat/completions", body, headers={"traceparent": f"00-{trace_id}-{parent}-01",
                                                        "tracestate": "vendor=tokcache-e2e"})

    def spans(log: str) -> dict[str, dict[str, Any]]:
        found = {}
        for s in span_objects(log):
            if s["context"]["trace_id"] == f"0x{trace_id}":
                found[s["name"].rsplit("/", 1)[-1]] = s
        return found

    assert wait_until(lambda: {"tokcache.Tokenize", "tokcache.RecordOutput"} <= set(spans(plugin.log_text())), 10), \
        plugin.log_tail(3000)
    mine = spans(plugin.log_text())
    read, record = mine["tokcache.Tokenize"], mine["tokcache.RecordOutput"]
    assert read["parent_id"] == f"0x{parent}"  # from the HTTP request, via the ASGI middleware
    assert read["attributes"]["tokcache.served_by"] == "local"
    assert read["attributes"]["tokcache.source"] in ("miss", "l0", "l1", "ar")
    assert record["parent_id"] == f"0x{parent}"  # from AsyncLLM.generate's trace_headers
    assert record["attributes"]["tokcache.served_by"] == "local"
    assert record["attributes"]["tokcache.result"] in ("recorded", "refused")
    got = spans(sidecar.log_tail(400_000))
    assert not {"Tokenize", "RecordOutput", "RecordOutputs"} & set(got)
    report(f"trace context: tokcache.Tokenize (source {read['attributes']['tokcache.source']}) and "
           f"tokcache.RecordOutput ({record['attributes']['tokcache.result']}, "
           f"{record['attributes']['tokcache.recorded_tokens']} ids) spans in vLLM's process, trace {trace_id}, "
           f"parent {parent}; none in the sidecar")
