"""dcpctl through any node of a real cluster on etcd: the example session of docs/dcpctl.md
("Clusters") run as written, and what it must show about a node killed with kill -9 —
unreachable while the map names it (exit 3), then gone from the map after its failover,
its vbuckets active on the promoted replicas — asked through one live node.

Rules of this module: real processes and a throwaway etcd on loopback (``harness.py``);
8 vbuckets and a long auto-failover timeout, so the failover happens when the session
asks for it (``dcpctl cluster failover``), not while it looks at the dead node; every
wait bounded. The doc's output is compared with the real one column by column, leaving
out what differs between runs (uuids, revisions, memory, which node got which vbucket:
numbers and node names are compared as placeholders): headers, non-table lines and the
distinct rows must match, and the exit status. What the output must say about the dead
node and the new map is then checked exactly against etcd's map.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from dcp.protocol.layout import vbucket_for_key
from tests.etcd.conftest import EtcdProcess
from tools.chaos.procs import RawClient

from .harness import EtcdCluster, until

pytestmark = pytest.mark.slow

NAMES = ["n1", "n2", "n3"]
DOC = Path(__file__).resolve().parents[2] / "docs" / "dcpctl.md"
DOC_PORTS = {"n1": 11410, "n2": 11411, "n3": 11412}
#: columns whose values differ from run to run
VOLATILE = {"uuid", "vb_uuid", "persisted", "in memory", "ckpts", "ckpt mem", "streams"}
KEYS = [f"user:{i}".encode() for i in range(16)]


def _session() -> list[tuple[str, list[str]]]:
    """The doc's example session: (command line, the lines it shows)."""
    text = DOC.read_text()
    section = text[text.index("\n## Clusters\n") :]
    block = section[section.index("```\n$ ") + 4 :]
    block = block[: block.index("```")]
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line)
    return steps


def _normal(lines: list[str], ports: set[str]) -> tuple[list[Any], set[Any], list[str]]:
    """Headers, distinct rows and plain lines of some output, with the nodes' ports,
    node names, numbers and hex ids as placeholders and the volatile columns left out."""

    def norm(text: str) -> str:
        for port in ports:
            text = text.replace(port, "PORT")
        text = re.sub(r"\b[0-9a-f]{32}\b", "ID", text)
        text = re.sub(r"\bn\d\b", "nN", text)  # which node got which vbuckets varies
        text = re.sub(r"\b\d+\b", "N", text)
        return re.sub(r"\bN(?:[-,]N\b)+", "N", text).strip()  # vbucket lists

    headers: list[Any] = []
    rows: set[Any] = set()
    plain: list[str] = []
    keep: list[int] = []
    for line in lines:
        if line.startswith("┃"):
            cells = [c.strip() for c in line.strip().strip("┃").split("┃")]
            keep = [i for i, c in enumerate(cells) if c not in VOLATILE]
            headers.append(tuple(cells))
        elif line.startswith("│"):
            cells = [c.strip() for c in line.strip().strip("│").split("│")]
            rows.add(tuple(norm(cells[i]) for i in keep))
        elif line and line[0] not in "┏┡└├":
            plain.append(norm(line))
    return headers, rows, plain


async def _dcpctl(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    exe = Path(sys.executable).parent / "dcpctl"
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "dcp.ctl"]
    with trio.fail_after(60):
        r = await trio.run_process(
            [*argv, *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**os.environ, **env},
        )
    out, err = r.stdout.decode(), r.stderr.decode()
    assert "Traceback" not in err, err
    return r.returncode, out, err


async def _write_and_catch_up(c: EtcdCluster) -> None:
    vbmap, _ = await c.read_map()
    assert vbmap is not None
    for key in KEYS:
        vb = vbucket_for_key(key, c.num_vbuckets)
        client = await RawClient.connect(c.port_of(vbmap.active(vb) or ""))
        try:
            assert (await client.store(key, b'{"v": 1}', vb)).status == 0
        finally:
            await client.aclose()

    async def caught_up() -> bool:
        return not await c.copies_differ(vbmap)

    await until(caught_up, "every replica to hold the writes", 20)


def _lease_gone(c: EtcdCluster, name: str) -> Any:
    async def gone() -> bool:
        return name not in await c.live()

    return gone


async def _serving_without(c: EtcdCluster, gone: str) -> int:
    """Until the live nodes serve (and hold) a map without ``gone``; its revision."""
    live = [n for n in NAMES if n != gone]

    async def done() -> int | None:
        vbmap, rev = await c.read_map()
        if vbmap is None or gone in vbmap.servers:
            return None
        for n in live:
            if (await c.get_cluster_config(n))["rev"] != rev:
                return None
        return None if await c.reconcile_problems(vbmap, live) else rev

    return int(await until(done, f"the nodes to serve a map without {gone}", 30))


async def test_the_doc_session_and_a_killed_node_seen_through_any_live_node(
    tmp_path: Path, etcd_factory: Any
) -> None:
    etcd: EtcdProcess = etcd_factory()
    c = EtcdCluster(tmp_path, etcd, num_vbuckets=8, failover_timeout=120)
    try:
        await c.start(*NAMES)
        await c.wait_settled(NAMES, timeout=60)
        await _write_and_catch_up(c)
        ports = {str(c.port_of(n)) for n in NAMES} | {str(p) for p in DOC_PORTS.values()}
        env = {"DCP_CLUSTER": etcd.endpoint, "DCP_CLUSTER_NAME": c.name}
        before_rev = (await c.read_map())[1]
        for command, shown in _session():
            command = command.split("  #")[0].strip()
            if command.startswith("export DCP_HOST="):
                doc_hosts = [f"127.0.0.1:{DOC_PORTS[n]}" for n in NAMES]
                assert command == "export DCP_HOST=" + ",".join(doc_hosts)
                env["DCP_HOST"] = ",".join(c.address(n) for n in NAMES)
                continue
            if command.startswith("kill -9"):
                assert "n3" in command
                c.kill("n3")
                # as the doc says: a hard failover asked before the killed node's lease
                # lapsed is refused (it cannot be told to stop, it may still be up)
                await until(_lease_gone(c, "n3"), "n3's lease to lapse after the kill", 30)
                continue
            want_exit = 0
            if command.endswith('; echo "exit $?"'):
                command = command.removesuffix('; echo "exit $?"')
                want_exit = int(shown.pop().removeprefix("exit "))
            args = shlex.split(command)
            assert args[0] == "dcpctl"
            code, out, err = await _dcpctl(*args[1:], env=env)
            assert code == want_exit, (command, code, out, err)
            assert _normal((out + err).splitlines(), ports) == _normal(shown, ports), (
                f"{command}: the doc shows\n" + "\n".join(shown) + "\nbut it printed\n" + out + err
            )
            if args[1:3] == ["cluster", "failover"]:
                await _serving_without(c, "n3")
            elif code == 3:  # the dead node is still in the map: no failover happened yet
                assert (await c.read_map())[1] == before_rev

        # the same, asked through one live node only, checked against etcd's map
        vbmap, rev = await c.read_map()
        assert vbmap is not None and "n3" not in vbmap.servers
        one = {"DCP_HOST": c.address("n2"), "DCP_CLUSTER": ""}
        code, out, _ = await _dcpctl("map", "--json", env=one)
        doc = json.loads(out)
        assert code == 0 and doc["rev"] == rev
        assert [n["node_name"] for n in doc["nodes"]] == list(vbmap.servers)
        for n in doc["nodes"]:
            assert n["actives"] == [vb for vb in range(8) if vbmap.active(vb) == n["node_name"]]
        code, out, _ = await _dcpctl("vbuckets", "--active", "--json", env=one)
        rows = json.loads(out)["vbuckets"]
        assert code == 0
        assert [(r["vbucket"], r["node_name"]) for r in rows] == [
            (vb, vbmap.active(vb)) for vb in range(8)
        ]
        assert sum(r["high_seqno"] for r in rows) == len(KEYS)  # nothing lost

        # the dead node first in the list: skipped, named as absent from the map
        dead_first = {"DCP_HOST": ",".join(c.address(n) for n in ("n3", "n1"))}
        code, out, _ = await _dcpctl("map", "--json", env=dead_first)
        gone = [n for n in json.loads(out)["nodes"] if not n["in_map"]]
        assert code == 0
        assert [(n["node"], n["reachable"]) for n in gone] == [(c.address("n3"), False)]

        # tail follows the cluster from the bootstrap list: every write, once
        code, out, err = await _dcpctl(
            "tail", "--from", "beginning", "--to-latest", "--json", env=dead_first
        )
        assert code == 0, err
        events = [json.loads(line) for line in out.splitlines()]
        keys = sorted(e["key"].encode() for e in events if e["type"] == "mutation")
        assert keys == sorted(KEYS)
        c.assert_no_crash()
    finally:
        await c.aclose()
