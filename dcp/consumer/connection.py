"""One DCP connection: handshake, stream requests, writes. (Reading: ``reader.py``.)

Rules of this module:
- The wire protocol is the connection's ``ClientSession`` (``dcp.protocol.session``):
  it builds requests, allocates opaques and decodes; this module does the I/O and the
  SDK's choices. Streams are matched by opaque; one stream per vbucket per connection.
  Every stream request gets a new opaque, so late messages of an abandoned stream are
  ignored (their bytes still count for flow control).
- Bootstrap (HELLO, DCP_OPEN, DCP_CONTROLs) and the KV requests a client plans with are
  ``requests.py``'s (a mixin); responses are matched by opaque by the reader task.
- Stream requests are sent by one opener task from a due-time heap (immediate opens,
  reopens after a stream end, retries with backoff), many per write; a vbucket whose
  start equals its end seqno 0 is done without a request.
- Writes (stream requests, noop replies, buffer acks, from several tasks) go through
  one lock; each wake-up writes one buffer (one ``send_all``).
- All failures end up in ``self.error`` (first one wins) and cancel the connection's
  nursery; the client's supervisor decides between reconnecting and failing.
- In a cluster (``cluster.py``) a connection streams only the vbuckets it was given
  (``owned``; ``add_vbucket``/``drop_vbucket`` as the map moves them) and hands a vbucket
  whose node no longer serves it to ``on_move`` instead of asking this node again. The
  positions (``Session``) are shared by every connection of the client.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Awaitable, Callable, Iterable

import trio

from dcp.protocol import codec
from dcp.protocol.frames import Frame
from dcp.protocol.opcodes import SEQNO_MAX
from dcp.protocol.session import ClientSession

from .batches import CommitFn
from .config import ConnectionConfig
from .delivery import Delivery
from .errors import ConnectionLostError, DeadConnectionError
from .positions import Session
from .reader import StreamReader
from .requests import Requests
from .security import closed_message, tls_failure
from .snapshot_buffer import StreamBuffer

__all__ = ["ConnectionConfig", "DcpConnection"]


class _Rpc:
    __slots__ = ("error", "event", "frame")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.frame: Frame | None = None
        self.error: BaseException | None = None


class DcpConnection(Requests):
    """A connected, (soon) handshaken DCP producer connection and its streams."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        cfg: ConnectionConfig,
        delivery: Delivery,
        commit_fn: CommitFn,
        retries: dict[int, tuple[float, int]],
        stats: dict[str, int],
    ) -> None:
        self.cfg = cfg
        self.session: Session | None = None
        self.delivery = delivery
        self._stream = stream
        self.commit_fn = commit_fn  #: what ``commit()`` of the items built here calls
        #: vb -> (first failure time, attempts) of refused stream requests; the client's,
        #: shared by its connections (the reader updates it)
        self.retries = retries
        self.stats = stats
        self.proto = ClientSession(
            window=cfg.buffer_size,
            ack_ratio=cfg.ack_ratio,
            max_body_size=cfg.max_body_size,
            queue_per_chunk=cfg.raw,
        )
        self.fc = self.proto.flow
        self.reader = StreamReader(self)
        #: seconds of read silence before a NOOP probe (None: no dead-connection detection)
        self.probe_after: float | None = None
        self.error: BaseException | None = None
        self.finished = trio.Event()
        self.made_progress = False
        self._nursery: trio.Nursery | None = None
        self._send_lock = trio.StrictFIFOLock()
        self._rpcs: dict[int, _Rpc] = {}
        self._streams: dict[int, StreamBuffer] = {}  # by opaque
        self._by_vb: dict[int, StreamBuffer] = {}
        self._open_heap: list[tuple[float, int]] = []
        self._opener_wake = trio.Event()
        #: DCP_CLOSE_STREAMs the opener writes before its next stream requests
        self._closes = bytearray()
        self._received = False  # anything read yet (``closed_message``)
        #: the vbuckets this connection streams (None: every vbucket of the session)
        self.owned: set[int] | None = None
        #: cluster mode: ``(vb, delay, config)`` - the node does not serve ``vb`` (any more);
        #: the client re-routes it after ``delay`` s (``config``: the answer's value, b"" if
        #: none). None: ask this node again (single node).
        self.on_move: Callable[[int, float, bytes], None] | None = None

    # ------------------------------------------------------------------ plumbing

    def next_opaque(self) -> int:
        return self.proto.next_opaque()

    async def send(self, data: bytes | bytearray) -> None:
        try:
            async with self._send_lock:
                await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise ConnectionLostError(f"send failed: {exc!r}") from exc

    async def send_ack(self, nbytes: int) -> None:
        """Best effort: a lost connection is noticed (and handled) by the reader."""
        if self.error is not None or nbytes <= 0:
            return
        try:
            await self.send(self.proto.ack(nbytes))
            self.stats["buffer_acks"] += 1
        except ConnectionLostError:
            pass

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        for rpc in self._rpcs.values():
            rpc.error = exc
            rpc.event.set()
        self._rpcs.clear()
        self.fc.closed = True
        self.finished.set()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def guarded(self, fn: Callable[[], Awaitable[None]]) -> None:
        try:
            await fn()
        except Exception as exc:
            self.fail(exc)

    async def run(self, nursery: trio.Nursery) -> None:
        """Start the reader; the caller then handshakes and calls ``start_streams``."""
        self._nursery = nursery
        nursery.start_soon(self.guarded, self.reader.read_loop)

    async def call(self, requests: list[tuple[int, bytes]]) -> list[Frame]:
        """Send pipelined requests in one write and wait for every response (by opaque)."""
        waiters = []
        for opaque, _ in requests:
            w = _Rpc()
            self._rpcs[opaque] = w
            self.proto.expect(opaque)
            waiters.append(w)
        try:
            await self.send(b"".join(data for _, data in requests))
            out = []
            for w in waiters:
                await w.event.wait()
                if w.error is not None:
                    raise w.error
                assert w.frame is not None
                out.append(w.frame)
            return out
        finally:  # cancelled (a timeout) or failed: a late answer finds nothing
            for opaque, _ in requests:
                self._rpcs.pop(opaque, None)

    @property
    def pending_requests(self) -> int:
        """Requests of ``call`` still waiting for their answer (a frozen node's pile up)."""
        return len(self._rpcs)

    async def receive(self, size: int) -> bytes | bytearray:
        """The next bytes from the server (up to ``size``).

        Raises:
            DeadConnectionError: nothing arrived for two noop intervals: after the first,
                a plain NOOP probes the server (its noop timer may not run yet).
            ConnectionLostError: the server closed the connection.
        """
        try:
            data = await self._receive(size)
            self._received = True
            return data
        except trio.BrokenResourceError as exc:
            # e.g. a TLS 1.3 server refusing our certificate says so after the handshake
            failure = tls_failure(exc)
            if failure is None:
                raise
            raise failure from exc.__cause__

    async def _receive(self, size: int) -> bytes | bytearray:
        receive = self._stream.receive_some
        probe_after = self.probe_after
        if probe_after is None:
            data = await receive(size)
        else:
            data = None
            with trio.move_on_after(probe_after):
                data = await receive(size)
            if data is None:
                await self.send(self.proto.probe())
                self.stats["probes"] += 1
                with trio.move_on_after(probe_after):
                    data = await receive(size)
                if data is None:
                    raise DeadConnectionError(
                        f"nothing received for {2 * probe_after:g}s (2 x noop interval)"
                    )
        if not data:
            raise ConnectionLostError(closed_message(self._stream, self._received))
        return data

    def answered(self, opaque: int, frame: Frame) -> None:
        """The response to a request of ``call`` arrived (others are ignored)."""
        rpc = self._rpcs.pop(opaque, None)
        if rpc is not None:
            rpc.frame = frame
            rpc.event.set()

    async def aclose(self) -> None:
        self.fc.closed = True
        await trio.aclose_forcefully(self._stream)

    # ------------------------------------------------------------------ streams

    def start_streams(self, session: Session, vbuckets: Iterable[int] | None = None) -> None:
        """Stream ``vbuckets`` (default: every vbucket of ``session``)."""
        self.session = session
        if vbuckets is not None:
            self.owned = set(vbuckets)
        for vb in session.positions if self.owned is None else sorted(self.owned):
            heapq.heappush(self._open_heap, (0.0, vb))
        assert self._nursery is not None
        self._nursery.start_soon(self.guarded, self._opener_loop)
        self.check_all_done()

    def stream_for(self, opaque: int) -> StreamBuffer | None:
        """The stream requested with ``opaque``, if it is still open on this connection."""
        return self._streams.get(opaque)

    def forget_stream(self, opaque: int) -> StreamBuffer | None:
        """The stream of ``opaque`` ended or was refused: drop it (its vbucket may be
        requested again)."""
        st = self._streams.pop(opaque, None)
        if st is not None:
            self._by_vb.pop(st.vbucket, None)
        return st

    def add_vbucket(self, vb: int) -> None:
        """Cluster: the map now routes ``vb`` here; request it (after ``start_streams``)."""
        assert self.owned is not None, "only a connection given its vbuckets takes more"
        self.owned.add(vb)
        self.schedule_open(vb, 0)

    def drop_vbucket(self, vb: int) -> None:
        """Cluster: ``vb`` streams elsewhere now. Its stream here is forgotten at once (late
        messages only count for flow control) and closed on the server, best effort."""
        if self.owned is not None:
            self.owned.discard(vb)
        st = self._by_vb.pop(vb, None)
        if st is None:
            return
        self._streams.pop(st.opaque, None)
        self.proto.forget(st.opaque)
        if self._nursery is not None and self.error is None:
            _, data = self.proto.close_stream(vb)
            self._nursery.start_soon(self._send_quietly, data)

    def restart_stream(self, vb: int) -> None:
        """Close ``vb``'s open stream and request it again (its end seqno was lowered).
        The close is written by the opener just before the new request, in the same
        write: the server never sees a second stream of the vbucket while one is open."""
        st = self._by_vb.pop(vb, None)
        if st is None:
            return
        self._streams.pop(st.opaque, None)
        self.proto.forget(st.opaque)
        _, data = self.proto.close_stream(vb)
        self._closes += data
        self.schedule_open(vb, 0)

    async def _send_quietly(self, data: bytes) -> None:
        try:
            await self.send(data)
        except ConnectionLostError:
            pass  # the reader notices a lost connection

    def moved(self, vb: int, delay: float, config: bytes = b"") -> bool:
        """The node does not serve ``vb`` here (any more): hand it to ``on_move`` (True),
        or False when this connection is not part of a cluster (retry it here)."""
        if self.on_move is None:
            return False
        if self.owned is not None:
            self.owned.discard(vb)
        self.on_move(vb, delay, config)
        return True

    def schedule_open(self, vb: int, delay: float) -> None:
        heapq.heappush(self._open_heap, (trio.current_time() + delay, vb))
        self._opener_wake.set()

    def check_all_done(self) -> None:
        """End the connection's work when every vbucket reached its end (``to_latest``)."""
        if self.session is not None and self.session.all_done():
            self.finished.set()

    async def _opener_loop(self) -> None:
        heap = self._open_heap
        while True:
            now = trio.current_time()
            buf, self._closes = self._closes, bytearray()
            gens: dict[int, int] = {}
            while heap and heap[0][0] <= now and len(buf) < 256 * 1024:
                _, vb = heapq.heappop(heap)
                buf += self._stream_request(vb, gens)
            if buf:
                self.delivery.purge(gens)  # superseded batches would only be duplicates
                await self.send(buf)
                continue
            self.check_all_done()
            self._opener_wake = trio.Event()
            timeout = heap[0][0] - now if heap else math.inf
            with trio.move_on_after(timeout):
                await self._opener_wake.wait()

    def _stream_request(self, vb: int, gens: dict[int, int]) -> bytes:
        session = self.session
        assert session is not None
        if vb in self._by_vb or (self.owned is not None and vb not in self.owned):
            return b""
        p = session[vb]
        if p.done:
            return b""
        start, end, uuid, ss, se = session.request_fields(vb)
        if end != SEQNO_MAX:
            if start == end == 0:
                p.done = True
                return b""
            if start > end:
                end = start  # ask anyway: the server must tell us if our history diverged
        epoch, gen = session.next_generation(vb)
        gens[vb] = gen
        purge = session.purge_seqno(vb)
        value = codec.json_value({"purge_seqno": str(purge)}) if purge else b""
        opaque, data = self.proto.stream_request(
            vb,
            flags=self.cfg.stream_flags,
            start=start,
            end=end,
            vb_uuid=uuid,
            snap_start=ss,
            snap_end=se,
            value=value,
        )
        st = StreamBuffer(vb, opaque, epoch, gen, end, uuid, start)
        self._streams[opaque] = st
        self._by_vb[vb] = st
        self.stats["stream_requests"] += 1
        return data
