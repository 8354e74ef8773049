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
  window: no flow control; no consumer_name: no SEQNO_ACKNOWLEDGED, so this copy counts
  for no durable write) and is logged.
- Dead connection: after ``probe_after`` seconds of silence a plain NOOP probes the
  source; if another ``probe_after`` passes with nothing received, the link is lost.
- Authentication (``SourceAuth``: the node's ``replication_user``): SASL_AUTH goes in the
  first write with HELLO, SASL_STEP follows for SCRAM, then DCP_OPEN and the controls;
  the SASL messages are ``dcp.protocol.sasl.SaslClient``'s. A refusal is a ``LinkLost``
  naming the user and mechanism (retried with backoff, logged once: the source's users
  file may be fixed and reloaded meanwhile).
- TLS (``replication_tls``): ``tls_open_stream`` is the ``OpenStream`` that connects and
  finishes the TLS handshake, verifying the source's certificate; a failed handshake is
  a ``LinkLost`` too. It reads the server's current context at each connect (SIGHUP
  rebuilds it).
- The client's SCRAM key derivation (PBKDF2 at the iterations the source asks) runs in
  a worker thread: the node's event loop serves its clients meanwhile.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from ...protocol import codec
from ...protocol.errors import AuthenticationError, RemoteProtocolError, for_status
from ...protocol.events import Answer
from ...protocol.frames import Frame
from ...protocol.opcodes import DcpOpenFlag, HelloFeature, Status
from ...protocol.sasl import SaslClient
from ...protocol.session import ClientSession

__all__ = [
    "Link",
    "LinkLost",
    "OpenStream",
    "SourceAuth",
    "SourceSettings",
    "split_address",
    "tls_open_stream",
]

log = logging.getLogger("dcp.replication")

#: how a connection is opened: ``await open_stream(host, port)`` (trio.open_tcp_stream)
OpenStream = Callable[[str, int], Awaitable[trio.abc.Stream]]

_FEATURES = [int(HelloFeature.XERROR), int(HelloFeature.JSON)]


@dataclass(frozen=True)
class SourceAuth:
    """Who replication connections authenticate as (the node's internal user)."""

    username: str
    password: str = field(repr=False)  # never in a log line
    mechanism: str = "SCRAM-SHA512"


def tls_open_stream(
    ctx: ssl.SSLContext | Callable[[], ssl.SSLContext],
    open_tcp: OpenStream = trio.open_tcp_stream,
) -> OpenStream:
    """An ``OpenStream`` that returns a TLS stream with its handshake done (the source's
    certificate verified against ``ctx`` for the host connected to). ``ctx`` may be a
    function returning the current context: each connect then uses the newest one (the
    server rebuilds it on SIGHUP)."""
    current = ctx if callable(ctx) else (lambda: ctx)

    async def open_tls(host: str, port: int) -> trio.abc.Stream:
        tcp = await open_tcp(host, port)
        tls = trio.SSLStream(tcp, current(), server_hostname=host, https_compatible=True)
        try:
            await tls.do_handshake()
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
        return tls

    return open_tls


@dataclass(frozen=True)
class SourceSettings:
    """How replication connections connect, authenticate, back off, detect death and
    flow-control."""

    open_stream: OpenStream
    backoff_initial: float = 0.1
    backoff_max: float = 5.0
    connect_timeout: float = 5.0
    noop_interval: float | None = 5.0  # None: no noops, no dead-connection detection
    window: int = 16 * 1024 * 1024  # flow-control buffer (0: none)
    receive_size: int = 256 * 1024
    auth: SourceAuth | None = None  # None: connect without authenticating
    #: the node name acks are sent under (DCP_CONTROL consumer_name); None: no acks
    consumer_name: str | None = None


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
        #: the source took our ``consumer_name``: this replica acknowledges (acks.py)
        self.acks = False
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
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise LinkLost(f"TLS handshake with {addr} failed: {exc.__cause__ or exc}") from exc
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

    async def handshake(
        self,
        name: str,
        *,
        window: int,
        noop_interval: float | None,
        auth: SourceAuth | None = None,
        consumer_name: str | None = None,
    ) -> None:
        """HELLO, SASL with ``auth``, DCP_OPEN and the controls (see the module rules);
        raises ``LinkLost`` (a refused DCP_OPEN too: the source may be starting, so it is
        retried). ``consumer_name``: the cluster node name this replica acknowledges
        under (DCP_SEQNO_ACKNOWLEDGED); None: it does not acknowledge."""
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
        if consumer_name:
            controls.append(("consumer_name", consumer_name))
        reqs = []
        o = s.expect(s.next_opaque())
        reqs.append((o, codec.hello(name, _FEATURES, opaque=o)))
        answers: list[Frame] = []
        if auth is not None:
            answers = [await self._authenticate(auth, reqs)]
            reqs = []
        o = s.expect(s.next_opaque())
        flags = int(DcpOpenFlag.PRODUCER | DcpOpenFlag.INCLUDE_DELETE_TIMES)
        reqs.append((o, codec.dcp_open(name, flags, opaque=o)))
        for key, value in controls:
            o = s.expect(s.next_opaque())
            reqs.append((o, codec.dcp_control(key, value, opaque=o)))
        answers += await self._call(reqs)
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
        self.acks = bool(consumer_name) and ok["consumer_name"]

    async def login(self, name: str, auth: SourceAuth | None = None) -> None:
        """HELLO and, with ``auth``, SASL: no DCP_OPEN. For a plain request/answer
        connection (cluster/control.py); raises ``LinkLost`` as ``handshake`` does."""
        o = self.session.expect(self.session.next_opaque())
        reqs = [(o, codec.hello(name, _FEATURES, opaque=o))]
        if auth is not None:
            await self._authenticate(auth, reqs)
        else:
            await self._call(reqs)

    async def call(self, reqs: list[tuple[int, bytes]]) -> list[Frame]:
        """Send ``reqs`` ((opaque, frame) pairs the session ``expect``s) in one write and
        return their answers in order; ``LinkLost`` on any failure."""
        return await self._call(reqs)

    async def _call(self, reqs: list[tuple[int, bytes]]) -> list[Frame]:
        """Send ``reqs`` in one write; their answers in order."""
        await self._send_all(b"".join(data for _, data in reqs))
        return await self._answers([o for o, _ in reqs])

    async def _authenticate(self, auth: SourceAuth, first: list[tuple[int, bytes]]) -> Frame:
        """SASL as ``auth``, its first message sent with the requests ``first`` (HELLO);
        returns the answer to those."""
        s = self.session
        who = f"authentication as {auth.username!r} with {auth.mechanism}"
        try:
            client = SaslClient(auth.mechanism, auth.username, auth.password)
            o = s.expect(s.next_opaque())
            *answers, f = await self._call(
                [*first, (o, codec.sasl_auth(auth.mechanism, client.start(), opaque=o))]
            )
            if f.status == Status.AUTH_CONTINUE:
                # PBKDF2 at the source's iterations: a worker thread, not the event loop
                final = await trio.to_thread.run_sync(client.step, bytes(f.value))
                o = s.expect(s.next_opaque())
                data = codec.sasl_step(auth.mechanism, final, opaque=o)
                (f,) = await self._call([(o, data)])
            if f.status == Status.SUCCESS:
                client.finish(bytes(f.value))
                return answers[0]
        except (AuthenticationError, ValueError) as exc:
            raise LinkLost(f"{who} failed: {exc}") from exc
        raise LinkLost(f"{who} refused: {for_status(f.status, bytes(f.value))}")

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
