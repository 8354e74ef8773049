"""The writer of the reliability harness and its log of every write attempt.

Rules of this module:
- The writer's values name their write: ``key|version|incarnation|padding``. A value seen
  anywhere (a stream, a GET) is traced back to exactly one write attempt, so the verifier
  can tell a lost change from an invented one.
- One key is never written by two requests at once, so per-key versions are totally
  ordered. Every attempt is logged with its outcome: acked (with vb uuid and seqno),
  rejected (definitely not applied) or indeterminate (the answer was lost).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from dcp.consumer import BatchWriteError, KeyNotFound, KvClient
from dcp.protocol import codec

__all__ = ["Attempt", "Writer", "WriterLog", "decode_value", "encode_value", "keys_per_vbucket"]

HOST = "127.0.0.1"


# --------------------------------------------------------------------------- values and keys


def encode_value(key: str, version: int, incarnation: int, pad: int) -> bytes:
    return f"{key}|{version}|{incarnation}|".encode() + b"x" * pad


def decode_value(value: bytes) -> tuple[str, int] | None:
    """(key, version) of a writer value, None if it is not one."""
    parts = value.split(b"|", 3)
    if len(parts) != 4:
        return None
    try:
        return parts[0].decode(), int(parts[1])
    except (UnicodeDecodeError, ValueError):
        return None


def keys_per_vbucket(prefix: str, per_vb: int, num_vbuckets: int) -> list[str]:
    """``per_vb`` keys for every vbucket (so every vbucket sees traffic)."""
    buckets: dict[int, list[str]] = {vb: [] for vb in range(num_vbuckets)}
    i = 0
    while any(len(b) < per_vb for b in buckets.values()):
        k = f"{prefix}{i:06d}"
        b = buckets[codec.vbucket_for_key(k.encode(), num_vbuckets)]
        if len(b) < per_vb:
            b.append(k)
        i += 1
    return [k for vb in range(num_vbuckets) for k in buckets[vb]]


# --------------------------------------------------------------------------- writer


@dataclass(slots=True)
class Attempt:
    """One write the writer tried. ``status``: acked | indeterminate | rejected."""

    id: int
    key: str
    vb: int
    version: int
    op: str  # set | del | exp (a set with an expiry)
    durable: bool
    value: str | None
    sent_epoch: int  # server incarnation when the request was sent
    expires_at: float = 0.0
    status: str = "pending"
    uuid: int = 0
    seqno: int = 0
    error: str = ""

    def to_json(self) -> list[Any]:
        return [
            self.id,
            self.key,
            self.vb,
            self.version,
            self.op,
            self.durable,
            self.value,
            self.sent_epoch,
            self.expires_at,
            self.status,
            self.uuid,
            self.seqno,
            self.error,
        ]

    @classmethod
    def from_json(cls, row: list[Any]) -> Attempt:
        return cls(*row)


@dataclass
class WriterLog:
    attempts: list[Attempt] = field(default_factory=list)

    def dump(self, path: Path) -> None:
        with open(path, "w") as f:
            for a in self.attempts:
                f.write(json.dumps(a.to_json()) + "\n")

    @classmethod
    def load(cls, path: Path) -> WriterLog:
        with open(path) as f:
            return cls([Attempt.from_json(json.loads(line)) for line in f if line.strip()])

    def counts(self) -> dict[str, int]:
        out = {"attempts": len(self.attempts)}
        for a in self.attempts:
            out[a.status] = out.get(a.status, 0) + 1
            if a.status == "acked":
                out["acked_" + a.op] = out.get("acked_" + a.op, 0) + 1
                if a.durable:
                    out["acked_durable"] = out.get("acked_durable", 0) + 1
        return out


class Writer:
    """Mixed set/delete/expiry writes (some durable) over ``keys``; one key is never
    written by two requests at once, so per-key versions are totally ordered."""

    def __init__(
        self,
        port: int,
        keys: list[str],
        num_vbuckets: int,
        rng: random.Random,
        *,
        batch: int = 16,
        pause: float = 0.01,
        durable_ratio: float = 0.08,
        delete_ratio: float = 0.15,
        expiry_ratio: float = 0.08,
        max_pad: int = 120,
        timeout: float = 20.0,
    ) -> None:
        self.port = port
        self.keys = keys
        self.num_vbuckets = num_vbuckets
        self.rng = rng
        self.batch = batch
        self.pause = pause
        self.durable_ratio = durable_ratio
        self.delete_ratio = delete_ratio
        self.expiry_ratio = expiry_ratio
        self.max_pad = max_pad
        self.timeout = timeout
        self.log = WriterLog()
        self.versions: dict[str, int] = {}
        self.epoch = 0  # bumped by the harness at every server (re)start
        self.stop = trio.Event()
        self.paused = False

    def _attempt(self, key: str, op: str, durable: bool, expiry: int = 0) -> Attempt:
        v = self.versions.get(key, 0) + 1
        self.versions[key] = v
        value = None
        if op != "del":
            value = encode_value(key, v, self.epoch, self.rng.randrange(self.max_pad)).decode()
        a = Attempt(
            len(self.log.attempts),
            key,
            codec.vbucket_for_key(key.encode(), self.num_vbuckets),
            v,
            op,
            durable,
            value,
            self.epoch,
            time.time() + expiry + 1.0 if op == "exp" else 0.0,
        )
        self.log.attempts.append(a)
        return a

    @staticmethod
    def _record(a: Attempt, r: Any) -> None:
        if isinstance(r, BaseException):
            a.status = "rejected" if isinstance(r, KeyNotFound) else "indeterminate"
            a.error = type(r).__name__
        else:
            a.status = "acked"
            a.uuid = r.vb_uuid or 0
            a.seqno = r.seqno or 0

    async def _run_group(self, kv: KvClient, atts: list[Attempt], expiry: int) -> None:
        if not atts:
            return
        a0 = atts[0]
        try:
            if a0.op == "del":
                res: list[Any] = await kv.delete_many([a.key for a in atts], durable=a0.durable)
            else:
                res = await kv.set_many(
                    [(a.key, a.value.encode()) for a in atts],  # type: ignore[union-attr]
                    durable=a0.durable,
                    expiry=expiry,
                )
        except BatchWriteError as exc:
            res = exc.results
        except Exception as exc:  # the whole batch failed (e.g. a timeout)
            res = [exc] * len(atts)
        for a, r in zip(atts, res, strict=True):
            self._record(a, r)

    async def write_batch(self, kv: KvClient) -> int:
        rng = self.rng
        keys = rng.sample(self.keys, min(self.batch, len(self.keys)))
        groups: dict[tuple[str, bool], list[Attempt]] = {}
        expiry = rng.randint(1, 3)
        for k in keys:
            x = rng.random()
            if x < self.delete_ratio:
                op, durable = "del", rng.random() < self.durable_ratio
            elif x < self.delete_ratio + self.expiry_ratio:
                op, durable = "exp", False
            else:
                op, durable = "set", rng.random() < self.durable_ratio
            groups.setdefault((op, durable), []).append(
                self._attempt(k, op, durable, expiry if op == "exp" else 0)
            )
        for (op, _durable), atts in groups.items():
            await self._run_group(kv, atts, expiry if op == "exp" else 0)
        return len(keys)

    async def fence(self, kv: KvClient, keys_by_vb: dict[int, str]) -> None:
        """One durable write per vbucket (every vbucket then has news after a restart)."""
        atts = [self._attempt(k, "set", True) for k in keys_by_vb.values()]
        await self._run_group(kv, atts, 0)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with KvClient(
            HOST, self.port, num_vbuckets=self.num_vbuckets, timeout=self.timeout
        ) as kv:
            self.kv = kv
            task_status.started()
            while not self.stop.is_set():
                if self.paused:
                    await trio.sleep(0.05)
                    continue
                await self.write_batch(kv)
                await trio.sleep(self.pause)
