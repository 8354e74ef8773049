"""Scenario ``storage``: a tiny LMDB map fills up. Writes must get a clear temporary
failure (ETMPFAIL 0x86), reads and streams must keep working, nothing acknowledged may be
lost, and after a restart with a larger ``--map-size`` writes must succeed again.

Rules of this module:
- Writes go through a raw-wire client so every status is seen as sent (the SDK's
  ``KvClient`` would retry ETMPFAIL until its timeout). Every acknowledged write is
  remembered (key -> value); nothing else is.
- A streaming SDK consumer runs through the whole scenario (also across the restart,
  reconnecting by itself) and journals what it receives; its view must end equal to the
  acknowledged writes, and a rollback it is told about is counted (it means the server
  discarded acknowledged data).
- The restart is the documented remedy: a graceful stop (SIGTERM), then a start with a
  larger map. The exit status of the stop is reported.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import trio

from dcp.consumer import DcpClient, MemoryOffsetStore, Mutation, RollbackEvent
from dcp.protocol import codec
from dcp.protocol.opcodes import Status

from .crash import stream_state
from .procs import HOST, RawClient, ServerProcess, free_port, scenario, vb_seqnos

__all__ = ["run_storage"]


async def _follow(
    port: int, nv: int, view: dict[str, str], out: dict[str, Any], stop: trio.Event
) -> None:
    """A consumer that streams all along; counts rollbacks; applies rollbacks by rebuilding
    (it keeps per-key history so an undo is exact)."""
    hist: dict[int, list[tuple[int, str, str | None]]] = {}
    out["rollbacks"] = 0
    out["ends"] = {}
    try:
        async with DcpClient(
            HOST,
            port,
            name="storage-follower",
            noop_interval=2.0,
            offset_store=MemoryOffsetStore(),
            retry_timeout=120.0,
        ) as c:
            while not stop.is_set():
                for item in await c.getmany(timeout=0.2):
                    vb = item.vbucket
                    h = hist.setdefault(vb, [])
                    if isinstance(item, RollbackEvent):
                        out["rollbacks"] += 1
                        out.setdefault("rollback_events", []).append(
                            [vb, item.seqno, item.rollback_seqno]
                        )
                        while h and h[-1][0] > item.rollback_seqno:
                            h.pop()
                        out["ends"][vb] = item.rollback_seqno
                    else:
                        for e in item.events:
                            value = e.value.decode() if type(e) is Mutation else None
                            h.append((e.seqno, e.key.decode(), value))
                        out["ends"][vb] = item.end
                await c.commit()
            out["stats"] = c.statistics()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    view.clear()
    for h in hist.values():
        for _seqno, key, value in h:
            if value is None:
                view.pop(key, None)
            else:
                view[key] = value


@scenario
async def run_storage(
    workdir: Path,
    *,
    map_mib: int = 2,
    grown_map_mib: int = 64,
    num_vbuckets: int = 8,
    value_bytes: int = 512,
    full_seconds: float = 3.0,
    seed: int | None = None,
    max_writes: int = 200_000,
) -> dict[str, Any]:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    seed = random.randrange(1 << 32) if seed is None else seed
    rng = random.Random(seed)
    t0 = time.monotonic()
    nv = num_vbuckets
    server = ServerProcess(
        workdir / "data", workdir / "server.log", port=free_port(), num_vbuckets=nv
    )
    port = await server.start(["--map-size", str(map_mib << 20)])
    findings: list[str] = []
    acked: dict[str, str] = {}
    fig: dict[str, Any] = {
        "writes_acked_before_full": 0,
        "etmpfail_answers": 0,
        "other_answers": 0,
        "reads_while_full": 0,
        "durable_while_full": "",
    }
    view: dict[str, str] = {}
    follow: dict[str, Any] = {}
    stop = trio.Event()
    c = await RawClient.connect(port)

    def kv(i: int) -> tuple[str, bytes, int]:
        k = f"st{i:07d}"
        return k, codec.vbucket_for_key(k.encode(), nv), f"{k}|{rng.randrange(1 << 30)}|"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_follow, port, nv, view, follow, stop)
        # ---- fill the map
        i = 0
        context = ""
        while i < max_writes:
            k, vb, v = kv(i)
            r = await c.store(k.encode(), v.encode() + b"x" * value_bytes, vb)
            i += 1
            if r.status == Status.SUCCESS:
                acked[k] = v + "x" * value_bytes
                continue
            if r.status == Status.ETMPFAIL:
                context = bytes(r.value).decode("utf-8", "replace")
                break
            findings.append(f"write {k} answered 0x{r.status:02x} before the map was full")
            break
        fig["writes_acked_before_full"] = len(acked)
        if not context:
            findings.append(f"no ETMPFAIL after {i} writes of {value_bytes} bytes")
        elif "map full" not in context.lower() and "storage" not in context.lower():
            findings.append(f"ETMPFAIL without a clear reason: {context[:200]}")
        fig["etmpfail_context"] = context[:160]
        # ---- while full: writes refused, reads and streams work
        deadline = time.monotonic() + full_seconds
        while time.monotonic() < deadline:
            k, vb, v = kv(i)
            i += 1
            r = await c.store(k.encode(), v.encode(), vb)
            if r.status == Status.ETMPFAIL:
                fig["etmpfail_answers"] += 1
            else:
                fig["other_answers"] += 1
                if r.status == Status.SUCCESS:
                    acked[k] = v
            for key in rng.sample(sorted(acked), min(20, len(acked))):
                g = await c.get(key.encode(), codec.vbucket_for_key(key.encode(), nv))
                fig["reads_while_full"] += 1
                if g.status != Status.SUCCESS or bytes(g.value).decode() != acked[key]:
                    findings.append(f"read of {key} while full: status 0x{g.status:02x}")
                    break
            await trio.sleep(0.01)
        k, vb, v = kv(i)
        i += 1
        with trio.move_on_after(5):
            r = await c.store(k.encode(), v.encode(), vb, durable=True)
            fig["durable_while_full"] = f"0x{r.status:02x}"
            if r.status == Status.SUCCESS:
                acked[k] = v
        if not fig["durable_while_full"]:
            fig["durable_while_full"] = "no answer in 5 s"
        stats = await c.stats("")
        fig["ep_storage_error"] = stats.get("ep_storage_error", "")[:120]
        fig["ep_queue_size_while_full"] = int(stats.get("ep_queue_size", 0))
        # a fresh stream while full sees every acknowledged write
        state, _ = await stream_state(port, nv)
        if state != acked:
            findings.append(
                f"a fresh stream while full differs from the acknowledged writes on "
                f"{len(set(state.items()) ^ set(acked.items()))} documents"
            )
        target = {vb: h for vb, (h, _u, _p) in (await vb_seqnos(port)).items()}
        with trio.move_on_after(20):
            while not all(follow.get("ends", {}).get(vb, 0) >= h for vb, h in target.items()):
                await trio.sleep(0.1)
        fig["follower_caught_up_while_full"] = all(
            follow.get("ends", {}).get(vb, 0) >= h for vb, h in target.items()
        )
        if not fig["follower_caught_up_while_full"]:
            findings.append("the streaming consumer stalled while the map was full")
        await c.aclose()
        # ---- the remedy: graceful stop, start with a larger map
        fig["stop_exit_status"] = await server.terminate()
        fig["stop_log"] = server.log_tail(1)[:200]
        await server.start(["--map-size", str(grown_map_mib << 20)])
        c = await RawClient.connect(port)
        lost = []
        for key, value in acked.items():
            g = await c.get(key.encode(), codec.vbucket_for_key(key.encode(), nv))
            if g.status != Status.SUCCESS or bytes(g.value).decode() != value:
                lost.append(key)
        fig["acked_lost_after_restart"] = len(lost)
        if lost:
            findings.append(
                f"{len(lost)} acknowledged writes lost across the graceful restart "
                f"with a larger map, e.g. {lost[:5]}"
            )
        ok = 0
        for _ in range(200):
            k, vb, v = kv(i)
            i += 1
            r = await c.store(k.encode(), v.encode(), vb)
            if r.status == Status.SUCCESS:
                ok += 1
                acked[k] = v
        fig["writes_ok_after_grow"] = ok
        if ok != 200:
            findings.append(f"after growing the map only {ok}/200 writes succeeded")
        await c.aclose()
        target = {vb: h for vb, (h, _u, _p) in (await vb_seqnos(port)).items()}
        with trio.move_on_after(30):
            while not all(follow.get("ends", {}).get(vb, 0) >= h for vb, h in target.items()):
                await trio.sleep(0.1)
        stop.set()
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    await trio.sleep(0)
    if follow.get("error"):
        findings.append("streaming consumer: " + follow["error"])
    fig["follower_rollbacks"] = follow.get("rollbacks", 0)
    if follow.get("rollbacks"):
        findings.append(
            f"the streaming consumer was told to roll back "
            f"{follow['rollback_events'][:4]} (acknowledged data discarded)"
        )
    final, _ = await stream_state(port, nv)
    extra = {k for k in final if k not in acked}
    wrong = {k for k in acked if k in final and final[k] != acked[k]}
    if extra or wrong:
        findings.append(
            f"final server data: {len(extra)} documents never acknowledged, "
            f"{len(wrong)} with another value"
        )
    fig["acked_missing_at_end"] = len([k for k in acked if k not in final])
    if view != final:
        findings.append(
            f"the streaming consumer's view differs from the server's data on "
            f"{len(set(view.items()) ^ set(final.items()))} documents"
        )
    crashes = 0 if server.alive() else 1
    tracebacks = [f"server traceback: {t}" for t in server.crash_signatures()]
    await server.terminate()
    return {
        "scenario": "storage",
        "seed": seed,
        "map_mib": map_mib,
        "grown_map_mib": grown_map_mib,
        **fig,
        "crashes": crashes + len(tracebacks),
        "divergences": len(findings),
        "findings": (findings + tracebacks)[:50],
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
