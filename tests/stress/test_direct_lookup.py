"""A co-located reader process, with only the read-only attach, gets the ids the server served."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from tests.stress.harness import ROOT, SidecarProc, Workload, channel, stub, unlink_prefix, unpack
from tokcache.v1 import tokenizer_pb2 as pb

READER = """
import json, sys, time
from tokcache.store import DirectLookup
prefix, fingerprint, queries = sys.argv[1], sys.argv[2], json.loads(sys.stdin.read())
with DirectLookup(prefix=prefix, fingerprint=fingerprint) as lookup:
    out = [lookup.get_ids(q["text"], salt=q["salt"], mode=q["mode"]) for q in queries]
    t0 = time.perf_counter()
    for _ in range(20):
        for q in queries:
            lookup.get(q["text"], salt=q["salt"], mode=q["mode"])
    per_lookup = (time.perf_counter() - t0) / (20 * len(queries))
print(json.dumps({"ids": out, "seconds_per_lookup": per_lookup}))
"""


def test_reader_process_gets_what_the_server_served(tmp_path: Path) -> None:
    prefix = f"tkdirect-{uuid.uuid4().hex[:8]}"
    workload = Workload(conversations=6, turns=3, ar_pairs=0, chats=True).build()
    proc = SidecarProc(tmp_path, prefix).start()
    try:
        queries, served = [], []
        with channel(proc.address) as ch:
            s = stub(ch)
            fingerprint = s.ListModels(pb.ListModelsRequest(), timeout=10).models[0].fingerprint
            for item in workload.items:
                request = pb.TokenizeRequest()
                request.CopyFrom(item.request)
                request.return_prompt_text = True
                response = s.Tokenize(request, timeout=30)
                assert item.check(response)
                text = request.text if request.HasField("text") else response.prompt_text
                mode = "exact" if request.mode == pb.TOKENIZE_MODE_EXACT else "kv-stable"
                queries.append({"text": text, "salt": request.cache_salt, "mode": mode})
                served.append(unpack(response.token_ids))  # Qwen3 adds no BOS/EOS: raw == served
            queries.append({"text": "never asked", "salt": "", "mode": "kv-stable"})
        out = subprocess.run([sys.executable, "-c", READER, prefix, fingerprint], input=json.dumps(queries),
                             capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
        result = json.loads(out.stdout)
        assert result["ids"] == [*served, None]
        print(f"direct L0 lookup: {result['seconds_per_lookup'] * 1e6:.1f} µs per lookup")
        assert proc.stop() == 0
    finally:
        proc.kill()
        unlink_prefix(prefix)
