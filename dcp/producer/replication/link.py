"""The I/O of one replication connection: connect, handshake, send queue, receive with a
dead-connection watchdog. (What is streamed and applied: ``source.py``.)

Rules of this module:
- The wire protocol is a ``ClientSession`` (``dcp.protocol.session``); this module only
  moves its bytes. Every failure of the connection is raised as ``LinkLost`` (with the
  cause chained), so the caller has one thing to catch before it reconnects.
- Sending never blocks the caller: ``send`` appends to one buffer that ``writer`` (one
  task per connection) writes with one ``send_all`` per wake-up, so frames leave in the
  order they were queued from any task or synchronous handler.
- The handshake is pipelined in one write: HELLO, DCP_OPEN (producer, include delete
  times) and the DCP_CONTROLs a replica needs; it waits for every answer. DCP_OPEN
  must succeed; a refused control degrades (no noop: no dead-connection detection; no
  window: no flow control) and is logged.
- Dead connection: after ``probe_after`` seconds of silence a plain NOOP probes the
  source; if another ``probe_after`` passes with nothing received, the link is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from ...protocol import codec
from ...protocol.errors import RemoteProtocolError, for_status
from ...protocol.events import Answer
from ...protocol.frames import Frame
from ...protocol.opcodes import DcpOpenFlag, HelloFeature, Status
from ...protocol.session import ClientSession

__all__ = ["Link", "LinkLost", "OpenStream", "SourceSettings", "split_address"]

log = logging.getLogger("dcp.replication")

#: how a connection is opened: ``await open_stream(host, port)`` (trio.open_tcp_stream)
OpenStream = Callable[[str, int], Awaitable[trio.abc.Stream]]

_FEATURES = [int(HelloFeature.XERROR), int(HelloFeature.JSON)]


@dataclass(frozen=True)
class SourceSettings:
    """How replication connections connect, back off, detect death and flow-control."""

    open_stream: OpenStream
    backoff_initial: float = 0.1
    backoff_max: float = 5.0
    connect_timeout: float = 5.0
    noop_interval: float | None = 5.0  # None: no noops, no dead-connection detection
    window: int = 16 * 1024 * 1024  # flow-control buffer (0: none)
    receive_size: int = 256 * 1024


class LinkLost(Exception):
    """The replication connection failed or was closed (``str`` says how)."""


def split_address(addr: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (or ``"[v6]:PORT"``) as (host, port); ValueError if malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a HOST:PORT address: {addr!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


class Link:
    """One connected stream and its session (see the module rules)."""

    def __init__(self, stream: trio.abc.Stream, session: ClientSession) -> None:
        self.stream = stream
        self.session = session
        self.probe_after: float | None = None
        self._out = bytearray()
        self._wake = trio.Event()
        self._closing = False

    @classmethod
    async def connect(
        cls, open_stream: OpenStream, addr: str, session: ClientSession, timeout: float
    ) -> Link:
        try:
            host, port = split_address(addr)
        except ValueError as exc:
            raise LinkLost(str(exc)) from exc
        try:
            with trio.fail_after(timeout):
                stream = await open_stream(host, port)
        except trio.TooSlowError as exc:
            raise LinkLost(f"connect to {addr} timed out after {timeout:g}s") from exc
        except OSError as exc:
            raise LinkLost(f"connect to {addr} failed: {exc}") from exc
        return cls(stream, session)

    # ------------------------------------------------------------------ sending

    def send(self, data: bytes | bytearray) -> None:
        if data:
            self._out += data
            self._wake.set()

    def close_when_flushed(self) -> None:
        """Let ``writer`` return once everything queued so far is sent."""
        self._closing = True
        self._wake.set()

    async def writer(self) -> None:
        """Write what is queued until cancelled (or, after ``close_when_flushed``, until
        the queue is empty)."""
        while True:
            if self._out:
                data, self._out = bytes(self._out), bytearray()
                await self._send_all(data)
                continue
            if self._closing:
                return
            self._wake = trio.Event()
            await self._wake.wait()

    async def _send_all(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise LinkLost(f"send failed: {exc!r}") from exc

    # ------------------------------------------------------------------ receiving

    async def receive(self, size: int) -> bytes | bytearray:
        """The next bytes from the source (see the module rules on silence)."""
        try:
            if self.probe_after is None:
                data = await self.stream.receive_some(size)
            else:
                data = None
                with trio.move_on_after(self.probe_after):
                    data = await self.stream.receive_some(size)
                if data is None:
                    await self._send_all(self.session.probe())
                    with trio.move_on_after(self.probe_after):
                        data = await self.stream.receive_some(size)
                    if data is None:
                        raise LinkLost(f"nothing received for {2 * self.probe_after:g}s")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise LinkLost(f"receive failed: {exc!r}") from exc
        if not data:
            raise LinkLost("the source closed the connection")
        return data

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)

    # ------------------------------------------------------------------ handshake

    async def handshake(self, name: str, *, window: int, noop_interval: float | None) -> None:
        """HELLO, DCP_OPEN and the controls (see the module rules); raises ``LinkLost``
        (a refused DCP_OPEN too: the source may be starting, so it is retried)."""
        s = self.session
        controls: list[tuple[str, str]] = []
        if noop_interval:
            controls += [("enable_noop", "true"), ("set_noop_interval", f"{noop_interval:g}")]
        if window:
            controls.append(("connection_buffer_size", str(window)))
        controls += [
            ("enable_expiry_opcode", "true"),
            ("send_seqno_advanced", "true"),
            ("send_stream_end_on_client_close_stream", "true"),
            ("set_priority", "high"),
        ]
        reqs = []
        o = s.expect(s.next_opaque())
        reqs.append((o, codec.hello(name, _FEATURES, opaque=o)))
        o = s.expect(s.next_opaque())
        flags = int(DcpOpenFlag.PRODUCER | DcpOpenFlag.INCLUDE_DELETE_TIMES)
        reqs.append((o, codec.dcp_open(name, flags, opaque=o)))
        for key, value in controls:
            o = s.expect(s.next_opaque())
            reqs.append((o, codec.dcp_control(key, value, opaque=o)))
        await self._send_all(b"".join(data for _, data in reqs))
        answers = await self._answers([o for o, _ in reqs])
        hello, opened = answers[0], answers[1]
        if opened.status != Status.SUCCESS:
            raise LinkLost(f"DCP_OPEN refused: {for_status(opened.status, bytes(opened.value))}")
        if hello.status != Status.SUCCESS:
            log.warning("%s: HELLO refused (status 0x%02x)", name, hello.status)
        ok = {
            k: f.status == Status.SUCCESS for (k, _), f in zip(controls, answers[2:], strict=True)
        }
        for key, accepted in ok.items():
            if not accepted:
                log.warning("%s: the source refused control %s", name, key)
        if noop_interval and ok["enable_noop"] and ok["set_noop_interval"]:
            self.probe_after = noop_interval
        if window and not ok["connection_buffer_size"]:
            s.flow.enabled = False

    async def _answers(self, opaques: list[int]) -> list[Frame]:
        got: dict[int, Frame] = {}
        want = set(opaques)
        while not want <= got.keys():
            data = await self.receive(64 * 1024)
            try:
                events = self.session.receive_data(data)
            except RemoteProtocolError as exc:
                raise LinkLost(f"protocol error in the handshake: {exc}") from exc
            for e in events:
                if isinstance(e, Answer) and e.opaque in want:
                    got[e.opaque] = e.result
            self.send(self.session.data_to_send())
        return [got[o] for o in opaques]
