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
- Only ``dcp.protocol`` is used (the session, builders, parsers, ``SaslClient``), plus
  the connector's pure ``security.py`` and ``errors.py``.
- Every socket failure becomes ``ConnectionLost`` (retriable); a refusal by the server is
  the protocol's ``StatusError`` family (``for_status``).
- TLS (an ``ssl.SSLContext``) wraps the socket inside ``connect()``, the handshake done
  under the connection's timeout and the certificate checked against ``host``; a TLS
  failure is ``TlsError``, never retried (an EOF during the handshake stays
  ``ConnectionLost``: a restarting server looks like that).
- With credentials, ``connect()`` sends HELLO and SASL_AUTH in one write, then SASL_STEP,
  and checks the server's SCRAM signature; later requests need no HELLO of their own.
  AUTH_ERROR is the protocol's ``AuthenticationError`` naming the user and mechanism,
  never retried by anyone (the same password fails again, and the server counts each
  failure). PLAIN without TLS to another machine is refused before the socket opens.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import ssl
from typing import Any

from dcp.protocol import Opcode, Status, codec, for_status
from dcp.protocol.errors import AuthenticationError
from dcp.protocol.events import Answer
from dcp.protocol.frames import Frame
from dcp.protocol.sasl import SaslClient
from dcp.protocol.session import ClientSession

from .errors import TlsError
from .options import SourceConfig
from .security import Credentials, check_plain

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
        credentials: Credentials | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.recv_size = recv_size
        self.credentials = credentials
        self.tls = tls
        self._sock: socket.socket | None = None
        self._hello_done = False
        self._received = 0
        #: the protocol state of this connection (the executor streams through it)
        self.proto = session if session is not None else ClientSession()

    @classmethod
    def for_config(
        cls,
        cfg: SourceConfig,
        session: ClientSession | None = None,
        address: tuple[str, int] | None = None,
    ) -> WireClient:
        """A client (not connected yet) with the query's address (or ``address``: a node
        of a cluster), timeout, credentials and TLS settings: every connection the
        connector opens is made here."""
        tls = None
        if cfg.tls is not None:
            try:
                tls = cfg.tls.context()
            except (OSError, ssl.SSLError) as exc:  # loaded at load(): changed, or not here
                raise TlsError(
                    f"cannot load the TLS files on {socket.gethostname()} ({cfg.tls}): {exc}; "
                    f"they must be readable at the same path on the driver and every executor"
                ) from exc
        host, port = address or (cfg.host, cfg.port)
        return cls(
            host,
            port,
            timeout=cfg.timeout,
            session=session,
            credentials=cfg.credentials,
            tls=tls,
        )

    # ------------------------------------------------------------------ lifecycle

    def connect(self) -> WireClient:
        check_plain(self.host, self.credentials, self.tls is not None)
        where = f"{self.host}:{self.port}"
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to {where}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
            except ssl.SSLEOFError as exc:
                sock.close()
                raise ConnectionLost(f"{where} closed the connection during TLS: {exc}") from exc
            except ssl.SSLError as exc:
                sock.close()
                raise _tls_error(exc, where) from exc
            except OSError as exc:
                sock.close()
                raise ConnectionLost(f"TLS handshake with {where} failed: {exc}") from exc
        self._sock = sock
        self._hello_done = False
        self._received = 0
        if self.credentials is not None:
            try:
                self._login(self.credentials)
            except BaseException:
                self.close()
                raise
        return self

    def _login(self, creds: Credentials) -> None:
        """HELLO + SASL (see the module rules); raises ``AuthenticationError`` or the
        ``StatusError`` of another refusal (a server without SASL, a malformed message)."""
        mech = creds.mechanism
        who = f"user {creds.username!r} with {mech}"
        sasl = SaslClient(mech, creds.username, creds.password)
        hello = self._hello_request()
        o = self.next_opaque()
        frames = self.call([hello, (o, codec.sasl_auth(mech, sasl.start(), opaque=o))])
        status, value = frames[1].status, bytes(frames[1].value)
        try:
            if status == Status.AUTH_CONTINUE:
                o = self.next_opaque()
                (f,) = self.call([(o, codec.sasl_step(mech, sasl.step(value), opaque=o))])
                status, value = f.status, bytes(f.value)
            if status == Status.SUCCESS:
                sasl.finish(value)
                self._hello_done = True
                return
        except AuthenticationError as exc:
            raise AuthenticationError(message=f"authentication as {who} failed: {exc}") from exc
        if status == Status.AUTH_ERROR:
            detail = _detail(value) or "wrong user name or password"
            raise AuthenticationError(
                message=f"authentication as {who} refused: {detail}", value=value
            )
        raise for_status(status, value, f"SASL authentication as {who}: {_detail(value)}")

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
            if _refused_certificate(exc):  # TLS 1.3: the refusal comes after the handshake
                raise _tls_error(exc, f"{self.host}:{self.port}") from exc  # type: ignore[arg-type]
            raise ConnectionLost(f"receive from {self.host}:{self.port} failed: {exc}") from exc
        if not data:
            self.close()
            hint = ""
            if self.tls is not None and not self._received:
                hint = " before answering (does it require a client certificate? tlsCertFile)"
            raise ConnectionLost(f"{self.host}:{self.port} closed the connection{hint}")
        self._received += len(data)
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
        reqs = [] if self._hello_done else [self._hello_request()]
        first = len(reqs)
        o = self.next_opaque()
        reqs.append((o, codec.dcp_open(name, flags, opaque=o)))
        keys = list(controls or {})
        for k in keys:
            o = self.next_opaque()
            reqs.append((o, codec.dcp_control(k, controls[k], opaque=o)))  # type: ignore[index]
        frames = self.call(reqs)
        self.check(frames[first], "DCP_OPEN refused")
        done = frames[first + 1 :]
        return {k: f.status == Status.SUCCESS for k, f in zip(keys, done, strict=True)}

    def _hello_request(self) -> tuple[int, bytes]:
        o = self.next_opaque()
        return o, codec.hello("dcp-spark", [0x07, 0x0B], opaque=o)

    def get_all_vb_seqnos(self, state: int | None = None) -> dict[int, int]:
        """High seqno of every live vbucket, or (``state``: 1 active, 2 replica) of those
        in that state (the server closes each open checkpoint, so every returned seqno is
        a snapshot boundary)."""
        extras = b"" if state is None else state.to_bytes(4, "big")
        (f,) = self.call([self.request(Opcode.GET_ALL_VB_SEQNOS, extras=extras)])
        self.check(f, "GET_ALL_VB_SEQNOS refused")
        return dict(codec.parse_all_vb_seqnos(bytes(f.value)))

    def stats(self, groups: list[str]) -> list[dict[str, str]]:
        """The pairs of each STAT group of ``groups`` (e.g. ``"vbucket-seqno 3"``), one
        pipelined call. A STAT answer is one response per pair, ended by one with an
        empty key, so it is collected here rather than by ``call`` (which takes one
        response per request). A refusal raises the protocol's ``StatusError``."""
        if not groups:
            return []
        proto = self.proto
        opaques = [proto.expect(proto.next_opaque(), stat=True) for _ in groups]
        index = {o: i for i, o in enumerate(opaques)}
        self.send(
            b"".join(
                codec.request(Opcode.STAT, opaque=o, key=g.encode())
                for o, g in zip(opaques, groups, strict=True)
            )
        )
        out: list[dict[str, str]] = [{} for _ in groups]
        open_ = len(groups)
        refused: tuple[Frame, str] | None = None
        while open_:
            for e in proto.receive_data(self.read_chunk()):
                i = index.get(e.opaque) if type(e) is Answer else None
                if i is None:
                    continue
                f = e.result
                if f.status != Status.SUCCESS or not f.key:
                    del index[e.opaque]  # the group's last answer
                    open_ -= 1
                    if f.status != Status.SUCCESS and refused is None:
                        refused = (f, groups[i])
                    continue
                out[i][bytes(f.key).decode("utf-8", "replace")] = bytes(f.value).decode(
                    "utf-8", "replace"
                )
            reply = proto.data_to_send()  # noop replies
            if reply:
                self.send(reply)
        if refused is not None:  # after every answer: the connection stays usable
            self.check(refused[0], f"STAT {refused[1]!r} refused")
        return out

    def cluster_config(self) -> bytes | None:
        """The bucket config JSON (GET_CLUSTER_CONFIG); None from a server that does not
        know the command (a single server of an older kind)."""
        (f,) = self.call([self.request(Opcode.GET_CLUSTER_CONFIG)])
        if f.status == Status.UNKNOWN_COMMAND:
            return None
        self.check(f, "GET_CLUSTER_CONFIG refused")
        return bytes(f.value)

    def failover_logs(self, vbuckets: list[int]) -> dict[int, list[tuple[int, int]]]:
        """The failover log (newest entry first) of each vbucket, one pipelined call."""
        reqs = [self.request(Opcode.DCP_GET_FAILOVER_LOG, vbucket=vb) for vb in vbuckets]
        frames = self.call(reqs)
        out: dict[int, list[tuple[int, int]]] = {}
        for vb, f in zip(vbuckets, frames, strict=True):
            self.check(f, f"DCP_GET_FAILOVER_LOG of vbucket {vb} refused")
            out[vb] = codec.parse_failover_log(bytes(f.value))
        return out


def _detail(value: bytes) -> str:
    """The server's reason: its JSON error context (XERROR style) or the plain text."""
    try:
        return str(json.loads(value)["error"]["context"])[:200]
    except (ValueError, KeyError, TypeError):
        return bytes(value[:200]).decode("utf-8", "replace")


def _tls_error(exc: ssl.SSLError, where: str) -> TlsError:
    """What a failed handshake means, with what to do about it."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return TlsError(
            f"TLS with {where}: the server's certificate is not trusted: "
            f"{exc.verify_message} (trust the CA that signed it: option tlsCaFile or "
            f"DCP_TLS_CA)"
        )
    if exc.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE"):
        return TlsError(f"TLS with {where}: the server does not speak TLS on this port ({exc})")
    if "CERTIFICATE" in str(exc.reason or "").upper():
        return TlsError(
            f"TLS with {where}: the server refused our client certificate ({exc}; option "
            f"tlsCertFile)"
        )
    return TlsError(f"TLS with {where} failed: {exc}")


def _refused_certificate(exc: OSError) -> bool:
    return (
        isinstance(exc, ssl.SSLError)
        and not isinstance(exc, ssl.SSLEOFError)
        and "CERTIFICATE" in str(exc.reason or "").upper()
    )
