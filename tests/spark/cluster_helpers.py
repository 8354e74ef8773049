"""A two-node "cluster" for the connector's fast tests: two real in-process servers
(``helpers.ThreadServer``) whose vbucket states the test sets (SET_VBUCKET_STATE; a
replica really replicates from its source), and a config server the test controls.

Rules of this module: the config server is a plain socket thread that answers
GET_CLUSTER_CONFIG with the config the test last set (and UNKNOWN_COMMAND to anything
else), so a test decides exactly when the map moves a vbucket; it counts what it
served. Everything it starts is stopped by ``close``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

from dcp.protocol import FrameReader, Opcode, Status, codec
from dcp.protocol.layout import vbucket_for_key
from dcp.spark.wire import WireClient

from .helpers import ThreadServer

ACTIVE, REPLICA, DEAD = 1, 2, 4


def bucket_config(rev: int, ports: list[int], actives: list[int]) -> dict[str, Any]:
    """A config naming ``ports`` (on loopback) with vbucket ``vb`` active on server index
    ``actives[vb]`` (-1: no active)."""
    return {
        "rev": rev,
        "numVBuckets": len(actives),
        "vBucketServerMap": {
            "numReplicas": 0,
            "serverList": [f"127.0.0.1:{p}" for p in ports],
            "vBucketMap": [[i] for i in actives],
        },
    }


class ConfigServer:
    """Answers GET_CLUSTER_CONFIG with ``config`` (see the module rules)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.served = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # accept() wakes up to see ``close``
        self._closed = False
        self.port: int = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        reader = FrameReader()
        try:
            while data := conn.recv(65536):
                reader.feed(data)
                for f in reader.read_frames():
                    if f.opcode == Opcode.GET_CLUSTER_CONFIG:
                        self.served += 1
                        body = json.dumps(self.config).encode()
                        out = codec.response(f.opcode, opaque=f.opaque, datatype=1, value=body)
                    else:
                        out = codec.response(f.opcode, Status.UNKNOWN_COMMAND, opaque=f.opaque)
                    conn.sendall(out)
        except OSError:
            pass

    def close(self) -> None:
        self._closed = True
        self._threads[0].join(5)
        self._listener.close()
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        for t in self._threads:
            t.join(5)


def set_state(server: ThreadServer, vb: int, state: int, options: Any = None) -> None:
    client = WireClient("127.0.0.1", server.port).connect()
    try:
        o = client.next_opaque()
        (f,) = client.call([(o, codec.set_vbucket_state(vb, state, o, options))])
        assert f.status == 0, f"SET_VBUCKET_STATE vb {vb} -> {state}: {bytes(f.value)!r}"
    finally:
        client.close()


def high_seqnos(server: ThreadServer, state: int | None = None) -> dict[int, int]:
    client = WireClient("127.0.0.1", server.port).connect()
    try:
        return client.get_all_vb_seqnos(state)
    finally:
        client.close()


def failover_log(server: ThreadServer, vb: int) -> list[tuple[int, int]]:
    client = WireClient("127.0.0.1", server.port).connect()
    try:
        return client.failover_logs([vb])[vb]
    finally:
        client.close()


def replicate(source: ThreadServer, target: ThreadServer, vb: int, timeout: float = 20) -> None:
    """Make ``target``'s ``vb`` a replica of ``source``'s and wait until it caught up."""
    set_state(target, vb, REPLICA, {"source": f"127.0.0.1:{source.port}"})
    want = high_seqnos(source, ACTIVE)[vb]
    deadline = time.monotonic() + timeout
    while high_seqnos(target, REPLICA).get(vb) != want:
        assert time.monotonic() < deadline, f"vb {vb} did not replicate up to {want}"
        time.sleep(0.05)


def keys_in(vb: int, n: int, num_vbuckets: int, prefix: str = "k") -> list[str]:
    out: list[str] = []
    i = 0
    while len(out) < n:
        k = f"{prefix}{i}"
        if vbucket_for_key(k.encode(), num_vbuckets) == vb:
            out.append(k)
        i += 1
    return out
