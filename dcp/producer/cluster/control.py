"""NodeControl: how the orchestrator asks a node about its vbuckets and tells it what
to be (GET_ALL_VB_SEQNOS, GET_VBUCKET, SET_VBUCKET_STATE, DCP_GET_FAILOVER_LOG on the node's
KV port).

Rules of this module:
- ``NodeControl`` is the whole interface the orchestrator uses to reach nodes
  (cluster/orchestrator.py); tests give it a fake that models node states and seqnos.
  Every failure to reach a node or to get a usable answer from it is
  ``ControlUnavailable`` naming the address: the orchestrator treats the node as not
  answering (it decides again later), never as a crash.
- ``LinkControl`` is the real one. It connects with replication/link.py's ``Link`` (TCP
  or TLS through ``open_stream``, then HELLO and SASL as the node's internal user: the
  same keyword arguments as ``DcpServer._replication_options()``), keeps at most one
  connection per node and reuses it; a call on a cached connection that turns out dead
  is tried once more on a fresh one. Calls to one node are serialized (one connection
  carries one exchange at a time); the requests of one call go in one write.
- Every call, connecting included, is bounded by ``timeout``: a node that hangs costs
  the orchestrator that long, never more.
"""

from __future__ import annotations

import logging
import struct
from typing import Any, Protocol

import trio

from ...protocol import codec
from ...protocol.errors import ProtocolError
from ...protocol.frames import Frame
from ...protocol.layout import U32
from ...protocol.opcodes import Opcode, Status, VBucketState
from ...protocol.session import ClientSession
from ..replication.link import Link, LinkLost, OpenStream, SourceAuth

__all__ = ["ControlUnavailable", "LinkControl", "NodeControl"]

log = logging.getLogger("dcp.cluster")


class ControlUnavailable(Exception):
    """The node at ``address`` could not be reached or did not answer usably."""

    def __init__(self, address: str, why: str = "") -> None:
        super().__init__(f"node {address}: {why}" if why else f"node {address} unavailable")
        self.address = address


class NodeControl(Protocol):
    async def seqnos(self, address: str, state: VBucketState) -> dict[int, int]:
        """The high seqno of every vbucket in ``state`` on the node."""
        ...

    async def states(self, address: str, vbs: list[int]) -> dict[int, VBucketState]:
        """The state of each of ``vbs`` on the node (a vbucket it refuses is left out)."""
        ...

    async def failover_logs(self, address: str, vbs: list[int]) -> dict[int, list[tuple[int, int]]]:
        """The failover log (newest first) of each of ``vbs`` on the node (a vbucket it
        refuses is left out): which branch of history its seqnos are on."""
        ...

    async def set_states(
        self,
        address: str,
        vbs: list[int],
        state: VBucketState,
        options: dict[str, Any] | None = None,
    ) -> dict[int, int]:
        """SET_VBUCKET_STATE each of ``vbs``; the answer status of each."""
        ...


class LinkControl:
    """``NodeControl`` over the nodes' KV ports (see the module rules)."""

    def __init__(
        self,
        *,
        auth: SourceAuth | None = None,
        open_stream: OpenStream | None = None,
        timeout: float = 5.0,
        name: str = "dcp-orchestrator",
    ) -> None:
        self.auth = auth
        self.open_stream: OpenStream = open_stream or trio.open_tcp_stream
        self.timeout = timeout
        self.name = name
        self._links: dict[str, Link] = {}
        self._locks: dict[str, trio.Lock] = {}

    async def _connect(self, address: str) -> Link:
        link = await Link.connect(self.open_stream, address, ClientSession(), self.timeout)
        try:
            await link.login(self.name, self.auth)
        except BaseException:
            await link.aclose()
            raise
        return link

    async def _exchange(self, address: str, frames: list[bytes]) -> list[Frame]:
        """Send ``frames`` (opaque 0: each gets a fresh one) and return their answers."""
        lock = self._locks.setdefault(address, trio.Lock())
        try:
            with trio.fail_after(self.timeout):
                async with lock:
                    for attempt in (1, 2):
                        link = self._links.pop(address, None)
                        cached = link is not None
                        if link is None:
                            link = await self._connect(address)
                        try:
                            reqs = []
                            for data in frames:
                                o = link.session.expect(link.session.next_opaque())
                                patched = bytearray(data)
                                U32.pack_into(patched, 12, o)
                                reqs.append((o, bytes(patched)))
                            answers = await link.call(reqs)
                        except BaseException:
                            await link.aclose()
                            if cached and attempt == 1:
                                continue  # the cached connection died: one fresh try
                            raise
                        self._links[address] = link
                        return answers
        except trio.TooSlowError as exc:
            raise ControlUnavailable(address, f"no answer within {self.timeout:g} s") from exc
        except (LinkLost, ProtocolError, OSError) as exc:
            raise ControlUnavailable(address, str(exc)) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def seqnos(self, address: str, state: VBucketState) -> dict[int, int]:
        frame = codec.request(Opcode.GET_ALL_VB_SEQNOS, extras=U32.pack(int(state)))
        (answer,) = await self._exchange(address, [frame])
        if answer.status != Status.SUCCESS:
            raise ControlUnavailable(address, f"GET_ALL_VB_SEQNOS status 0x{answer.status:02x}")
        try:
            return dict(codec.parse_all_vb_seqnos(bytes(answer.value)))
        except ProtocolError as exc:
            raise ControlUnavailable(address, str(exc)) from exc

    async def failover_logs(self, address: str, vbs: list[int]) -> dict[int, list[tuple[int, int]]]:
        frames = [codec.request(Opcode.DCP_GET_FAILOVER_LOG, vbucket=vb) for vb in vbs]
        out: dict[int, list[tuple[int, int]]] = {}
        for vb, answer in zip(
            vbs, await self._exchange(address, frames) if vbs else [], strict=True
        ):
            if answer.status == Status.SUCCESS:
                try:
                    out[vb] = codec.parse_failover_log(bytes(answer.value))
                except ProtocolError as exc:
                    raise ControlUnavailable(address, f"failover log of vb {vb}: {exc}") from exc
        return out

    async def states(self, address: str, vbs: list[int]) -> dict[int, VBucketState]:
        if not vbs:
            return {}
        frames = [codec.request(Opcode.GET_VBUCKET, vbucket=vb) for vb in vbs]
        out: dict[int, VBucketState] = {}
        for vb, answer in zip(vbs, await self._exchange(address, frames), strict=True):
            if answer.status != Status.SUCCESS:
                continue
            value = bytes(answer.value)
            try:
                out[vb] = VBucketState(U32.unpack(value)[0])
            except (ValueError, struct.error) as exc:
                raise ControlUnavailable(address, f"GET_VBUCKET vb {vb}: {value.hex()}") from exc
        return out

    async def set_states(
        self,
        address: str,
        vbs: list[int],
        state: VBucketState,
        options: dict[str, Any] | None = None,
    ) -> dict[int, int]:
        if not vbs:
            return {}
        frames = [codec.set_vbucket_state(vb, int(state), options=options) for vb in vbs]
        answers = await self._exchange(address, frames)
        statuses = {vb: int(a.status) for vb, a in zip(vbs, answers, strict=True)}
        refused = {vb: s for vb, s in statuses.items() if s != Status.SUCCESS}
        if refused:
            log.warning(
                "node %s refused %s for %d vbuckets (first: %s)",
                address,
                state.name.lower(),
                len(refused),
                next(iter(refused.items())),
            )
        return statuses

    async def aclose(self) -> None:
        """Close the cached connections."""
        links, self._links = list(self._links.values()), {}
        for link in links:
            await link.aclose()
