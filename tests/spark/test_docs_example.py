"""The runnable example of docs/spark.md runs against the real server (in this session)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .helpers import ThreadServer

pytestmark = pytest.mark.spark

DOC = Path(__file__).resolve().parents[2] / "docs" / "spark.md"
EXAMPLES = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "DCP_PORT" in b]


def test_the_doc_has_a_runnable_example():
    assert len(EXAMPLES) == 1


def test_the_doc_example_runs(spark, tmp_path, monkeypatch, capsys):
    s = ThreadServer(tmp_path / "d", num_vbuckets=1024)  # the example uses the default
    try:
        monkeypatch.setenv("DCP_PORT", str(s.port))
        monkeypatch.setenv("DCP_SPARK_OUT", str(tmp_path / "out"))
        code = compile(EXAMPLES[0], str(DOC), "exec")
        exec(code, {"__name__": "docs_spark_example"})  # getOrCreate: this session
    finally:
        s.stop()
    out = capsys.readouterr().out
    assert "999 documents" in out
    assert "mutation" in out and "deletion" in out
