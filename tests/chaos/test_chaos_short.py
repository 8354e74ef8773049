"""Every chaos scenario in a short form (CI): tiny sizes, the same checks, zero tolerance.

The long runs and their figures are in ``docs/reliability.md``; these run the same code
(``tools/chaos/``) with a few rounds / a few thousand frames, and fail on any
divergence, crash or error the report counts.
"""

from __future__ import annotations

from typing import Any

import pytest

from tools.chaos.cli import FAILURE_KEYS, failed
from tools.chaos.crash import run_crash
from tools.chaos.fuzz import run_fuzz
from tools.chaos.slow import run_slow
from tools.chaos.storage import run_storage

pytestmark = pytest.mark.slow


def _assert_clean(report: dict[str, Any]) -> None:
    bad = {k: report[k] for k in FAILURE_KEYS if report.get(k)}
    assert not failed(report), f"{bad}: " + "\n".join(report.get("findings", [])[:20])


async def test_crash_short_run_loses_nothing_invents_nothing_and_exposes_no_partial_snapshot(
    tmp_path,
) -> None:
    r = await run_crash(
        tmp_path,
        rounds=3,
        consumers=2,
        num_vbuckets=4,
        keys_per_vb=10,
        seed=7,
        min_up=0.3,
        max_up=0.8,
        graceful_prob=0.3,
        freeze_prob=0.0,  # SIGSTOP rounds take 2-5 s: long runs only
        converge_timeout=60.0,
        time_limit=60.0,
    )
    _assert_clean(r)
    assert r["rounds"] == 3
    assert r["writes"]["acked"] > 50
    assert r["snapshots_verified"] > 0 and r["acked_writes_checked"] > 0


async def test_fuzz_short_run_never_crashes_the_server_nor_disturbs_a_healthy_stream(
    tmp_path,
) -> None:
    r = await run_fuzz(
        tmp_path,
        frames=4000,
        connections=2,
        num_vbuckets=4,
        seed=7,
        corpus_size=60,
        max_burst=500,
        time_limit=60.0,
    )
    _assert_clean(r)
    assert r["frames_sent"] >= 4000
    assert r["server_answers_at_end"]
    assert r["healthy_snapshots_verified"] > 0


async def test_slow_short_run_drops_cursors_bounds_memory_and_backfills_everything(
    tmp_path,
) -> None:
    r = await run_slow(
        tmp_path,
        seconds=4.0,
        quota_mib=1,
        num_vbuckets=4,
        keys=2000,
        value_bytes=512,
        seed=7,
        resume_timeout=60.0,
    )
    _assert_clean(r)
    for name, c in r["consumers"].items():
        assert c["cursor_drops"] or c["samples_with_cursor_dropped"], name
        assert c["disk_snapshots"] > 0, name


async def test_storage_short_run_refuses_writes_when_full_and_loses_nothing_acknowledged(
    tmp_path,
) -> None:
    r = await run_storage(
        tmp_path, map_mib=2, grown_map_mib=32, num_vbuckets=4, full_seconds=1.0, seed=7
    )
    _assert_clean(r)
    assert r["etmpfail_answers"] > 0
    assert r["writes_ok_after_grow"] == 200
