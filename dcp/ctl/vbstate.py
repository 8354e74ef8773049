"""``dcpctl set-state | promote | move``: change vbucket states over SET_VBUCKET_STATE.

Rules of this module:
- Requests go through ``Remote`` (``set_vbucket_states`` pipelines one request per
  vbucket in one write; ``get_vbucket`` reads one state). The options JSON is the one
  the server documents for SET_VBUCKET_STATE (docs/dcpctl.md): ``{"source": "HOST:PORT"}``
  to replicate from a node, plus ``"takeover": true`` for ``move``.
- Results are reported per run of consecutive vbuckets with the same outcome, so a
  range of 1024 prints a line or two, not 1024. Any refused vbucket makes the exit
  status 1, and the stderr line names the first refused vbucket and its status.
- ``move`` prints each step as it completes (a takeover can take a while) and never
  waits unbounded: ``--takeover-timeout`` bounds the wait for the target to become
  active, and a short grace bounds the wait for the source to report dead.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import trio

from ..protocol import Status, VBucketState
from .args import split_address
from .output import CtlError, Output
from .remote import Remote, status_name

__all__ = ["cmd_move", "cmd_promote", "cmd_set_state", "runs"]

#: How long ``move`` lets the old active take to report DEAD once the new one is
#: active: the hand-over marks the source dead before it tells the target to go active,
#: so this only covers the two answers crossing on different connections.
SOURCE_DEAD_GRACE = 5.0
POLL_INTERVAL = 0.05


def runs(results: dict[int, tuple[int, str]]) -> list[dict[str, Any]]:
    """Consecutive vbuckets with the same (status, context), as ranges, in vbucket order."""
    out: list[dict[str, Any]] = []
    for vb in sorted(results):
        status, ctx = results[vb]
        last = out[-1] if out else None
        if last and last["last"] == vb - 1 and (last["_status"], last["error"]) == (status, ctx):
            last["last"] = vb
            continue
        name = status_name(status)
        out.append({"first": vb, "last": vb, "_status": status, "status": name, "error": ctx})
    for r in out:
        r["vbuckets"] = str(r["first"]) if r["first"] == r["last"] else f"{r['first']}-{r['last']}"
        r["ok"] = r.pop("_status") == Status.SUCCESS
    return out


def _ranges_text(vbs: list[int]) -> str:
    return ", ".join(r["vbuckets"] for r in runs(dict.fromkeys(vbs, (0, ""))))


def _fail_if_refused(what: str, rows: list[dict[str, Any]]) -> None:
    bad = [r for r in rows if not r["ok"]]
    if bad:
        n = sum(r["last"] - r["first"] + 1 for r in bad)
        first = bad[0]
        ctx = f" ({first['error']})" if first["error"] else ""
        raise CtlError(
            f"{what} refused for {n} vbucket{'s' if n > 1 else ''}: first vb {first['first']}: "
            f"{first['status']}{ctx}"
        )


def _print_rows(out: Output, verb: str, rows: list[dict[str, Any]]) -> None:
    for r in rows:
        if r["ok"]:
            out.line(f"vb {r['vbuckets']}: {verb}")
        else:
            ctx = f" ({r['error']})" if r["error"] else ""
            out.line(f"vb {r['vbuckets']}: {r['status']}{ctx}")


# ---------------------------------------------------------------------- set-state


async def cmd_set_state(args: argparse.Namespace, out: Output) -> int:
    state = VBucketState[args.state.upper()]
    options = None
    if args.source:
        if state not in (VBucketState.REPLICA, VBucketState.PENDING):
            raise CtlError("--source goes with state replica or pending", code=2)
        options = {"source": args.source}
    async with Remote.of(args) as r:
        rows = runs(await r.set_vbucket_states(args.vbuckets, state, options))
    verb = args.state + (f" (source {args.source})" if args.source else "")
    if out.json_mode:
        out.json({"server": r.where, "state": args.state, "options": options, "results": rows})
    else:
        _print_rows(out, verb, rows)
    _fail_if_refused(f"SET_VBUCKET_STATE {args.state}", rows)
    return 0


# ---------------------------------------------------------------------- promote


async def cmd_promote(args: argparse.Namespace, out: Output) -> int:
    wanted = sorted({vb for group in args.vbuckets for vb in group})
    async with Remote.of(args) as r:
        (pairs,) = await r.stats("vbucket")
        state_of = {int(k[3:]): v for k, v in pairs if k.startswith("vb_") and k[3:].isdigit()}
        if wanted:
            vbs = wanted
        else:
            vbs = [vb for vb, s in sorted(state_of.items()) if s == "replica"]
        already = [vb for vb in vbs if state_of.get(vb) == "active"]
        results = await r.set_vbucket_states(vbs, VBucketState.ACTIVE) if vbs else {}
    rows = runs(results)
    promoted = [vb for vb, (st, _) in results.items() if st == Status.SUCCESS and vb not in already]
    doc = {
        "server": r.where,
        "promoted": len(promoted),
        "already_active": len(already),
        "results": rows,
    }
    if out.json_mode:
        out.json(doc)
    elif not vbs:
        out.line(f"no replica vbuckets on {r.where}: nothing to promote")
    else:
        _print_rows(out, "active", rows)
        extra = f" ({len(already)} already active)" if already else ""
        ranges = f": vb {_ranges_text(promoted)}" if promoted else ""
        out.line(f"promoted {len(promoted)} vbuckets on {r.where}{ranges}{extra}")
    _fail_if_refused("SET_VBUCKET_STATE active", rows)
    return 0


# ---------------------------------------------------------------------- move


async def _await_state(
    remote: Remote, vb: int, want: VBucketState, timeout: float
) -> tuple[VBucketState, float]:
    """Poll GET_VBUCKET until ``want`` or ``timeout``; the last state seen and seconds
    (a timeout before the first answer raises ``CtlError``)."""
    t0 = time.monotonic()
    state: VBucketState | None = None
    with trio.move_on_after(timeout):
        while True:
            state = await remote.get_vbucket(vb)
            if state == want:
                break
            await trio.sleep(POLL_INTERVAL)
    if state is None:
        raise CtlError(f"{remote.where} did not answer GET_VBUCKET {vb} within {timeout:g}s")
    return state, time.monotonic() - t0


async def _takeover_progress(remote: Remote, vb: int) -> str:
    """What the target says about its takeover stream (for a timeout message)."""
    (pairs,) = await remote.stats("replication", optional=("replication",))
    if pairs is None:
        return ""
    fields = {k.partition(":")[2]: v for k, v in pairs if k.startswith(f"vb_{vb}:")}
    parts = [f"{k} {fields[k]}" for k in ("stream", "lag") if k in fields]
    return f" (its replication of vb {vb}: {', '.join(parts)})" if parts else ""


def _check(what: str, result: tuple[int, str]) -> None:
    status, ctx = result
    if status != Status.SUCCESS:
        raise CtlError(f"{what}: {status_name(status)}" + (f" ({ctx})" if ctx else ""))


async def cmd_move(args: argparse.Namespace, out: Output) -> int:
    vb = args.vbucket
    b_host, b_port = split_address(args.to)
    steps: list[dict[str, Any]] = []
    t_start = time.monotonic()

    def step(node: str, text: str) -> None:
        steps.append({"node": node, "step": text, "at_s": round(time.monotonic() - t_start, 3)})
        if not out.json_mode:
            out.line(f"{node}: {text}")

    async with (
        Remote.of(args) as a,
        Remote.of(args, b_host, b_port) as b,
    ):
        if a.where == b.where:
            raise CtlError(f"--to {b.where} is the node the vbucket is on", code=2)
        state = await a.get_vbucket(vb)
        if state != VBucketState.ACTIVE:
            raise CtlError(
                f"vb {vb} is {state.name.lower()} on {a.where}, not active: "
                "move starts from the node holding the active copy (--host/--port)"
            )
        step(a.where, f"vb {vb} is active")
        options = {"source": a.where, "takeover": True}
        res = await b.set_vbucket_states([vb], VBucketState.REPLICA, options)
        _check(f"{b.where} refused the takeover of vb {vb}", res[vb])
        step(b.where, f"vb {vb} replica, taking over from {a.where}")
        state, waited = await _await_state(b, vb, VBucketState.ACTIVE, args.takeover_timeout)
        if state != VBucketState.ACTIVE:
            why = await _takeover_progress(b, vb)
            raise CtlError(
                f"vb {vb} is still {state.name.lower()} on {b.where} after "
                f"{args.takeover_timeout:g} s (--takeover-timeout){why}"
            )
        step(b.where, f"vb {vb} active after {waited:.2f} s")
        state, _ = await _await_state(a, vb, VBucketState.DEAD, SOURCE_DEAD_GRACE)
        if state != VBucketState.DEAD:
            raise CtlError(
                f"vb {vb} is active on {b.where} but {a.where} reports it "
                f"{state.name.lower()}, not dead: check both nodes before writing"
            )
        step(a.where, f"vb {vb} dead")
        res = await a.set_vbucket_states([vb], VBucketState.REPLICA, {"source": b.where})
        _check(f"{a.where} refused to become a replica of {b.where}", res[vb])
        step(a.where, f"vb {vb} replica of {b.where}")
    total = time.monotonic() - t_start
    if out.json_mode:
        out.json({"vbucket": vb, "from": a.where, "to": b.where, "seconds": total, "steps": steps})
    else:
        out.line(f"moved vb {vb} from {a.where} to {b.where} in {total:.2f} s")
    return 0
