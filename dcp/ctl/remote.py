"""A short-lived raw connection to a live server, for STAT and discovery requests.

Rules of this module:
- The SDK has no STAT call, so this speaks the wire directly, as an I/O shell over a
  ``dcp.protocol`` ``ClientSession`` (requests, opaques, decoding, answer matching):
  no hand-made bytes.
- One connection per command, opened within ``timeout`` seconds. Requests are pipelined
  in one write and their answers matched by opaque; a STAT answer is the run of
  responses ending with an empty key (the session keeps matching until then).
- With ``security`` (``access.resolve``) the connection is TLS and/or authenticated
  (``dcp.consumer.security``: the SDK's TLS connect and SASL exchange) before any
  request; a refused login or an untrusted certificate is a ``CtlError`` at once. Each
  node's certificate is checked against that node's own host name (a command reaching
  several nodes does not check them all against ``--host``), and PLAIN in clear to a
  non-loopback node is refused.
- Every failure is a ``CtlError`` with one line: unreachable server, timeout, connection
  closed, or the status the server answered with its error context. The exceptions are
  requests whose per-vbucket status the caller reports itself (``set_vbucket_states``)
  and ``optional`` STAT groups (an older server lacks them: ``None``, not an error).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import trio

from ..protocol import Frame, Opcode, RemoteProtocolError, Status, VBucketState, codec
from ..protocol.errors import StatusError
from ..protocol.events import Answer
from ..protocol.session import ClientSession
from .output import CtlError

if TYPE_CHECKING:
    from ..consumer.security import Security

__all__ = ["Remote", "error_context", "os_error_text", "status_name"]


def error_context(value: bytes) -> str:
    """The ``{"error": {"context": ...}}`` message a server put in an error response."""
    try:
        ctx = json.loads(value)["error"]["context"]
        return str(ctx)
    except (ValueError, KeyError, TypeError):
        return value.decode("utf-8", "replace")


def os_error_text(exc: BaseException) -> str:
    """The reason of a failed connect: trio's "all attempts failed" hides it in its cause."""
    seen = [exc]
    while seen:
        e = seen.pop(0)
        if isinstance(e, OSError) and e.strerror:
            return e.strerror.rsplit(": ", 1)[-1].lower()
        if isinstance(e, BaseExceptionGroup):
            seen.extend(e.exceptions)
        if e.__cause__ is not None:
            seen.append(e.__cause__)
    return str(exc)


def status_name(status: int) -> str:
    try:
        return Status(status).name
    except ValueError:
        return f"0x{status:02x}"


class Remote:
    """``async with Remote(host, port, timeout) as r: await r.stats("vbucket")``."""

    def __init__(
        self, host: str, port: int, timeout: float, security: Security | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.security = security
        self._stream: trio.abc.Stream | None = None
        self._proto = ClientSession()

    @classmethod
    def of(cls, args: argparse.Namespace, host: str = "", port: int = 0) -> Remote:
        """A ``Remote`` to ``--host``/``--port`` (or ``host``/``port``: another node, same
        credentials and TLS settings) with the command's ``--timeout``."""
        return cls(
            host or args.host,
            port or args.port,
            args.timeout,
            getattr(args, "security", None),
        )

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    async def __aenter__(self) -> Remote:
        from ..consumer.errors import TlsError, UsageError
        from ..consumer.security import check_plain

        connect = functools.partial(trio.open_tcp_stream, self.host, self.port)
        sec = self.security
        if sec is not None:
            try:
                check_plain(self.host, sec.credentials, sec.tls)
            except UsageError as exc:
                raise CtlError(str(exc), code=2) from None
            # each node's certificate is checked against that node's name, not --host's
            sec = dataclasses.replace(sec, server_hostname=self.host)
        try:
            with trio.fail_after(self.timeout):
                if sec is not None and sec.tls is not None:
                    self._stream = await sec.connect(connect)
                else:
                    self._stream = await connect()
        except trio.TooSlowError:
            raise CtlError(
                f"cannot connect to {self.where}: timed out after {self.timeout:g} s"
            ) from None
        except OSError as exc:
            raise CtlError(f"cannot connect to {self.where}: {os_error_text(exc)}") from None
        except TlsError as exc:
            raise CtlError(f"cannot connect to {self.where}: {exc}") from None
        except trio.BrokenResourceError as exc:
            raise CtlError(f"cannot connect to {self.where}: {exc.__cause__ or exc}") from None
        if sec is not None and sec.credentials is not None:
            await self._authenticate()
        return self

    async def _authenticate(self) -> None:
        from ..consumer.security import authenticate

        assert self.security is not None and self.security.credentials is not None
        try:
            await authenticate(self._ask, self.security.credentials)
        except StatusError as exc:
            raise CtlError(f"{self.where}: {exc}") from None

    async def _ask(self, build: Callable[[int], bytes]) -> tuple[int, bytes]:
        o = self._proto.expect(self._proto.next_opaque())
        (f,) = (await self._exchange([(o, build(o))], lambda f: True))[o]
        return f.status, bytes(f.value)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._stream is not None:
            await trio.aclose_forcefully(self._stream)
            self._stream = None

    # ------------------------------------------------------------------ plumbing

    async def _exchange(
        self, requests: list[tuple[int, bytes]], is_last: Any
    ) -> dict[int, list[Frame]]:
        """Send ``requests`` (built by the session) in one write; collect answers per
        opaque until ``is_last``."""
        assert self._stream is not None
        want = {o for o, _ in requests}
        got: dict[int, list[Frame]] = {o: [] for o in want}
        try:
            with trio.fail_after(self.timeout):
                await self._stream.send_all(b"".join(data for _, data in requests))
                while want:
                    data = await self._stream.receive_some(1 << 16)
                    if not data:
                        raise CtlError(f"{self.where} closed the connection")
                    for e in self._proto.receive_data(data):
                        if type(e) is Answer and e.opaque in want:
                            got[e.opaque].append(e.result)
                            if is_last(e.result):
                                want.discard(e.opaque)
        except trio.TooSlowError:
            raise CtlError(f"{self.where} did not answer within {self.timeout:g} s") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise CtlError(f"connection to {self.where} failed: {exc}") from None
        except RemoteProtocolError as exc:
            raise CtlError(
                f"{self.where} does not speak the memcached binary protocol: {exc}"
            ) from None
        return got

    def _check(self, f: Frame, what: str) -> None:
        if f.status != Status.SUCCESS:
            hint = ""
            if f.status == Status.EACCESS and (
                self.security is None or self.security.credentials is None
            ):
                hint = "; the server requires authentication: --user (or DCP_USERNAME)"
            raise CtlError(
                f"{what}: {error_context(bytes(f.value)) or status_name(f.status)}"
                f" ({status_name(f.status)}){hint}"
            )

    # ------------------------------------------------------------------ requests

    async def stats(self, *groups: str, optional: tuple[str, ...] = ()) -> list[Any]:
        """The pairs of each STAT group, pipelined; raises on the first refused group,
        except that a refused group named in ``optional`` gives ``None``."""
        reqs = [self._proto.request(Opcode.STAT, stat=True, key=g.encode()) for g in groups]
        got = await self._exchange(reqs, lambda f: not f.key or f.status != Status.SUCCESS)
        out: list[Any] = []
        for (o, _), g in zip(reqs, groups, strict=True):
            pairs: list[tuple[str, str]] | None = []
            for f in got[o]:
                if g in optional and f.status != Status.SUCCESS:
                    pairs = None
                    break
                self._check(f, f"STAT {g!r}" if g else "STAT")
                if f.key:
                    assert pairs is not None
                    pairs.append(
                        (
                            bytes(f.key).decode("utf-8", "replace"),
                            bytes(f.value).decode("utf-8", "replace"),
                        )
                    )
            out.append(pairs)
        return out

    async def stat(self, group: str) -> dict[str, str]:
        (pairs,) = await self.stats(group)
        return dict(pairs)

    async def num_vbuckets(self) -> int:
        """The server's vbucket count (STAT "" ep_num_vbuckets)."""
        general = await self.stat("")
        try:
            return int(general["ep_num_vbuckets"])
        except (KeyError, ValueError):
            raise CtlError(f"{self.where} did not report ep_num_vbuckets") from None

    async def cluster_config(self) -> tuple[int, bytes]:
        """GET_CLUSTER_CONFIG: ``(status, value)``, not raised: an older server answers
        UNKNOWN_COMMAND and a cluster node without a map ETMPFAIL, and the caller
        (``topology.py``) decides what each means."""
        o, req = self._proto.request(Opcode.GET_CLUSTER_CONFIG)
        got = await self._exchange([(o, req)], lambda f: True)
        (f,) = got[o]
        return f.status, bytes(f.value)

    async def all_vb_seqnos(self, state: VBucketState | None = None) -> dict[int, int]:
        """High seqno of every vbucket that is not dead (GET_ALL_VB_SEQNOS); with
        ``state``, of the vbuckets in that state only (4-byte extras)."""
        extras = b"" if state is None else int(state).to_bytes(4, "big")
        o, req = self._proto.request(Opcode.GET_ALL_VB_SEQNOS, extras=extras)
        got = await self._exchange([(o, req)], lambda f: True)
        (f,) = got[o]
        self._check(f, "GET_ALL_VB_SEQNOS")
        try:
            return dict(codec.parse_all_vb_seqnos(bytes(f.value)))
        except RemoteProtocolError as exc:
            raise CtlError(f"GET_ALL_VB_SEQNOS: {exc}") from None

    async def set_vbucket_states(
        self, vbuckets: list[int], state: VBucketState, options: dict[str, Any] | None = None
    ) -> dict[int, tuple[int, str]]:
        """SET_VBUCKET_STATE for each vbucket, pipelined in one write: ``{vb: (status,
        error context or "")}``. Statuses are returned, not raised: a range reports every
        vbucket's result."""
        reqs = []
        for vb in vbuckets:
            o = self._proto.expect(self._proto.next_opaque())
            reqs.append((o, codec.set_vbucket_state(vb, int(state), opaque=o, options=options)))
        got = await self._exchange(reqs, lambda f: True)
        out = {}
        for vb, (o, _) in zip(vbuckets, reqs, strict=True):
            (f,) = got[o]
            ctx = error_context(bytes(f.value)) if f.status != Status.SUCCESS else ""
            out[vb] = (f.status, ctx)
        return out

    async def get_vbucket(self, vb: int) -> VBucketState:
        """The state of ``vb`` (GET_VBUCKET: a big-endian u32 value)."""
        o, req = self._proto.request(Opcode.GET_VBUCKET, vbucket=vb)
        got = await self._exchange([(o, req)], lambda f: True)
        (f,) = got[o]
        self._check(f, f"GET_VBUCKET {vb}")
        value = bytes(f.value)
        code = int.from_bytes(value, "big") if len(value) == 4 else 0
        if code not in {int(v) for v in VBucketState}:
            raise CtlError(
                f"{self.where} answered GET_VBUCKET {vb} with {value.hex() or 'nothing'}, "
                "not a vbucket state"
            )
        return VBucketState(code)
