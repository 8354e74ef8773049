"""``python -m tools.bench tls`` keeps working: a tiny run, its output checked.

One run of ``python -m tools.bench tls --tiny --json`` (about 10 s: stream-memory and
ingest over TLS and plaintext on one server, then SCRAM-SHA512 and PLAIN logins) feeds
every test here. Nothing is asserted about speed: only that each half ran over the
transport it names, that every item written arrived, and that the JSON has the fields
the report reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("psutil", reason="the bench tool needs psutil (the bench extra)")
pytest.importorskip("trustme", reason="the tls bench makes its certificate with trustme")


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "tls.json"
    cmd = [sys.executable, "-m", "tools.bench", "tls", "--tiny", "--json"]
    cmd += ["--no-install", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    return printed


def test_tls_and_plaintext_halves_delivered_everything(doc: dict[str, Any]) -> None:
    assert list(doc["results"]) == ["tls"]
    rows = {row["name"]: row for row in doc["results"]["tls"]["rows"]}
    assert list(rows) == ["tls stream-memory", "tls ingest", "logins SCRAM-SHA512", "logins PLAIN"]
    for name in ("tls stream-memory", "tls ingest"):
        tls_runs, plain_runs = rows[name]["ours"]["runs"], rows[name]["peer"]["runs"]
        assert tls_runs and plain_runs
        assert all(run["tls"] is True for run in tls_runs)
        assert all(run["tls"] is False for run in plain_runs)
        for run in tls_runs + plain_runs:
            assert run["count"] == run["expected"] > 0
            assert run["rate"] > 0


def test_logins_and_ratios_are_reported(doc: dict[str, Any]) -> None:
    tls = doc["results"]["tls"]
    rows = {row["name"]: row for row in tls["rows"]}
    for mechanism in ("SCRAM-SHA512", "PLAIN"):
        assert rows[f"logins {mechanism}"]["ours"]["median"] > 0
        assert tls["login_server_cpu_us"][mechanism] >= 0
    assert set(tls["tls_ratios"]) == {"tls stream-memory", "tls ingest"}
    assert all(ratio > 0 for ratio in tls["tls_ratios"].values())
    assert tls["goal"].startswith("TLS >= 0.6x plaintext")
    assert tls["met"] in (True, False)
