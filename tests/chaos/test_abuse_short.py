"""The ``abuse`` scenario in its short form (CI, under 20 s): clients that never read, a STAT
flood, slowloris and a connection flood against a real ``dcp-server`` with stated caps,
while a neighbour's NOOPs are timed. The long form and its figures: docs/reliability.md.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tools.chaos.abuse import NEIGHBOUR_MAX_S, _verdict, run_abuse
from tools.chaos.cli import failed


def test_a_traceback_in_the_log_counts_as_a_violation() -> None:
    """The module rules and docs/reliability.md count a logged traceback as a violation,
    even when the server survived and every bound held."""
    mon = SimpleNamespace(
        killed_by_guard=False,
        guard_bytes=0,
        neighbour_reconnects=0,
        latency={"amplification": [0.001, 0.002]},
    )
    server = SimpleNamespace(crash_signatures=lambda: ["Traceback: KeyError 'x'"])
    report = {"findings": [], "phases": {"amplification": {"rss_growth_mib": 1}}}
    verdict = _verdict(report, mon, server, True, 140 << 20)  # type: ignore[arg-type]
    assert verdict["violations"] == 1 and verdict["crashes"] == 1
    assert report["findings"] == ["traceback in the server's log: Traceback: KeyError 'x'"]


@pytest.mark.slow
async def test_abusive_clients_neither_kill_the_server_nor_grow_it_nor_stall_a_neighbour(
    tmp_path,
) -> None:
    r = await run_abuse(
        tmp_path,
        short=True,
        connection_output_cap_mib=4,
        total_output_cap_mib=64,
        rss_guard_mib=1024,
    )
    summary = "\n".join(r["findings"]) + f"\n{r['phases']}"
    assert r["errors"] == 0, r["errors_detail"]
    assert r["server_survived"] and not r["killed_by_guard"] and r["crashes"] == 0, summary
    assert set(r["phases"]) == {"amplification", "stat_flood", "slowloris", "connection_flood"}
    # stated bound: total_output_cap + 3 values + 64 MiB = 64 + 12 + 64 = 140 MiB
    assert r["rss_growth_bound_mib"] == 140
    for name, phase in r["phases"].items():
        assert phase["rss_growth_mib"] <= 140, (name, summary)
    assert r["neighbour"]["count"] > 20
    assert r["neighbour"]["max_ms"] <= NEIGHBOUR_MAX_S * 1000, summary
    assert not failed(r), summary
    assert r["wall_s"] < 60  # about 15 s alone; a loaded 2-core CI takes longer
