"""A stand-in node for dcpctl's vbucket-state commands: it speaks the wire (frames from
``dcp.protocol``), records every SET_VBUCKET_STATE it gets, and plays a takeover.

Why a fake: it lets the tests check the exact bytes dcpctl sends (state byte, JSON
options, datatype) and make a node misbehave (never finish a takeover, not become dead)
in ways a real server does not. The real-server tests are in test_vbstate_live.py.

Rules of this file: a blocking socket server in one daemon thread per node, loopback
only, stopped by ``close()``; answers come from plain dicts the test can read and set.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

from dcp.protocol import Datatype, FrameReader, Opcode, Status, VBucketState, codec
from dcp.protocol.errors import StatusError

STATE_NAMES = {s.value: s.name.lower() for s in VBucketState}


class FakeNode:
    """``FakeNode(8)``; ``.address`` is its ``HOST:PORT``. ``peers`` maps addresses to
    the other fake nodes a takeover may reach (the source it makes dead)."""

    def __init__(self, num_vbuckets: int, peers: dict[str, FakeNode] | None = None) -> None:
        self.states = dict.fromkeys(range(num_vbuckets), VBucketState.ACTIVE)
        self.high = dict.fromkeys(range(num_vbuckets), 0)
        self.replication: dict[int, dict[str, Any]] = {}  # vb -> source, stream, source_seqno
        self.has_replication_group = True
        self.takeover_finishes = True  # False: a takeover never completes
        self.source_goes_dead = True  # False: the source stays active after a takeover
        self.refuse: dict[int, int] = {}  # vb -> status SET_VBUCKET_STATE answers
        self.received: list[tuple[int, int, int, bytes]] = []  # (vb, extras state, dt, value)
        # GET_CLUSTER_CONFIG: None answers UNKNOWN_COMMAND (an older server), else
        # (status, value) as given (see make_config for a cluster's)
        self.cluster_config: tuple[int, bytes] | None = None
        self.general: dict[str, Any] = {}  # extra STAT "" pairs
        self.dcp_streams: list[tuple[str, str]] = []  # the dcp-streams group's pairs
        self.uuid_base = 1000  # vb_uuid = uuid_base + vb (tells which node answered)
        self.peers = peers if peers is not None else {}
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.peers[self.address] = self
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    # ------------------------------------------------------------------ serving

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = FrameReader()
        with conn:
            while True:
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                reader.feed(data)
                out = b"".join(self._answer(f) for f in reader.read_frames())
                conn.sendall(out)

    def _answer(self, f: Any) -> bytes:
        if f.opcode == Opcode.STAT:
            return self._stat(bytes(f.key).decode(), f.opaque)
        if f.opcode == Opcode.GET_VBUCKET:
            if f.vbucket not in self.states:
                return codec.response(f.opcode, Status.NOT_MY_VBUCKET, opaque=f.opaque)
            value = codec.get_vbucket_value(self.states[f.vbucket])
            return codec.response(f.opcode, opaque=f.opaque, value=value)
        if f.opcode == Opcode.SET_VBUCKET_STATE:
            return self._set_state(f)
        if f.opcode == Opcode.GET_CLUSTER_CONFIG and self.cluster_config is not None:
            status, value = self.cluster_config
            return codec.response(
                f.opcode, status, opaque=f.opaque, datatype=Datatype.JSON, value=value
            )
        return codec.response(f.opcode, Status.UNKNOWN_COMMAND, opaque=f.opaque)

    def _set_state(self, f: Any) -> bytes:
        self.received.append((f.vbucket, f.extras[0], f.datatype, bytes(f.value)))
        try:
            state, options = codec.parse_set_vbucket_state(f)
        except StatusError as exc:
            return codec.response(f.opcode, exc.status, opaque=f.opaque)
        vb = f.vbucket
        if vb not in self.states:
            return codec.response(f.opcode, Status.NOT_MY_VBUCKET, opaque=f.opaque)
        if vb in self.refuse:
            err = codec.json_value({"error": {"context": f"fake refuses vb {vb}"}})
            return codec.response(f.opcode, self.refuse[vb], opaque=f.opaque, value=err)
        self.states[vb] = VBucketState(state)
        source = options.get("source")
        if source:
            self.replication[vb] = {"source": source, "stream": "streaming", "source_seqno": 0}
        else:
            self.replication.pop(vb, None)
        if options.get("takeover"):
            self.replication[vb]["stream"] = "takeover"
            if self.takeover_finishes:
                threading.Timer(0.2, self._finish_takeover, args=(vb, source)).start()
        return codec.response(f.opcode, opaque=f.opaque)

    def _finish_takeover(self, vb: int, source: str) -> None:
        src = self.peers.get(source)
        if src is not None:
            if src.source_goes_dead:
                src.states[vb] = VBucketState.DEAD
            self.high[vb] = src.high[vb]
        self.states[vb] = VBucketState.ACTIVE
        self.replication.pop(vb, None)

    # ------------------------------------------------------------------ STAT

    def _stat(self, group: str, opaque: int) -> bytes:
        pairs = self._pairs(group)
        if pairs is None:
            return codec.response(Opcode.STAT, Status.KEY_ENOENT, opaque=opaque)
        return b"".join(
            codec.response(Opcode.STAT, opaque=opaque, key=k.encode(), value=str(v).encode())
            for k, v in [*pairs, ("", "")]
        )

    def _pairs(self, group: str) -> list[tuple[str, Any]] | None:
        vbs = sorted(self.states)
        if group == "":
            return [("ep_num_vbuckets", len(vbs)), *self.general.items()]
        if group.startswith("failovers "):
            vb = int(group.split()[1])
            return [
                (f"vb_{vb}:num_entries", 1),
                (f"vb_{vb}:0:id", self.uuid_base + vb),
                (f"vb_{vb}:0:seq", 0),
            ]
        if group == "vbucket":
            return [(f"vb_{vb}", STATE_NAMES[self.states[vb]]) for vb in vbs]
        if group == "vbucket-seqno":
            out: list[tuple[str, Any]] = []
            for vb in vbs:
                out += [
                    (f"vb_{vb}:high_seqno", self.high[vb]),
                    (f"vb_{vb}:vb_uuid", self.uuid_base + vb),
                    (f"vb_{vb}:last_persisted_seqno", self.high[vb]),
                    (f"vb_{vb}:purge_seqno", 0),
                ]
            return out
        if group.startswith("checkpoint "):
            vb = int(group.split()[1])
            return [(f"vb_{vb}:num_items", 0), (f"vb_{vb}:high_seqno", self.high[vb])]
        if group == "checkpoint":
            return [(f"vb_{vb}:num_items", 0) for vb in vbs]
        if group == "dcp-streams":
            return list(self.dcp_streams)
        if group == "replication" and self.has_replication_group:
            out = [(f"vb_{vb}:state", STATE_NAMES[self.states[vb]]) for vb in vbs]
            for vb, r in sorted(self.replication.items()):
                lag = max(0, r["source_seqno"] - self.high[vb])
                out += [
                    (f"vb_{vb}:source", r["source"]),
                    (f"vb_{vb}:high_seqno", self.high[vb]),
                    (f"vb_{vb}:source_seqno", r["source_seqno"]),
                    (f"vb_{vb}:lag", lag),
                    (f"vb_{vb}:stream", r["stream"]),
                ]
            return out
        return None


def make_config(
    servers: list[str], chains: list[list[int]], rev: int = 7, names: list[str] | None = None
) -> bytes:
    """A bucket config as a cluster node sends it (protocol_spec/README.md §6.9): the
    nodes' ``HOST:PORT``, per vbucket ``[active, replica...]`` indexes, node names."""
    names = names or [f"n{i + 1}" for i in range(len(servers))]
    ext = []
    for addr, name in zip(servers, names, strict=True):
        host, _, port = addr.rpartition(":")
        ext.append({"hostname": host, "services": {"kv": int(port)}, "nodeName": name})
    return json.dumps(
        {
            "rev": rev,
            "numVBuckets": len(chains),
            "nodesExt": ext,
            "vBucketServerMap": {
                "numReplicas": max(len(c) for c in chains) - 1,
                "serverList": servers,
                "vBucketMap": chains,
            },
        }
    ).encode()
