"""Load generators of the ``scale`` benchmark (``scale.py``): writers and DCP consumers that
find each vbucket's node in the bucket config themselves and speak the wire protocol on
plain blocking sockets.

Run as ``python tools/bench/scale_worker.py ROLE '{json params}'``; the conversation is
``worker.py``'s (JSON lines out: ready / registered / result / error; commands in: go).

Rules of this file:
- Routing is by the bucket config (``ClusterConfig`` from GET_CLUSTER_CONFIG of the first
  bootstrap address that answers): each vbucket's writes and its stream go to its active
  node. A one-server config means "the node you asked" (its serverList text may be an
  address the client cannot use). The SDK's clients are not used on purpose: the measure
  is how the *servers* scale from one node to two, so the load generator must cost the
  same, and as little, whatever the number of nodes, and must not change while the SDK
  learns to route (its single-address behaviour is being changed for clusters).
- Everything that is not the measured work is done before ``go``: fetching the map,
  encoding every SET, opening the DCP connections and registering the streams.
- Per node, the writes have the same shape whatever the node count: a writer keeps one
  batch of ``batch`` SETs in flight on each node it writes to. A consumer has one DCP
  connection per node; its flow-control window of ``buffer_size`` bytes is split among
  them, so the bytes a server may send before "go" (held in socket buffers, read fast)
  are the same in total with one node or two.
- Every wait is bounded by the ``timeout`` parameter; a write the server refuses is
  retried only for ETMPFAIL (a node's write gate closing for a moment) and NOT_MY_VBUCKET
  (the map moved: re-read it), until the deadline; any other status fails the run.
"""

from __future__ import annotations

import selectors
import socket
import struct
import sys
import time
from typing import Any

from worker import Meter, emit, key_of, read_cmd, value_of

from dcp.protocol import codec
from dcp.protocol.cluster_config import Address, ClusterConfig, ConfigError
from dcp.protocol.frames import FrameReader
from dcp.protocol.layout import vbucket_for_key
from dcp.protocol.opcodes import DcpOpenFlag, Opcode, Status

_HDR = struct.Struct(">BBHBBHII")  # magic opcode keylen extlen datatype vb/status body opaque
_HDR_SIZE = 24
_MUTATION = int(Opcode.DCP_MUTATION)
_NOOP = int(Opcode.DCP_NOOP)
_STREAM_END = int(Opcode.DCP_STREAM_END)
_DELETION = int(Opcode.DCP_DELETION)
_REQUEST = 0x80


class _Frames:
    """Whole frames of a blocking socket, one at a time (its timeout bounds each wait)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader()
        self.ready: list[Any] = []

    def next(self) -> Any:
        while not self.ready:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the server closed the connection")
            self.reader.feed(data)
            self.ready = self.reader.read_frames()
        return self.ready.pop(0)

    def idle(self) -> bool:
        """Nothing received beyond the frames taken."""
        return not self.ready and self.reader.buffered == 0


def _ask_config(addr: Address, nvb: int) -> tuple[ClusterConfig | None, str]:
    """One node's config (None and why when it has none to give)."""
    try:
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(codec.request(Opcode.GET_CLUSTER_CONFIG, opaque=1))
            f = _Frames(s).next()
    except OSError as exc:
        return None, f"{addr[0]}:{addr[1]}: {exc}"
    if f.vbucket == Status.UNKNOWN_COMMAND:  # an old single node
        return ClusterConfig.single(addr, nvb), ""
    if f.vbucket != Status.SUCCESS:
        return None, f"{addr[0]}:{addr[1]}: status 0x{f.vbucket:02x}"
    try:
        return ClusterConfig.from_json(bytes(f.value)), ""
    except ConfigError as exc:
        return None, f"{addr[0]}:{addr[1]}: {exc}"


def fetch_config(
    bootstrap: list[Address], nvb: int, deadline: float
) -> tuple[ClusterConfig, list[Address]]:
    """The newest map any bootstrap node gives, and each vbucket's active node.

    Every node is asked, not only the first that answers: a node reads a new map from etcd
    a moment after the others, and until it does it serves the old one. ETMPFAIL (a node
    without a map yet) and a vbucket without an active are waited out until ``deadline``."""
    last = "no answer"
    while time.monotonic() < deadline:
        best: tuple[ClusterConfig, Address] | None = None
        for addr in bootstrap:
            cfg, why = _ask_config(addr, nvb)
            if cfg is None:
                last = why
            elif best is None or cfg.newer_than(best[0]):
                best = (cfg, addr)
        if best is not None:
            cfg, addr = best
            if cfg.num_vbuckets != nvb:
                raise ConfigError(f"the map has {cfg.num_vbuckets} vbuckets, not {nvb}")
            if len(cfg.servers) == 1:  # "the node you asked", whatever its serverList says
                return cfg, [addr] * nvb
            owners = [cfg.active(vb) for vb in range(nvb)]
            if all(o is not None for o in owners):
                return cfg, owners  # type: ignore[return-value]
            last = "a vbucket has no active node"
        time.sleep(0.1)
    raise TimeoutError(f"no usable bucket config before the deadline ({last})")


class _Moved(Exception):
    """A stream request answered NOT_MY_VBUCKET: the map moved since it was read."""


def _connect(addr: Address, timeout: float) -> socket.socket:
    s = socket.create_connection(addr, timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


# ---------------------------------------------------------------------- writer


def _read_acks(sock: socket.socket, n: int, failed: dict[int, int]) -> None:
    """Read ``n`` SET answers; the opaques (item numbers) of refused ones go to ``failed``."""
    buf = b""
    got = 0
    unpack = _HDR.unpack_from
    while got < n:
        data = sock.recv(1 << 18)
        if not data:
            raise ConnectionError("the server closed a write connection")
        buf = buf + data if buf else data
        o = 0
        end_all = len(buf)
        while end_all - o >= _HDR_SIZE:
            _m, _op, _kl, _el, _dt, status, body, opaque = unpack(buf, o)
            end = o + _HDR_SIZE + body
            if end > end_all:
                break
            if status:
                failed[opaque] = status
            got += 1
            o = end
        buf = buf[o:]


def scale_writer(p: dict[str, Any]) -> None:
    """Writes items ``lo``..``hi``-1 (key ``key-%012d``), each to its vbucket's active."""
    nvb, batch, size = p["vbuckets"], p["batch"], p["value_size"]
    deadline = time.monotonic() + p["timeout"]
    boot = [tuple(a) for a in p["bootstrap"]]
    cfg, owners = fetch_config(boot, nvb, deadline)  # type: ignore[arg-type]
    extras = codec.store_extras()
    frames: dict[int, bytes] = {}
    vbs: dict[int, int] = {}
    per_node: dict[Address, list[int]] = {}
    for j in range(p["lo"], p["hi"]):
        k = key_of(j)
        vb = vbucket_for_key(k, nvb)
        frames[j] = codec.request(
            Opcode.SET, vbucket=vb, opaque=j, extras=extras, key=k, value=value_of(j, size)
        )
        vbs[j] = vb
        per_node.setdefault(owners[vb], []).append(j)
    socks = {addr: _connect(addr, p["timeout"]) for addr in per_node}
    plan = _plan(per_node, frames, batch)  # the batches' bytes, joined before the clock runs
    emit("ready", nodes={f"{a[0]}:{a[1]}": len(js) for a, js in per_node.items()})
    read_cmd()
    m = Meter()
    retried = 0
    try:
        while True:
            failed = _send(socks, plan)
            if not failed:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(failed)} writes still refused at the deadline")
            bad = {s for s in failed.values() if s not in (Status.ETMPFAIL, Status.NOT_MY_VBUCKET)}
            if bad:
                raise RuntimeError(f"writes refused with status {sorted(bad)}")
            retried += len(failed)
            if Status.NOT_MY_VBUCKET in failed.values():
                cfg, owners = fetch_config(boot, nvb, deadline)  # type: ignore[arg-type]
            time.sleep(0.02)
            again: dict[Address, list[int]] = {}
            for j in sorted(failed):
                again.setdefault(owners[vbs[j]], []).append(j)
            for addr in again:
                if addr not in socks:
                    socks[addr] = _connect(addr, p["timeout"])
            plan = _plan(again, frames, batch)
        emit("result", **m.result(count=len(frames), retried=retried, map_rev=cfg.rev))
    finally:
        for s in socks.values():
            s.close()


_Plan = dict[Address, list[tuple[bytes, int]]]


def _plan(per_node: dict[Address, list[int]], frames: dict[int, bytes], batch: int) -> _Plan:
    """Per node: its items in batches of ``batch`` (the joined frames, how many)."""
    return {
        a: [
            (b"".join(frames[j] for j in js[i : i + batch]), len(js[i : i + batch]))
            for i in range(0, len(js), batch)
        ]
        for a, js in per_node.items()
    }


def _send(socks: dict[Address, socket.socket], plan: _Plan) -> dict[int, int]:
    """Every batch once: per round one batch to each node, then each node's answers.
    Returns the refused items (item number -> status)."""
    failed: dict[int, int] = {}
    rounds = max(len(b) for b in plan.values())
    for r in range(rounds):
        sent = [a for a in plan if r < len(plan[a])]
        for a in sent:
            socks[a].sendall(plan[a][r][0])
        for a in sent:
            _read_acks(socks[a], plan[a][r][1], failed)
    return failed


# ---------------------------------------------------------------------- consumer


def _open_streams(addr: Address, vbs: list[int], p: dict[str, Any], window: int) -> socket.socket:
    """A DCP connection to ``addr`` with a flow-control window and a stream per vbucket
    of ``vbs`` from seqno 0 (every stream request answered before it returns)."""
    s = _connect(addr, p["timeout"])
    reqs = [
        codec.dcp_open(f"bench-scale-{p['index']}", int(DcpOpenFlag.PRODUCER), opaque=1),
        codec.dcp_control("connection_buffer_size", str(window), opaque=2),
        codec.dcp_control("supports_cursor_dropping", "true", opaque=3),
    ]
    s.sendall(b"".join(reqs))
    frames = _Frames(s)
    for what in ("DCP_OPEN", "connection_buffer_size", "supports_cursor_dropping"):
        f = frames.next()
        if f.vbucket != Status.SUCCESS:
            raise RuntimeError(f"{addr}: {what} refused: status 0x{f.vbucket:02x}")
    s.sendall(b"".join(codec.stream_request(vb, opaque=0x10000 + vb) for vb in vbs))
    left = set(vbs)
    while left:
        f = frames.next()
        if f.opcode != Opcode.DCP_STREAM_REQ or f.magic != 0x81:
            raise RuntimeError(f"{addr}: opcode 0x{f.opcode:02x} before every stream was open")
        if f.vbucket == Status.NOT_MY_VBUCKET:
            s.close()
            raise _Moved(f"{addr}: vbucket {f.opaque - 0x10000} is not there")
        if f.vbucket != Status.SUCCESS:
            raise RuntimeError(f"{addr}: stream request refused: status 0x{f.vbucket:02x}")
        left.discard(f.opaque - 0x10000)
    if not frames.idle():  # nothing was written yet: nothing else may have come
        raise RuntimeError(f"{addr}: unexpected frames after the stream requests")
    return s


def scale_consumer(p: dict[str, Any]) -> None:
    """Streams the vbuckets ``vb % consumers == index`` from their actives until every item
    written to them (``items`` keys ``key-%012d``) was delivered."""
    nvb, ncons, idx = p["vbuckets"], p["consumers"], p["index"]
    deadline = time.monotonic() + p["timeout"]
    boot = [tuple(a) for a in p["bootstrap"]]
    mine = [vb for vb in range(nvb) if vb % ncons == idx]
    expect = sum(1 for j in range(p["items"]) if vbucket_for_key(key_of(j), nvb) % ncons == idx)
    while True:  # until every stream is open where the newest map says
        _cfg, owners = fetch_config(boot, nvb, deadline)  # type: ignore[arg-type]
        by_node: dict[Address, list[int]] = {}
        for vb in mine:
            by_node.setdefault(owners[vb], []).append(vb)
        # the consumer's window (``buffer_size``) is shared by its connections, so that
        # as many bytes wait in socket buffers at "go" whatever the number of nodes
        window = p["buffer_size"] // len(by_node)
        socks: dict[Address, socket.socket] = {}
        try:
            for a, vbs in by_node.items():
                socks[a] = _open_streams(a, vbs, p, window)
            break
        except _Moved:
            for s in socks.values():
                s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    emit("registered", nodes={f"{a[0]}:{a[1]}": len(v) for a, v in by_node.items()}, expect=expect)
    read_cmd()  # blocks: nothing is read while the items are written (module rules)
    m = Meter()
    try:
        counts = _drain(socks, expect, window, deadline + p["timeout"])
    finally:
        for s in socks.values():
            s.close()
    emit("result", **m.result(count=sum(counts.values()), expected=expect, per_node=counts))


def _drain(
    socks: dict[Address, socket.socket], expect: int, window: int, deadline: float
) -> dict[str, int]:
    """Read every connection until ``expect`` mutations arrived; acknowledges the bytes of
    every server request but NOOP once a fifth of the window is due, as the SDK does."""
    sel = selectors.DefaultSelector()
    state: dict[socket.socket, list[Any]] = {}
    for a, s in socks.items():
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        state[s] = [f"{a[0]}:{a[1]}", b"", 0, 0]  # name, rest, mutations, bytes to ack
    threshold = max(1, window // 5)
    total = 0
    unpack = _HDR.unpack_from
    while total < expect:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{total} of {expect} mutations before the deadline")
        for key, _ev in sel.select(min(left, 1.0)):
            s = key.fileobj
            st = state[s]  # type: ignore[index]
            data = s.recv(1 << 18)  # type: ignore[union-attr]
            if not data:
                raise ConnectionError(f"{st[0]} closed the DCP connection")
            buf = st[1] + data if st[1] else data
            o = 0
            end_all = len(buf)
            n = 0
            acked = 0
            while end_all - o >= _HDR_SIZE:
                magic, op, kl, el, _dt, _vb, body, _opq = unpack(buf, o)
                end = o + _HDR_SIZE + body
                if end > end_all:
                    break
                if op == _MUTATION:
                    _value = buf[o + _HDR_SIZE + el + kl : end]  # touched, as a reader would
                    n += 1
                elif op == _STREAM_END or op == _DELETION:
                    raise RuntimeError(f"{st[0]}: unexpected opcode 0x{op:02x}")
                if magic == _REQUEST and op != _NOOP:
                    acked += end - o
                o = end
            st[1] = buf[o:]
            st[2] += n
            total += n
            st[3] += acked
            if st[3] >= threshold:
                s.setblocking(True)  # type: ignore[union-attr]
                s.sendall(codec.buffer_ack(st[3]))  # type: ignore[union-attr]
                s.setblocking(False)  # type: ignore[union-attr]
                st[3] = 0
    sel.close()
    return {st[0]: st[2] for st in state.values()}


ROLES = {"scale-writer": scale_writer, "scale-consumer": scale_consumer}


def main() -> None:
    import json

    role, params = sys.argv[1], json.loads(sys.argv[2])
    try:
        ROLES[role](params)
    except BaseException as exc:  # report, then exit non-zero
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        emit("error", error=f"{type(exc).__name__}: {exc}")
        raise


if __name__ == "__main__":
    main()
