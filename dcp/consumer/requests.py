"""The requests a ``DcpConnection`` makes besides streaming: the handshake (HELLO, SASL,
DCP_OPEN, DCP_CONTROLs) and the KV requests a client plans with (GET_ALL_VB_SEQNOS,
GET_CLUSTER_CONFIG, DCP_GET_FAILOVER_LOG).

Rules of this module:
- ``Requests`` is a mixin of ``DcpConnection`` (``connection.py``): it uses the
  connection's ``call`` (pipelined requests matched by opaque) and sets its
  ``probe_after`` and flow control from what the server accepted; no I/O of its own.
- Bootstrap is pipelined in one write; with credentials HELLO goes alone, then SASL, then
  the rest (a server with authentication on refuses DCP_OPEN before). ``dcp=False``: HELLO
  (and SASL) only, a connection for KV requests that never replaces a DCP connection of
  the client's name. A refused control degrades gracefully, except ``stable_only``:
  a consumer that asked for stable-only streams must never be handed a normal one, so
  its refusal is an error naming the option and the server's reason.
- A retriable refusal (ETMPFAIL...) is raised as ``ConnectionLostError`` (transient); a
  server that does not know GET_CLUSTER_CONFIG is a single node (None).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dcp.protocol import codec
from dcp.protocol.errors import for_status
from dcp.protocol.frames import Frame
from dcp.protocol.opcodes import DcpOpenFlag, HelloFeature, Opcode, Status

from .errors import ConnectionLostError
from .offset import FailoverLog
from .security import authenticate, server_reason

if TYPE_CHECKING:
    from dcp.protocol.flow_control import FlowControl

    from .config import ConnectionConfig

__all__ = ["HELLO_FEATURES", "Requests"]

HELLO_FEATURES = [HelloFeature.XERROR, HelloFeature.JSON, HelloFeature.MUTATION_SEQNO]


class Requests:
    """Handshake and KV requests of a ``DcpConnection`` (see the module rules)."""

    cfg: ConnectionConfig
    fc: FlowControl
    probe_after: float | None

    def next_opaque(self) -> int:
        raise NotImplementedError

    async def call(self, requests: list[tuple[int, bytes]]) -> list[Frame]:
        raise NotImplementedError

    async def handshake(self, dcp: bool = True) -> None:
        """HELLO (and SASL), then with ``dcp`` DCP_OPEN and the controls; without, the
        connection is for KV requests only (GET_CLUSTER_CONFIG, GET_ALL_VB_SEQNOS)."""
        cfg = self.cfg
        flags = DcpOpenFlag.PRODUCER
        if cfg.include_delete_times or cfg.include_expirations:
            flags |= DcpOpenFlag.INCLUDE_DELETE_TIMES
        controls: list[tuple[str, str]] = []
        if cfg.noop_interval:
            controls += [("enable_noop", "true"), ("set_noop_interval", f"{cfg.noop_interval:g}")]
        if cfg.buffer_size:
            controls.append(("connection_buffer_size", str(cfg.buffer_size)))
        controls += [
            ("supports_cursor_dropping", "true"),
            ("send_stream_end_on_client_close_stream", "true"),
            # this server's extension (protocol_spec/README.md, DCP_CONTROL): a
            # disk snapshot whose last item was purged still completes at once
            ("send_seqno_advanced", "true"),
        ]
        if cfg.include_expirations:
            controls.append(("enable_expiry_opcode", "true"))
        if cfg.stable_only:
            controls.append(("stable_only", "true"))
        o = self.next_opaque()
        reqs = [(o, codec.hello(cfg.agent, [int(f) for f in HELLO_FEATURES], opaque=o))]
        frames: list[Frame] = []
        if cfg.credentials is not None or not dcp:
            frames = await self.call(reqs)
            reqs = []
            if cfg.credentials is not None:
                await authenticate(self._ask, cfg.credentials)
        if not dcp:
            _check_answer("HELLO", frames[0], cfg.credentials is not None)
            return
        o = self.next_opaque()
        reqs.append((o, codec.dcp_open(cfg.name, int(flags), opaque=o)))
        for key, value in controls:
            o = self.next_opaque()
            reqs.append((o, codec.dcp_control(key, value, opaque=o)))
        frames += await self.call(reqs)
        for what, f in zip(("HELLO", "DCP_OPEN"), frames[:2], strict=True):
            _check_answer(what, f, cfg.credentials is not None)
        ok = {k: f.status == Status.SUCCESS for (k, _), f in zip(controls, frames[2:], strict=True)}
        if cfg.noop_interval and ok["enable_noop"] and ok["set_noop_interval"]:
            self.probe_after = cfg.noop_interval
        if cfg.buffer_size and not ok["connection_buffer_size"]:
            self.fc.enabled = False
        if cfg.stable_only and not ok["stable_only"]:
            _stable_only_refused(frames[2 + [k for k, _ in controls].index("stable_only")])

    async def _ask(self, build: Callable[[int], bytes]) -> tuple[int, bytes]:
        """One request of the SASL exchange and its answer (``security.Ask``)."""
        o = self.next_opaque()
        (f,) = await self.call([(o, build(o))])
        return f.status, bytes(f.value)

    async def get_all_vb_seqnos(self, state: int | None = None) -> list[tuple[int, int]]:
        """(vb, high seqno) of every vbucket that is not dead, or only of those in
        ``state`` (1 active, 2 replica: the request's optional extras)."""
        o = self.next_opaque()
        extras = codec.U32.pack(state) if state else b""
        req = codec.request(Opcode.GET_ALL_VB_SEQNOS, opaque=o, extras=extras)
        (f,) = await self.call([(o, req)])
        if f.status != Status.SUCCESS:
            raise for_status(f.status, bytes(f.value), "GET_ALL_VB_SEQNOS refused")
        return codec.parse_all_vb_seqnos(bytes(f.value))

    async def get_cluster_config(self) -> bytes | None:
        """The node's bucket config JSON; None when the server does not know the command
        (an older or a test server: a single node). A cluster node without a map yet
        answers ETMPFAIL: raised as ``ConnectionLostError`` (transient: ask again)."""
        o = self.next_opaque()
        (f,) = await self.call([(o, codec.request(Opcode.GET_CLUSTER_CONFIG, opaque=o))])
        if f.status == Status.UNKNOWN_COMMAND:
            return None
        if f.status != Status.SUCCESS:
            err = for_status(f.status, bytes(f.value), "GET_CLUSTER_CONFIG refused")
            if err.retriable:
                raise ConnectionLostError(f"GET_CLUSTER_CONFIG: {err}") from err
            raise err
        return bytes(f.value)

    async def get_failover_logs(self, vbuckets: list[int]) -> dict[int, FailoverLog]:
        reqs = []
        for vb in vbuckets:
            o = self.next_opaque()
            reqs.append((o, codec.request(Opcode.DCP_GET_FAILOVER_LOG, vbucket=vb, opaque=o)))
        frames = await self.call(reqs)
        out: dict[int, FailoverLog] = {}
        for vb, f in zip(vbuckets, frames, strict=True):
            if f.status != Status.SUCCESS:
                raise for_status(f.status, bytes(f.value), f"GET_FAILOVER_LOG vb {vb} refused")
            out[vb] = tuple(codec.parse_failover_log(bytes(f.value)))
        return out


def _stable_only_refused(f: Frame) -> None:
    """Raise for a refused ``stable_only`` control (a retriable status as transient)."""
    value = bytes(f.value)
    reason = server_reason(value) or "no reason given"
    err = for_status(
        f.status,
        value,
        f"stable_only=True: the server refused DCP_CONTROL stable_only=true ({reason}); "
        "it cannot send stable-only streams",
    )
    if err.retriable:
        raise ConnectionLostError(str(err)) from err
    raise err


def _check_answer(what: str, f: Frame, authenticated: bool) -> None:
    """A handshake answer: SUCCESS, else the error (a retriable one as transient)."""
    if f.status == Status.SUCCESS:
        return
    hint = ""
    if f.status == Status.EACCESS and not authenticated:
        hint = " (the server requires authentication: username= and password=)"
    err = for_status(f.status, bytes(f.value), f"{what} refused{hint}")
    if err.retriable:
        raise ConnectionLostError(f"{what}: {err}") from err
    raise err
