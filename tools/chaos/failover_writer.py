"""The writers of the ``failover`` scenario: one per durability level, each on keys of its
own, through a cluster-routing ``KvClient`` (a bootstrap list of every node).

Rules of this module:
- Values name their write (``writer.encode_value``), so any value read back is traced to
  one attempt; one key is written by one writer, one request at a time, so its versions
  are totally ordered.
- Every attempt is logged (``LevelAttempt``) with its level, its outcome and, when
  acknowledged, what the epoch checks need: the vb uuid and seqno of the answer, the node
  the client's map routed the vbucket to when the answer came, and the harness's clock
  (``trio.current_time``) when the request was handed to the client and when it returned.
  The send time is a lower bound of when the node saw it and the ack time an upper bound
  of when it answered, so a check built on them can only err towards silence.
- Outcomes: ``ok`` (acked), ``ambiguous`` (SYNC_WRITE_AMBIGUOUS: may or may not be
  applied), ``impossible`` (DURABILITY_IMPOSSIBLE: not applied), ``notfound`` (a delete of
  an absent key: not applied), ``error`` (the answer was lost or the client gave up:
  unknown). ``status`` keeps ``writer.Attempt``'s meaning for the verifier: acked,
  rejected (not applied) or indeterminate.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass
from typing import Any

import trio

from dcp.consumer import (
    BatchWriteError,
    DurabilityImpossibleError,
    KeyNotFound,
    KvClient,
    MutationResult,
    SyncWriteAmbiguous,
)
from dcp.protocol import codec
from dcp.protocol.cluster_config import format_address

from .writer import Attempt, encode_value

__all__ = ["LEVELS", "MAJORITY_LEVELS", "LevelAttempt", "LevelWriter", "supports_levels"]

#: The durability levels by their KvClient names, weakest first.
LEVELS = ("none", "majority", "majorityAndPersistActive", "persistToMajority", "persistActive")
#: Levels whose acknowledged writes must survive any single node failure.
MAJORITY_LEVELS = ("majority", "majorityAndPersistActive", "persistToMajority")


def supports_levels() -> bool:
    """Whether this SDK's ``KvClient`` writes take ``durability=``."""
    return "durability" in inspect.signature(KvClient.set_many).parameters


@dataclass(slots=True)
class LevelAttempt(Attempt):
    """A ``writer.Attempt`` with its level, outcome, answering node and times."""

    level: str = "none"
    outcome: str = ""
    node: str = ""
    t_sent: float = 0.0
    t_acked: float = 0.0

    def to_json(self) -> list[Any]:
        extra = [self.level, self.outcome, self.node, self.t_sent, self.t_acked]
        return [*Attempt.to_json(self), *extra]


class LevelWriter:
    """Sets and deletes at one durability ``level`` on ``keys`` (see the module rules)."""

    def __init__(
        self,
        level: str,
        keys: list[str],
        bootstrap: str,
        num_vbuckets: int,
        log: list[Attempt],
        rng: random.Random,
        *,
        batch: int = 6,
        pause: float = 0.05,
        delete_ratio: float = 0.12,
        max_pad: int = 60,
        timeout: float = 10.0,
    ) -> None:
        if level != "none" and not supports_levels():
            raise ValueError(f"level {level!r}: this KvClient has no durability= argument")
        self.level = level
        self.keys = keys
        self.bootstrap = bootstrap
        self.num_vbuckets = num_vbuckets
        self.log = log
        self.rng = rng
        self.batch = batch
        self.pause = pause
        self.delete_ratio = delete_ratio
        self.max_pad = max_pad
        self.timeout = timeout
        self.versions: dict[str, int] = {}
        self.batches = 0

    def attempt(self, key: str, op: str) -> LevelAttempt:
        v = self.versions.get(key, 0) + 1
        self.versions[key] = v
        value = None
        if op == "set":
            value = encode_value(key, v, 0, self.rng.randrange(self.max_pad)).decode()
        a = LevelAttempt(
            len(self.log),
            key,
            codec.vbucket_for_key(key.encode(), self.num_vbuckets),
            v,
            op,
            self.level != "none",
            value,
            0,
            level=self.level,
        )
        self.log.append(a)  # ids are list positions (verify.Truth relies on it)
        return a

    async def write(self, kv: KvClient, atts: list[LevelAttempt]) -> None:
        """One pipelined request for ``atts`` (all sets or all deletes); records outcomes."""
        kw: dict[str, Any] = {} if self.level == "none" else {"durability": self.level}
        t_sent = trio.current_time()
        for a in atts:
            a.t_sent = t_sent
        try:
            if atts[0].op == "del":
                res: list[Any] = await kv.delete_many([a.key for a in atts], **kw)
            else:
                res = await kv.set_many([(a.key, (a.value or "").encode()) for a in atts], **kw)
        except BatchWriteError as exc:
            res = list(exc.results)
        except Exception as exc:  # the whole batch failed (a timeout, every node away)
            res = [exc] * len(atts)
        t_acked = trio.current_time()
        config = kv.config
        for a, r in zip(atts, res, strict=True):
            record(a, r, t_acked)
            if a.outcome == "ok" and config is not None:
                addr = config.active(a.vb)
                a.node = format_address(addr) if addr is not None else ""

    async def run(self, stop: trio.Event, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Write batches until ``stop``; each batch waits for its answers (bounded by the
        client's timeout), then a pause."""
        async with KvClient(
            self.bootstrap, num_vbuckets=self.num_vbuckets, timeout=self.timeout
        ) as kv:
            task_status.started()
            while not stop.is_set():
                keys = self.rng.sample(self.keys, min(self.batch, len(self.keys)))
                dels = [k for k in keys if self.rng.random() < self.delete_ratio]
                sets = [k for k in keys if k not in dels]
                for op, group in (("set", sets), ("del", dels)):
                    if group:
                        await self.write(kv, [self.attempt(k, op) for k in group])
                self.batches += 1
                await trio.sleep(self.pause)


def record(a: LevelAttempt, r: Any, t_acked: float) -> None:
    """Set ``a``'s outcome and status from one answer (a result or an exception)."""
    if isinstance(r, MutationResult):
        a.status, a.outcome = "acked", "ok"
        a.uuid, a.seqno, a.t_acked = r.vb_uuid or 0, r.seqno or 0, t_acked
        return
    a.error = type(r).__name__
    if isinstance(r, KeyNotFound):
        a.status, a.outcome = "rejected", "notfound"
    elif isinstance(r, DurabilityImpossibleError):
        a.status, a.outcome = "rejected", "impossible"
    elif isinstance(r, SyncWriteAmbiguous):
        a.status, a.outcome = "indeterminate", "ambiguous"
    else:
        a.status, a.outcome = "indeterminate", "error"
