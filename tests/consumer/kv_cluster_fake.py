"""Fake KV nodes of a cluster for ``KvClient`` tests: each serves a config the test writes
and answers NOT_MY_VBUCKET for the vbuckets it does not own.

Rules of this module:
- A ``FakeNode`` listens on loopback (port 0) inside the test's nursery and speaks the
  binary protocol with bytes (``codec``): HELLO, GET_CLUSTER_CONFIG, SET/ADD/REPLACE/
  DELETE/GET. What it owns (``owned``), answers (``config``, ``nmvb_body``) and does
  wrong (``drop_on``: close the connection on that opcode without answering; ``silent``:
  answer nothing, as a frozen process; ``hello_delay``: a loaded node slow to answer a
  HELLO) is plain attributes the test changes while the client runs.
- Nodes of one fake cluster share one ``docs`` dict, as replicas would hold the data.
- Everything a node receives is recorded (``received``: opcode, vbucket, key), so tests
  assert where the client sent what, and ``connections`` counts the connections it
  accepted. ``stop`` closes the listener and every connection:
  a lost node.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import trio

from dcp.protocol import codec
from dcp.protocol.frames import FrameReader
from dcp.protocol.opcodes import Datatype, Opcode, Status

HOST = "127.0.0.1"


def config_json(
    rev: int, nodes: Sequence[FakeNode], owners: Sequence[int], this: FakeNode | None = None
) -> bytes:
    """A bucket config: vbucket ``vb``'s active is ``nodes[owners[vb]]`` (-1: none)."""
    return json.dumps(
        {
            "rev": rev,
            "numVBuckets": len(owners),
            "nodesExt": [
                {"nodeName": n.name, "hostname": HOST, "services": {"kv": n.port}}
                | ({"thisNode": True} if n is this else {})
                for n in nodes
            ],
            "vBucketServerMap": {
                "numReplicas": 0,
                "serverList": [f"{HOST}:{n.port}" for n in nodes],
                "vBucketMap": [[o] for o in owners],
            },
        }
    ).encode()


class FakeNode:
    """One fake node (see the module rules)."""

    def __init__(self, name: str, docs: dict[bytes, bytes]) -> None:
        self.name = name
        self.docs = docs
        self.port = 0
        self.owned: set[int] = set()
        self.config = b""  # GET_CLUSTER_CONFIG's answer; b"": UNKNOWN_COMMAND
        self.nmvb_body: bytes | None = None  # None: the config
        self.drop_on: int | None = None
        self.silent = False  # receives but never answers (a frozen process)
        self.hello_delay = 0.0  # seconds before a HELLO is answered (a loaded node)
        self.connections = 0
        self.received: list[tuple[int, int, bytes]] = []
        self._listeners: list[trio.SocketListener] = []
        self._streams: list[trio.SocketStream] = []
        self._scope = trio.CancelScope()

    def count(self, opcode: int) -> int:
        return sum(1 for op, _, _ in self.received if op == opcode)

    def keys(self, opcode: int) -> list[bytes]:
        return [k for op, _, k in self.received if op == opcode]

    async def start(self, nursery: trio.Nursery) -> None:
        self._listeners = await trio.open_tcp_listeners(0, host=HOST)
        self.port = self._listeners[0].socket.getsockname()[1]
        nursery.start_soon(self._serve)

    async def _serve(self) -> None:
        with self._scope:
            await trio.serve_listeners(self._conn, self._listeners)

    async def stop(self) -> None:
        """The node is gone: no listener, every connection closed."""
        self._scope.cancel()
        for s in self._streams:
            await trio.aclose_forcefully(s)

    async def _conn(self, stream: trio.SocketStream) -> None:
        self._streams.append(stream)
        self.connections += 1
        reader = FrameReader()
        try:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    return
                reader.feed(data)
                out = bytearray()
                for f in reader.read_frames():
                    self.received.append((f.opcode, f.vbucket, bytes(f.key)))
                    if f.opcode == self.drop_on:
                        await stream.aclose()
                        return
                    if f.opcode == Opcode.HELLO and self.hello_delay:
                        await trio.sleep(self.hello_delay)
                    if not self.silent:
                        out += self._answer(f)
                if out:
                    await stream.send_all(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return

    def _answer(self, f: Any) -> bytes:
        op, o = f.opcode, f.opaque
        if op == Opcode.HELLO:
            return codec.response(op, opaque=o)
        if op == Opcode.GET_CLUSTER_CONFIG:
            if not self.config:
                return codec.response(op, Status.UNKNOWN_COMMAND, opaque=o)
            return codec.response(op, opaque=o, datatype=Datatype.JSON, value=self.config)
        if op not in (Opcode.SET, Opcode.ADD, Opcode.REPLACE, Opcode.DELETE, Opcode.GET):
            return codec.response(op, Status.UNKNOWN_COMMAND, opaque=o)
        if f.vbucket not in self.owned:
            body = self.config if self.nmvb_body is None else self.nmvb_body
            dt = Datatype.JSON if body.startswith(b"{") else 0
            return codec.response(op, Status.NOT_MY_VBUCKET, opaque=o, datatype=dt, value=body)
        key = bytes(f.key)
        exists = key in self.docs
        if op == Opcode.GET:
            if not exists:
                return codec.response(op, Status.KEY_ENOENT, opaque=o)
            return codec.response(op, opaque=o, extras=b"\0\0\0\0", value=self.docs[key], cas=1)
        if (op == Opcode.ADD and exists) or (op in (Opcode.REPLACE, Opcode.DELETE) and not exists):
            st = Status.KEY_EEXISTS if exists else Status.KEY_ENOENT
            return codec.response(op, st, opaque=o)
        if op == Opcode.DELETE:
            del self.docs[key]
        else:
            self.docs[key] = bytes(f.value)
        return codec.response(op, opaque=o, cas=len(self.received))


async def fake_cluster(nursery: trio.Nursery, n: int) -> list[FakeNode]:
    docs: dict[bytes, bytes] = {}
    nodes = [FakeNode(f"n{i + 1}", docs) for i in range(n)]
    for node in nodes:
        await node.start(nursery)
    return nodes


def serve_map(nodes: Sequence[FakeNode], rev: int, owners: Sequence[int]) -> None:
    """Every node serves this map (marked as its own) and owns what it gives it."""
    for i, node in enumerate(nodes):
        node.config = config_json(rev, nodes, owners, node)
        node.owned = {vb for vb, o in enumerate(owners) if o == i}
