"""A small blocking memcached-binary client for the Spark connector (driver and executors).

Rules of this module:
- Plain blocking sockets with a timeout. Spark calls the connector from ordinary Python
  processes (the streaming runner, planning workers, executor workers): no event loop,
  nothing opened before it is needed, everything closed by ``close()`` (idempotent).
- An I/O shell over a ``ClientSession`` (``dcp.protocol.session``), which allocates
  opaques, builds the requests and decodes every received byte. Requests are
  pipelined: all of a call's requests leave in one write, answers are matched by opaque.
  ``call`` is for the request/response phase only; once streams are open the executor
  (``dcp.spark.executor``) feeds the chunks ``read_chunk`` returns to the same session.
- Only ``dcp.protocol`` is used (the session, builders, parsers).
- Every socket failure becomes ``ConnectionLost`` (retriable); a refusal by the server is
  the protocol's ``StatusError`` family (``for_status``).
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any

from dcp.protocol import Opcode, Status, codec, for_status
from dcp.protocol.events import Answer
from dcp.protocol.frames import Frame
from dcp.protocol.session import ClientSession

__all__ = ["ConnectionLost", "WireClient"]


class ConnectionLost(Exception):
    """The TCP connection failed, timed out or was closed by the server (retriable)."""


class WireClient:
    """One TCP connection to a DCP server.

    Resource handling: the socket is opened by ``connect()`` (or ``with``) and released by
    ``close()``, which never raises.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float = 30.0,
        recv_size: int = 1 << 20,
        session: ClientSession | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.recv_size = recv_size
        self._sock: socket.socket | None = None
        #: the protocol state of this connection (the executor streams through it)
        self.proto = session if session is not None else ClientSession()

    # ------------------------------------------------------------------ lifecycle

    def connect(self) -> WireClient:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        return self

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:  # pragma: no cover - close of a broken socket
                pass

    def __enter__(self) -> WireClient:
        return self.connect() if self._sock is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._sock is None

    def next_opaque(self) -> int:
        return self.proto.next_opaque()

    # ------------------------------------------------------------------ raw I/O

    def send(self, data: bytes | bytearray) -> None:
        sock = self._sock
        if sock is None:
            raise ConnectionLost("connection is closed")
        try:
            sock.sendall(data)
        except OSError as exc:
            self.close()
            raise ConnectionLost(f"send to {self.host}:{self.port} failed: {exc}") from exc

    def read_chunk(self, wait: float | None = None) -> bytes:
        """Block until bytes arrive and return them; EOF raises ``ConnectionLost``.

        With ``wait`` (seconds), give up after that long and return ``b""`` instead of
        failing with the connection's timeout.
        """
        sock = self._sock
        if sock is None:
            raise ConnectionLost("connection is closed")
        try:
            if wait is not None:
                sock.settimeout(max(wait, 0.001))
                try:
                    data = sock.recv(self.recv_size)
                except TimeoutError:
                    return b""
                finally:
                    if self._sock is not None:
                        sock.settimeout(self.timeout)
            else:
                data = sock.recv(self.recv_size)
        except OSError as exc:  # includes TimeoutError
            self.close()
            raise ConnectionLost(f"receive from {self.host}:{self.port} failed: {exc}") from exc
        if not data:
            self.close()
            raise ConnectionLost(f"{self.host}:{self.port} closed the connection")
        return data

    def call(self, requests: list[tuple[int, bytes]]) -> list[Frame]:
        """Send every request in one write; return their responses in request order.

        Events other than these answers (stream messages) are dropped: callers use
        ``call`` only while no stream is open.
        """
        if not requests:
            return []
        proto = self.proto
        want = {proto.expect(opaque): i for i, (opaque, _) in enumerate(requests)}
        self.send(b"".join(data for _, data in requests))
        out: list[Any] = [None] * len(requests)
        missing = len(requests)
        while missing:
            for e in proto.receive_data(self.read_chunk()):
                i = want.get(e.opaque) if type(e) is Answer else None
                if i is None or out[i] is not None:
                    continue
                out[i] = e.result
                missing -= 1
            reply = proto.data_to_send()  # noop replies
            if reply:
                self.send(reply)
        return out

    # ------------------------------------------------------------------ requests

    def request(self, opcode: int, **kw: Any) -> tuple[int, bytes]:
        o = self.next_opaque()
        return o, codec.request(opcode, opaque=o, **kw)

    def check(self, frame: Frame, what: str) -> Frame:
        if frame.status != Status.SUCCESS:
            raise for_status(frame.status, bytes(frame.value), what)
        return frame

    def dcp_open(
        self, name: str | None = None, flags: int = 0x1, controls: dict[str, str] | None = None
    ) -> dict[str, bool]:
        """HELLO + DCP_OPEN (producer) + DCP_CONTROLs in one round trip.

        Returns which controls the server accepted (a refused control is not an error).
        """
        name = name or f"spark-dcp:{os.getpid()}:{secrets.token_hex(4)}"
        o = self.next_opaque()
        reqs = [(o, codec.hello("dcp-spark", [0x07, 0x0B], opaque=o))]
        o = self.next_opaque()
        reqs.append((o, codec.dcp_open(name, flags, opaque=o)))
        keys = list(controls or {})
        for k in keys:
            o = self.next_opaque()
            reqs.append((o, codec.dcp_control(k, controls[k], opaque=o)))  # type: ignore[index]
        frames = self.call(reqs)
        self.check(frames[1], "DCP_OPEN refused")
        return {k: f.status == Status.SUCCESS for k, f in zip(keys, frames[2:], strict=True)}

    def get_all_vb_seqnos(self) -> dict[int, int]:
        """High seqno of every live vbucket (the server closes each open checkpoint, so
        every returned seqno is a snapshot boundary)."""
        (f,) = self.call([self.request(Opcode.GET_ALL_VB_SEQNOS)])
        self.check(f, "GET_ALL_VB_SEQNOS refused")
        return dict(codec.parse_all_vb_seqnos(bytes(f.value)))

    def failover_logs(self, vbuckets: list[int]) -> dict[int, list[tuple[int, int]]]:
        """The failover log (newest entry first) of each vbucket, one pipelined call."""
        reqs = [self.request(Opcode.DCP_GET_FAILOVER_LOG, vbucket=vb) for vb in vbuckets]
        frames = self.call(reqs)
        out: dict[int, list[tuple[int, int]]] = {}
        for vb, f in zip(vbuckets, frames, strict=True):
            self.check(f, f"DCP_GET_FAILOVER_LOG of vbucket {vb} refused")
            out[vb] = codec.parse_failover_log(bytes(f.value))
        return out
