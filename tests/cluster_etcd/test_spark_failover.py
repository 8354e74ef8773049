"""The Spark connector on a real 3-node cluster across a kill -9 failover: a structured
streaming query into parquet ends with exactly the documents the cluster holds (read
back by the SDK's ``KvClient`` on each vbucket's active), with no rollback row (every
change it read was replicated before the kill, so no branch diverged).

Rules of this module: real processes and a throwaway etcd on loopback (``harness.py``,
``traffic.py``), the tests' local Spark session (``tests/spark/conftest.py``); Spark's
blocking calls run on worker threads so the writers' trio tasks keep going; every wait
is bounded and the query is stopped whatever happens. The query is docs/spark.md's
"Clusters" example, executed as written (only the addresses and paths are the test's).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import trio

from dcp.protocol.layout import vbucket_for_key
from dcp.spark.batch_plan import VbRange
from dcp.spark.driver import Planner
from dcp.spark.executor import read_ranges
from dcp.spark.options import parse_options
from tests.spark.conftest import spark  # noqa: F401  (the session fixture)

from .harness import EtcdCluster, until
from .traffic import Router, Writer, keys_for, read_all, value_of

pytestmark = [pytest.mark.slow, pytest.mark.spark]

NAMES = ["n1", "n2", "n3"]


DOC = Path(__file__).resolve().parents[2] / "docs" / "spark.md"


def _doc_query(bootstrap: str, out: Path, ck: Path) -> str:
    """The query of docs/spark.md's "Clusters" example (up to its "# later" comment),
    with this cluster's addresses and the test's directories put in."""
    section = DOC.read_text().split("\n## Clusters\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "docs/spark.md's Clusters section lost its example"
    query = code.group(1).split("# later", 1)[0]
    hosts = re.search(r'"host", "([^"]+)"', query)
    assert hosts is not None and "/data/feed-checkpoint" in query, query
    return (
        query.replace(hosts.group(1), bootstrap)
        .replace("/data/feed-checkpoint", str(ck))
        .replace("/data/feed", str(out))
    )


async def _write_all(writer: Writer, keys: list[bytes], version: int) -> None:
    async def part(ks: list[bytes]) -> None:
        for k in ks:
            assert await writer.write(k, version), f"{k!r} was never acknowledged"

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(part, keys[i::4])


async def _replicated(c: EtcdCluster) -> bool:
    vbmap, _ = await c.read_map()
    return vbmap is not None and not await c.copies_differ(vbmap)


async def _failed_over(c: EtcdCluster, victim: str) -> bool:
    vbmap, _ = await c.read_map()
    return vbmap is not None and all(
        victim not in vbmap.names(vb) and vbmap.active(vb) for vb in range(c.num_vbuckets)
    )


class _Sink:
    """The parquet sink's current documents, read again (a Spark job, which competes with
    the query for the two cores) only after the sink committed another batch."""

    def __init__(self, session: Any, path: Path) -> None:
        self.session = session
        self.path = path
        self.batches = -1
        self.docs: dict[str, bytes] = {}

    async def documents(self) -> dict[str, bytes]:
        log = self.path / "_spark_metadata"
        done = max((int(p.name) for p in log.glob("[0-9]*") if p.name.isdigit()), default=-1)
        if done > self.batches:
            self.batches = done
            self.docs = await trio.to_thread.run_sync(self._read)
        return self.docs

    def _read(self) -> dict[str, bytes]:
        from dcp.spark import current_documents

        df = self.session.read.parquet(str(self.path))
        rows = current_documents(df).select("key", "value").collect()
        return {r["key"]: bytes(r["value"]) for r in rows}


async def test_a_streaming_query_across_a_kill_9_failover_ends_exact(
    etcd_cluster: EtcdCluster,
    spark: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    import dcp.spark

    c = etcd_cluster
    await c.start(*NAMES)
    await c.wait_settled(NAMES, timeout=60)
    status = await until(c.status, "the orchestrator's status", 10)
    victim = next(n for n in NAMES if n != status["orchestrator"])
    bootstrap = ",".join(c.address(n) for n in NAMES)
    router = Router(c)
    await router.refresh()
    before, after = keys_for(300, "sp"), keys_for(100, "sp-new", seed=2)
    out, ck = tmp_path / "out", tmp_path / "ck"

    async with Writer(c, router) as writer:
        await _write_all(writer, before, 0)
        await until(lambda: _replicated(c), "the replicas to catch up before the kill", 30)

        # an executor's range planned on the victim before the kill, read after it
        cfg = parse_options({"host": bootstrap, "retryTimeout": "60"}, streaming=True)
        planner = Planner(cfg)
        highs, logs = planner.refresh(force=True)
        owners = planner.owners()
        planner.close()
        assert owners is not None and set(owners.values()) == {
            ("127.0.0.1", c.port_of(n)) for n in NAMES
        }
        node = ("127.0.0.1", c.port_of(victim))
        planned = [
            VbRange(vb, logs[vb][0][0], 0, h, None, logs[vb][0][0])
            for vb, h in highs.items()
            if owners[vb] == node and h
        ]
        assert planned

        dcp.spark.register(spark)

        def start() -> Any:  # the docs' query, run as written (addresses and paths ours)
            ns: dict[str, Any] = {"spark": spark}
            exec(_doc_query(bootstrap, out, ck), ns)
            return ns["query"]

        query = await trio.to_thread.run_sync(start)
        try:
            want0 = {k.decode(): value_of(k, 0) for k in before}
            sink = _Sink(spark, out)

            async def first_batch() -> bool:
                return await sink.documents() == want0

            await until(first_batch, "the query to read the writes before the kill", 60)

            c.kill(victim)
            read: dict[str, Any] = {}

            def read_planned() -> None:  # re-read from the new actives once failed over
                read["rows"] = [
                    (ch.key[i], ch.value[i])
                    for ch in read_ranges(cfg, planned, "t", node)
                    for i in range(len(ch))
                ]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, read_planned)
                await _write_all(writer, before, 1)  # re-routed to the new actives
                await _write_all(writer, after, 0)
            assert await _failed_over(c, victim)
            planned_keys = {k for k in before if owners[vbucket_for_key(k, c.num_vbuckets)] == node}
            assert dict(read["rows"]) == {k: value_of(k, 0) for k in planned_keys}

            expected = await read_all(c, before + after)
            assert all(v is not None for v in expected.values())
            want = {k.decode(): v for k, v in expected.items() if v is not None}
            assert want == {
                **{k.decode(): value_of(k, 1) for k in before},
                **{k.decode(): value_of(k, 0) for k in after},
            }
            seen: dict[str, dict[str, bytes]] = {}

            async def caught_up() -> bool:
                seen["got"] = await sink.documents()
                return seen["got"] == want

            try:
                await until(caught_up, "the query to end on the cluster's final state", 60)
            except AssertionError:
                got = seen.get("got", {})
                wrong = sorted(k for k in want if got.get(k) != want[k])
                raise AssertionError(
                    f"{len(wrong)} keys differ, e.g. {[(k, got.get(k)) for k in wrong[:5]]}; "
                    f"{len(set(got) - set(want))} extra"
                ) from None
            assert query.exception() is None
        finally:
            await trio.to_thread.run_sync(query.stop)
    rollbacks = await trio.to_thread.run_sync(
        lambda: spark.read.parquet(str(out)).where("op = 'rollback'").count()
    )
    assert rollbacks == 0  # every change read before the kill was on the new branch too
    c.assert_no_crash()
