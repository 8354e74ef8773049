"""The ``failover`` scenario's verdict: every check on what the run recorded, and the report.

Rules of this module:
- Runs after every process is gone: it reads the consumers' journals, status and saved
  views from their directories, and the run's records (writers' attempts, failover logs
  seen, rounds); it writes ``writer.jsonl`` (every attempt) next to them.
- Failure counters (``cli.FAILURE_KEYS``): ``divergences`` (a consumer's journal fails
  ``verify.verify_journal``, a final view differs from the cluster's documents, a
  stable-only consumer rolled back, a value nobody wrote, a write acknowledged at a
  majority level lost), ``violations`` (``failover_verify.epoch_violations``),
  ``errors`` (rounds that did not heal, consumers or harness that failed) and
  ``crashes`` (tracebacks in a node's log). Lost writes at none and persistActive are
  reported per level, never counted as failures: a single failure may lose them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from .failover_verify import epoch_violations, level_counts
from .failover_writer import MAJORITY_LEVELS, LevelAttempt
from .procs import HOST
from .verify import Truth, verify_journal
from .view import read_journal
from .writer import WriterLog

if TYPE_CHECKING:
    from .crash import ConsumerProc
    from .failover import _Run

__all__ = ["report"]


def _consumers(
    procs: list[ConsumerProc], truth: Truth, state: dict[str, str] | None
) -> tuple[dict[str, Any], list[str]]:
    per: dict[str, Any] = {}
    findings: list[str] = []
    for c in procs:
        view, found, counts = verify_journal(c.name, read_journal(c.dir / "journal.jsonl"), truth)
        findings += found
        stable = c.name.startswith("chaos-stable")
        if stable and counts["rollbacks"]:
            findings.append(f"{c.name}: stable-only, yet rolled back {counts['rollbacks']} times")
        if state is not None:
            mine = view.state()
            diff = set(mine.items()) ^ set(state.items())
            if diff:
                findings.append(
                    f"{c.name}: final view differs from the cluster on {len(diff)} documents, "
                    f"e.g. {sorted(diff)[:3]}"
                )
            try:
                saved = json.loads((c.dir / "view.json").read_text())["state"]
                if saved != mine:
                    findings.append(f"{c.name}: view.json differs from its journal replay")
            except (OSError, ValueError, KeyError):
                findings.append(f"{c.name}: no view.json written at exit")
        st = c.status().get("counts", {})
        per[c.name] = {
            "stable_only": stable,
            "rollbacks": counts["rollbacks"],
            "snapshots": counts["batches"],
            "events": counts["events"],
            "acked_writes_checked": counts["checked_writes"],
            "disk_snapshots": counts["disk_snapshots"],
            "starts": st.get("starts", 0),
        }
    return per, findings


def report(
    run: _Run,
    procs: list[ConsumerProc],
    state: dict[str, str] | None,
    crashes: list[str],
    seed: int,
    options: dict[str, Any],
) -> dict[str, Any]:
    """Check everything (module rules) and build the report."""
    attempts: list[LevelAttempt] = [a for a in run.log if isinstance(a, LevelAttempt)]
    names = {f"{HOST}:{n.port}": name for name, n in run.cl.nodes.items()}
    for a in attempts:
        a.node = names.get(a.node, a.node)
    WriterLog(list(run.log)).dump(run.workdir / "writer.jsonl")
    truth = Truth(run.log, options["num_vbuckets"])
    findings = list(run.findings)
    per_level: dict[str, dict[str, int]] = {}
    if state is not None:
        for key, value in state.items():
            why = truth.plausible("m", key, value)
            if why:
                findings.append(f"cluster: {key} holds an invented value: {why}")
        per_level, lost = level_counts(attempts, state)
        findings += lost
    per_consumer, found = _consumers(procs, truth, state)
    findings += found
    logs = {vb: [list(x) for x in seen] for vb, seen in run.logs_by_vb.items()}
    violations, epochs = epoch_violations(attempts, logs)
    kinds: dict[str, int] = {}
    for r in run.rounds:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    heal = [r["healed_s"] for r in run.rounds]
    failover = [r["failed_over_s"] for r in run.rounds if "failed_over_s" in r]
    lost_majority = sum(c["lost"] for lv, c in per_level.items() if lv in MAJORITY_LEVELS)
    rollbacks = {True: 0, False: 0}
    for c in per_consumer.values():
        rollbacks[c["stable_only"]] += c["rollbacks"]
    return {
        "scenario": "failover",
        "seed": seed,
        "rounds": len(run.rounds),
        "rounds_asked": options["rounds"],
        "round_kinds": kinds,
        "failover_s_max": max(failover, default=0.0),
        "heal_s_max": max(heal, default=0.0),
        "heal_s_mean": round(sum(heal) / len(heal), 2) if heal else 0.0,
        "writes": WriterLog(list(run.log)).counts(),
        "per_level": {lv: c for lv, c in per_level.items() if c["attempts"]},
        "acked_majority_lost": lost_majority,
        "rollbacks_normal": rollbacks[False],
        "rollbacks_stable_only": rollbacks[True],
        "epochs": epochs,
        "final_documents": None if state is None else len(state),
        "per_consumer": per_consumer,
        "per_round": run.rounds,
        "divergences": len(findings),
        "violations": len(violations),
        "errors": len(run.errors),
        "errors_detail": run.errors[:50],
        "crashes": len(crashes),
        "findings": (
            [f"node traceback (x{n}): {t}" for t, n in Counter(crashes).most_common()]
            + violations
            + findings
            + run.errors
        )[:200],
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
        "elapsed_s": round(time.monotonic() - run.t0, 1),
    }
