"""A chaos consumer: an SDK ``DcpClient`` keeping a rollback-safe materialized view.

Run as a child process by ``tools/chaos/crash.py`` and ``failover.py`` (so it can be
SIGKILLed)::

    python -m tools.chaos.consumer --port P --dir D --name N [--num-vbuckets 16]
    python -m tools.chaos.consumer --port P --bootstrap H:P,H:P,H:P --stable-only ...

Rules of this module (the application protocol the SDK docs ask for, made kill-safe):
- The view's durable form is the journal ``D/journal.jsonl`` (``view.py``); offsets
  live in a ``FileOffsetStore`` at ``D/offsets.json``. For every group of delivered items
  the consumer applies them, appends one journal line, *then* commits to the store.
- Killed between the two, the journal is ahead of the store. At start the view is
  therefore cut back to the store's committed positions (a ``t`` op), and the SDK
  delivers everything after them again. The same happens inside a session when a
  commit was ignored (a batch of an older stream generation): before the next group the
  view is cut back to ``client.committed()``.
- A ``RollbackEvent`` cuts the view back to the rollback seqno, then is committed.
- ``D/status.json`` (atomically replaced, at most every 0.25 s and at exit) reports the
  applied positions and counters; SIGTERM makes the consumer save ``D/view.json`` (the
  live documents) and exit 0. Errors from the iterator are written to the status file
  and exit 3.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import trio

from dcp.consumer import (
    DcpClient,
    Deletion,
    Expiration,
    FileOffsetStore,
    Mutation,
    RollbackEvent,
)

from .view import Journal, View, read_journal


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class ChaosConsumer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(args.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.view = View()
        for group in read_journal(self.dir / "journal.jsonl"):
            for op in group:
                self.view.apply_op(op)
        self.journal = Journal(self.dir / "journal.jsonl")
        self.store = FileOffsetStore(self.dir / "offsets.json")
        self.counts = {
            "groups": 0,
            "batches": 0,
            "events": 0,
            "rollbacks": 0,
            "cuts": 0,
            "starts": 1,
        }
        self.error = ""
        self._status_at = 0.0
        prev = self.dir / "status.json"
        if prev.exists():
            try:
                old = json.loads(prev.read_text())
                self.counts["starts"] = old["counts"].get("starts", 0) + 1
            except (ValueError, KeyError):
                pass

    def cut_to(self, committed: dict[int, Any], ops: list[list[Any]]) -> None:
        """Undo what the offset store does not have (it will be delivered again)."""
        if self.args.fault == "ignore-rollback":
            return  # the self-test application undoes nothing, ever
        for vb, v in self.view.vbs.items():
            o = committed.get(vb)
            seqno = o.seqno if o is not None else 0
            if v.end > seqno or (v.changes and v.changes[-1][0] > seqno):
                op = ["t", vb, seqno]
                self.view.apply_op(op)
                ops.append(op)
                self.counts["cuts"] += 1

    def status(self, force: bool = False, state: str = "running") -> None:
        now = time.monotonic()
        if not force and now - self._status_at < 0.25:
            return
        self._status_at = now
        _write_json(
            self.dir / "status.json",
            {
                "pid": os.getpid(),
                "state": state,
                "error": self.error,
                "counts": self.counts,
                "positions": {str(vb): list(p) for vb, p in self.view.positions().items()},
            },
        )

    def on_item(self, item: Any, ops: list[list[Any]]) -> None:
        fault = self.args.fault
        if isinstance(item, RollbackEvent):
            op = ["r", item.vbucket, item.rollback_seqno, item.seqno, item.vb_uuid]
            self.counts["rollbacks"] += 1
            if fault == "ignore-rollback":  # harness self-test: an application that keeps
                return  # what the server lost (must be caught as a divergence)
        else:
            events = []
            for e in item.events:
                t = type(e)
                key = e.key.decode("latin-1")
                if t is Mutation:
                    events.append([e.seqno, "m", key, e.value.decode("latin-1")])
                elif t is Deletion:
                    events.append([e.seqno, "d", key, None])
                elif t is Expiration:
                    events.append([e.seqno, "x", key, None])
            if fault == "partial" and len(events) > 1 and self.counts["batches"] % 50 == 7:
                events = events[:-1]  # harness self-test: expose a snapshot without its end
            op = [
                "b",
                item.vbucket,
                item.start,
                item.end,
                item.flags,
                [list(x) for x in item.failover_log],
                events,
            ]
            self.counts["batches"] += 1
            self.counts["events"] += len(events)
        self.view.apply_op(op)
        ops.append(op)

    async def run(self) -> int:
        a = self.args
        stop = trio.Event()
        ops: list[list[Any]] = []
        self.cut_to(self.store.load(), ops)
        self.journal.append(ops)
        self.status(force=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    async for _ in signals:
                        stop.set()
                        return

                nursery.start_soon(watch)
                # only when asked, so the consumer also runs against an SDK without it
                extra: dict[str, Any] = {"stable_only": True} if a.stable_only else {}
                try:
                    async with DcpClient(
                        a.bootstrap or "127.0.0.1",
                        a.port,
                        config_poll_interval=a.config_poll_interval,
                        **extra,
                        name=a.name,
                        offset_store=self.store,
                        include_expirations=True,
                        noop_interval=a.noop_interval,
                        retry_timeout=a.retry_timeout,
                        buffer_size=a.buffer_size,
                        connect_timeout=5.0,
                    ) as client:
                        while not stop.is_set():
                            items = await client.getmany(timeout=0.2, max_items=2000)
                            ops = []
                            self.cut_to(client.committed(), ops)
                            for item in items:
                                self.on_item(item, ops)
                            self.journal.append(ops)
                            if items:
                                self.counts["groups"] += 1
                                await client.commit()
                            self.status()
                except Exception as exc:  # reported to the harness, which counts it
                    self.error = f"{type(exc).__name__}: {exc}"
                nursery.cancel_scope.cancel()
        self.journal.close()
        if self.error:
            self.status(force=True, state="error")
            return 3
        _write_json(
            self.dir / "view.json",
            {
                "state": self.view.state(),
                "positions": {str(vb): list(p) for vb, p in self.view.positions().items()},
            },
        )
        self.status(force=True, state="stopped")
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--noop-interval", type=float, default=2.0)
    p.add_argument("--retry-timeout", type=float, default=300.0)
    p.add_argument("--buffer-size", type=int, default=1 << 20)
    p.add_argument(
        "--bootstrap",
        default="",
        help="a cluster's bootstrap list HOST:PORT,... (default: 127.0.0.1 and --port)",
    )
    p.add_argument("--config-poll-interval", type=float, default=2.5)
    p.add_argument(
        "--stable-only",
        action="store_true",
        help="ask for whole snapshots at or below the stable seqno only (DcpClient stable_only)",
    )
    p.add_argument(
        "--fault",
        choices=["none", "ignore-rollback", "partial"],
        default="none",
        help="harness self-test: misbehave on purpose (the verifier must object)",
    )
    args = p.parse_args(argv)
    return trio.run(ChaosConsumer(args).run)


if __name__ == "__main__":
    sys.exit(main())
