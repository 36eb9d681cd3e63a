"""docs/configuration.md lists every TOKCACHE_* variable the code reads, and only those.

The code's names are found by grep over the sidecar's and the client's sources (generated code
aside): a name in a docstring or comment counts as read, so one that goes out of use must leave
the code's text too. A name starting with ``_TOKCACHE_`` is set by tokcache for its own child
processes, not a setting, and is not listed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sidecar_client._core import ADDRESS_ENV
from sidecar_client.vllm._config import ENV as PLUGIN_ENV
from tokcache.sidecar.config import ENV as SIDECAR_ENV

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
SOURCES = (ROOT / "client", ROOT / "sidecar")
GENERATED = ROOT / "client" / "tokcache" / "v1"
NAME = re.compile(r"(?<![A-Za-z0-9_])TOKCACHE_[A-Z0-9]+(?:_[A-Z0-9]+)*")
ROW = re.compile(r"^\|\s*`(TOKCACHE_[A-Z0-9_]+)`\s*\|")


def names_in_code() -> dict[str, list[str]]:
    """Each TOKCACHE_* name in the sources -> the files that mention it."""
    found: dict[str, list[str]] = {}
    for top in SOURCES:
        for path in sorted(top.rglob("*.py")):
            if GENERATED in path.parents:
                continue
            for name in set(NAME.findall(path.read_text(encoding="utf-8"))):
                found.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    return found


def table() -> dict[str, str]:
    """Each variable the table lists -> its "read by" cell."""
    rows: dict[str, str] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} is listed twice in {DOC.name}"
            rows[m.group(1)] = line.rstrip().rstrip("|").rsplit("|", 1)[1]
    return rows


def test_the_table_lists_what_the_code_reads() -> None:
    code, doc = names_in_code(), table()
    assert doc, f"no table rows found in {DOC.name}"
    missing = {name: files for name, files in code.items() if name not in doc}
    assert not missing, f"read by the code but not in {DOC.name}: {missing}"
    unread = sorted(set(doc) - set(code))
    assert not unread, f"listed in {DOC.name} but read nowhere in client/ or sidecar/: {unread}"


@pytest.mark.parametrize(("names", "reader"), [
    (sorted(SIDECAR_ENV.values()), "sidecar"),
    (sorted(PLUGIN_ENV.values()), "vLLM plugin"),
    ([ADDRESS_ENV], "client"),
])
def test_the_table_names_who_reads_each(names: list[str], reader: str) -> None:
    """The variables each component declares (its ENV) are listed as read by it."""
    doc = table()
    wrong = [n for n in names if reader not in doc.get(n, "")]
    assert not wrong, f"{DOC.name} does not say {reader} reads {wrong}"


def test_the_grep_finds_names_and_skips_internal_ones() -> None:
    text = 'ENV = "TOKCACHE_SHM_SIZE"  # TOKCACHE_* and TOKCACHE_ alone; _TOKCACHE_BYPASS_NOTED is internal'
    assert NAME.findall(text) == ["TOKCACHE_SHM_SIZE"]
