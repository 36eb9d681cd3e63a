"""``make demo`` shows the problem and the fix: units, decisions, fewer prefilled tokens, the command it ran."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_demo_shows_prefill_saved_by_recorded_ids() -> None:
    out = subprocess.run([sys.executable, "-m", "tokcache.sidecar.demo"], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert text.startswith("$ tokcache-sidecar serve --listen unix://")  # the exact command it ran
    assert re.search(r"^\s+tokens\s+tokens\s+tokens\s+tokens\s+chars\s+µs\s+µs$", text, re.M)  # units
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(.+)$", text, re.M)
    assert len(rows) == 5
    for turn, prompt, alone, tc, source, _cached, _encoded, tc_us, plain_us, ids in rows[1:]:
        assert source == "ar" and ids == "model's own", turn  # the recorded ids came back
        assert int(tc) < int(alone) <= int(prompt), turn  # and vLLM prefills less
        assert int(tc_us) > 0 and int(plain_us) > 0
    m = re.search(r"vLLM prefills (\d+) prompt tokens alone, (\d+) with tokcache", text)
    assert m and int(m.group(2)) * 2 < int(m.group(1))
    assert "0 over RPC" in text and "sidecar stopped, shared memory removed" in text
