"""The project stands alone: code, tests and docs cite files of this repository only.

Why: a reader of a clone has nothing but the clone. A docstring that says "see the
reference §5.4" or "perf-baseline" points at documents that are not in it, so the reason
it gives cannot be checked. Cite ``protocol_spec/README.md``, ``docs/*.md`` or a module
instead, or state the fact itself.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: What a citation of an outside document looks like here (the planning documents that
#: the project was written from live beside the repository, not in it).
OUTSIDE = re.compile(
    r"perf-baseline|peers-baseline|STYLE\.md|DESIGN\.md|research/|\bshared/"
    r"|cluster-reference|dcp-protocol-reference|[Rr]eference §|\bseed 0\d\d"
    # source files of other projects: a path to a C/C++/Erlang/Go/Java file, LMDB's and
    # py-lmdb's sources, Couchbase's repositories (this project has no such files)
    r"|[\w-]+/[\w/.-]*\.(?:h|c|cc|hh|cpp|hpp|erl|hrl|go|java)\b|\b(?:lmdb\.h|mdb\.c)\b"
    r"|\bkv_engine[:/]|\bns_server/|\bkv:include/|\blmdb/cffi\.py"
)

SCANNED = ("dcp", "tools", "tests", "docs", "protocol_spec", "pyspark_dcp")


def _files() -> list[Path]:
    out = [ROOT / "README.md"]
    for top in SCANNED:
        for path in (ROOT / top).rglob("*"):
            if path.suffix in (".py", ".md") and "__pycache__" not in path.parts:
                out.append(path)
    return out


def citations(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line citing an outside document."""
    return [
        (n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)
    ]


def test_no_file_cites_a_document_outside_the_repository() -> None:
    me = Path(__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line}"
        for path in _files()
        if path.resolve() != me
        for n, line in citations(path.read_text(encoding="utf-8"))
    ]
    assert not found, "cite files of this repository instead:\n" + "\n".join(found)


def test_the_check_sees_the_citations_it_is_for() -> None:
    text = (
        "ok line\n"
        "follows reference §5.4 exactly\n"
        "(perf-baseline §6)\n"
        "see STYLE.md\n"
        "see protocol_spec/README.md §8\n"
        "LMDB's file layout (lmdb.h / mdb.c): pages 0 and 1\n"
        "(checked in `lmdb/cffi.py`)\n"
        "Response status codes (``kv:include/mcbp/protocol/status.h``)\n"
        "as engines/ep/src/dcp/active_stream.cc does\n"
        "ns_server/src/ns_config.erl\n"
        "start=st.c, end=SEQNO_MAX; see dcp/producer/engine/datafiles.py\n"
    )
    assert [n for n, _ in citations(text)] == [2, 3, 4, 6, 7, 8, 9, 10]
