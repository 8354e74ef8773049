"""DurabilityMonitor: what a majority of each vbucket's copies hold, for durable writes
and stable-only streams.

Rules of this module:
- One monitor per server (``DcpServer.durability``, wired by sync_waiters.py), built
  once the bucket is open. It is synchronous and knows no sockets, no clock and no
  trio: this node's seqnos and states reach it as callables, replicas' as
  ``acknowledge`` calls (DCP_SEQNO_ACKNOWLEDGED, seqno_ack.py), the cluster map as
  ``set_topology`` (cluster/agent.py), this node's flushes as ``flushed`` (a
  ``Persistence`` flush listener) and state changes as ``state_changed``
  (vbucket_states.py).
- How chains vote (named copies only, a forward chain counted beside the current one,
  ``k = len(chain) // 2 + 1``) is durability_chains.py. Before any map, and on a single
  node, a vbucket's chain is ``(node_name,)``.
- An ack is recorded from every node streaming the vbucket from this node while the
  vbucket is active here, whether the map names it yet or not; only the chains' named
  nodes count. A replica does not repeat an ack it already sent on a stream
  (replication/acks.py), so an ack dropped because the map did not name its node yet
  (a rebalance adding a copy: its node acks before this node reads the forward map)
  would leave an idle vbucket's majority at 0 after the flip. The ack of a node the map
  drops stays recorded but counts for nothing. Acks on a vbucket not active here are
  ignored, and every state change drops the vbucket's acks: an ack speaks for one
  stream of one term.
- Each ack keeps the stream it came on (``source``): when a stream ends, only the acks
  it made are forgotten (``forget(vb, source=stream)``). The same node may stream a
  vbucket on a new connection before its old one is seen to close; forgetting by name
  would then drop the new stream's ack, which the replica does not send again.
- Nothing is trusted from a replica beyond what this node sent it: an ack above the
  stream's last sent seqno is clamped to it, a persisted seqno above the held one to the
  held one. The caller logs the reason returned. So the majority never passes this
  node's own high seqno.
- An ack counts only if it arrives while ``trusted()`` (the server: its cluster write
  gate, cluster/agent.py) says this node's lease is sure. Failover ranks the replicas
  by the seqnos it reads once the failed node's lease has expired (cluster/failover.py),
  and a node's lease is sure only until before it could expire: so every counted ack
  was sent by a replica before that read, and the replica promoted holds at least the
  majority seqno. An ack that arrives later (a node frozen by SIGSTOP, resumed after it
  was failed over and before it read the new map, still streams to replicas that have
  not read it either) says what a replica took AFTER the read: counting it would let a
  stable-only stream or a MAJORITY write pass what the promoted copy holds. Such acks
  are held back, not dropped: once trusted again (the lease was kept, or the node read
  a map after registering again that still makes it active) the next event here
  (``recheck``: the agent calls it after each reconcile; an ack, a flush, a topology or
  state change) counts them; a vbucket that stops being active here drops them.
- Only the acked vbucket is re-evaluated on an ack; a flush, a topology or state change
  re-evaluates the vbuckets that have something waiting. After any of them that may
  have moved a seqno, ``on_change(vbs)`` is called with the vbuckets concerned (None:
  any vbucket, after a flush; the server wakes the connections with durable writes
  waiting on them, which re-check ``satisfied``) and due ``wait_stable`` callbacks are
  called. Callbacks run on the caller's (trio) thread, never from inside
  ``wait_stable`` itself: one already due when registered is handed to ``call_soon``.
  A waiter that goes away first (a stream closed) takes its callback back
  (``cancel_wait``): nothing else would ever release it, nor what it holds.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from ..protocol.opcodes import DurabilityLevel, VBucketState
from .durability_chains import HELD, PERSISTED, Ack, Topology

__all__ = ["DurabilityMonitor"]

log = logging.getLogger("dcp.durability")

_NONE = int(DurabilityLevel.NONE)
_MAJORITY = int(DurabilityLevel.MAJORITY)
_MAJORITY_AND_PERSIST = int(DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE)
_PERSIST_TO_MAJORITY = int(DurabilityLevel.PERSIST_TO_MAJORITY)
_PERSIST_TO_ACTIVE = int(DurabilityLevel.PERSIST_TO_ACTIVE)
_MAJORITY_LEVELS = frozenset((_MAJORITY, _MAJORITY_AND_PERSIST, _PERSIST_TO_MAJORITY))

Wake = Callable[[], None]
Chains = Sequence[Sequence[str | None] | None]


class _VBucket(Protocol):
    """What ``of_vbuckets`` reads of an engine vbucket."""

    @property
    def high_seqno(self) -> int: ...

    @property
    def persisted_seqno(self) -> int: ...

    @property
    def state(self) -> VBucketState: ...


class DurabilityMonitor:
    """Majority, majority-persisted and stable seqnos per vbucket (see the module rules)."""

    def __init__(
        self,
        node_name: str,
        num_vbuckets: int,
        *,
        high_seqno: Callable[[int], int],
        persisted_seqno: Callable[[int], int],
        is_active: Callable[[int], bool],
    ) -> None:
        self.node_name = node_name
        self.num_vbuckets = num_vbuckets
        self._high = high_seqno
        self._persisted = persisted_seqno
        self._is_active = is_active
        self._single = Topology((node_name,), None, node_name)
        self._topo: list[Topology] = [self._single] * num_vbuckets
        #: per vb: {node: (held, persisted, source)} last acknowledged by that replica
        self._acks: list[dict[str, Ack]] = [{} for _ in range(num_vbuckets)]
        #: per vb: whether it was active at the last state change (a change drops acks)
        self._was_active = [is_active(vb) for vb in range(num_vbuckets)]
        self._terms = [0] * num_vbuckets
        #: per vb with waiters: a heap of (seqno, order, wake)
        self._waiters: dict[int, list[tuple[int, int, Wake]]] = {}
        self._order = 0
        #: called with the vbuckets whose seqnos may have moved (None: any, a flush);
        #: the server wakes the writers waiting on them
        self.on_change: Callable[[Sequence[int] | None], None] | None = None
        #: how a ``wait_stable`` already due when registered gets called later (the
        #: server: trio's ``run_sync_soon``); None: at the next re-evaluation
        self.call_soon: Callable[[Wake], None] | None = None
        #: whether acks may count now (module rules); None: always (a single node)
        self.trusted: Callable[[], bool] | None = None
        #: per vb: {node: (held, persisted, source)} acked while not trusted
        self._held_back: dict[int, dict[str, Ack]] = {}

    @classmethod
    def of_vbuckets(cls, node_name: str, vbuckets: Sequence[_VBucket]) -> DurabilityMonitor:
        """A monitor reading the engine's vbuckets (their seqnos and states) directly."""
        active = VBucketState.ACTIVE
        return cls(
            node_name,
            len(vbuckets),
            high_seqno=lambda vb: vbuckets[vb].high_seqno,
            persisted_seqno=lambda vb: vbuckets[vb].persisted_seqno,
            is_active=lambda vb: vbuckets[vb].state is active,
        )

    # ------------------------------------------------------------------ topology

    def set_topology(self, chains: Chains | None, forward: Chains | None = None) -> None:
        """Every vbucket's chain (active first, None for a missing copy), or None: a
        single node. ``forward``: per vbucket the chain a rebalance or failover is moving
        it to (None for one not moving), or None: no vbucket is moving. Acks are kept
        (module rules); what counts is re-evaluated.

        Raises:
            ValueError: not one chain per vbucket, an empty chain, or a forward list of
                another length.
        """
        n = self.num_vbuckets
        if chains is None:
            new = [self._single] * n
        else:
            if len(chains) != n:
                raise ValueError(f"{len(chains)} chains for {n} vbuckets")
            if forward is not None and len(forward) != n:
                raise ValueError(f"{len(forward)} forward chains for {n} vbuckets")
            new = []
            for vb, chain in enumerate(chains):
                fwd = forward[vb] if forward is not None else None
                t = tuple(chain or ())
                f = tuple(fwd) if fwd is not None else None
                if not t or f == ():
                    raise ValueError(f"vb {vb}: empty chain")
                old = self._topo[vb]
                new.append(old if old.same(t, f) else Topology(t, f, self.node_name))
        changed = [vb for vb in range(n) if new[vb] is not self._topo[vb]]
        self._topo = new
        if changed:
            self._changed(changed, wake_all=True)
        self._release()

    def chain(self, vb: int) -> tuple[str | None, ...]:
        """``vb``'s current chain."""
        return self._topo[vb].chain

    def forward_chain(self, vb: int) -> tuple[str | None, ...] | None:
        """The chain ``vb`` is moving to (None: it is not moving)."""
        return self._topo[vb].forward

    # ------------------------------------------------------------------ seqnos

    def majority_seqno(self, vb: int) -> int:
        """The k-th largest held seqno over the named copies of each chain, the least
        over the chains (0 when a chain names fewer than k copies or the vbucket is not
        active here)."""
        return self._majority(vb, HELD)

    def majority_persisted_seqno(self, vb: int) -> int:
        """The same over persisted seqnos."""
        return self._majority(vb, PERSISTED)

    def _majority(self, vb: int, which: int) -> int:
        if not self._is_active(vb):
            return 0
        own = self._high(vb) if which == HELD else self._persisted(vb)
        return self._topo[vb].majority(self.node_name, own, self._acks[vb], which)

    def stable_seqno(self, vb: int) -> int:
        """The highest seqno no single node failure can take back (durability_chains.py
        ``Chain.stable``, the least over the chains). 0 when not active here."""
        if not self._is_active(vb):
            return 0
        return self._topo[vb].stable(
            self.node_name, self._high(vb), self._persisted(vb), self._acks[vb]
        )

    def possible(self, vb: int, level: int) -> bool:
        """Whether every chain names enough copies for ``level`` (else
        DURABILITY_IMPOSSIBLE)."""
        if level in _MAJORITY_LEVELS:
            return self._topo[vb].possible()
        return True

    def satisfied(self, vb: int, seqno: int, level: int) -> bool:
        """Whether a write of ``vb`` at ``seqno`` now holds at ``level``."""
        if level == _PERSIST_TO_ACTIVE:
            return self._persisted(vb) >= seqno
        if level == _MAJORITY:
            return self._majority(vb, HELD) >= seqno
        if level == _MAJORITY_AND_PERSIST:
            return self._persisted(vb) >= seqno and self._majority(vb, HELD) >= seqno
        if level == _PERSIST_TO_MAJORITY:
            return self._persisted(vb) >= seqno and self._majority(vb, PERSISTED) >= seqno
        return level == _NONE

    # ------------------------------------------------------------------ acks

    def acknowledge(
        self,
        vb: int,
        node: str,
        seqno: int,
        persisted: int | None,
        *,
        sent: int,
        source: object = None,
    ) -> str:
        """Record that replica ``node`` holds ``seqno`` of ``vb`` and has persisted
        ``persisted`` (None: not said; the last persisted seqno it said is kept, within
        ``seqno``). ``sent``: the highest seqno this node sent on that replica's stream;
        ``source``: that stream (``forget`` drops only its acks). Returns "" or why the
        ack was clamped, held back or ignored (the caller logs it); an ack a race
        explains (the vbucket not active here, its node not in the map yet) is ignored
        or kept silently, logged at DEBUG."""
        if node == self.node_name:
            return f"{node!r} is this node itself: ignored"
        if not self._is_active(vb):
            log.debug("ack of vb %d from %r ignored: not active here", vb, node)
            return ""
        t = self._topo[vb]
        if node not in t.members:
            log.debug("ack of vb %d from %r, not in its chains %s", vb, node, t.chain)
        acks = self._acks[vb]
        reason = ""
        if seqno > sent:
            reason = f"seqno {seqno} above the {sent} sent to {node!r}: clamped"
            seqno = sent
        if persisted is None:
            prev = self._held_back.get(vb, {}).get(node) or acks.get(node)
            persisted = min(prev.persisted, seqno) if prev is not None else 0
        elif persisted > seqno:
            reason = reason or f"persisted {persisted} above held {seqno}: clamped"
            persisted = seqno
        if self.trusted is not None and not self.trusted():
            self._held_back.setdefault(vb, {})[node] = Ack(seqno, persisted, source)
            held = (
                "this node's lease may have lapsed (fenced, or no map yet): held back, "
                "not counted until it is sure"
            )
            return f"{reason}; {held}" if reason else held
        self._release()
        before = (self._majority(vb, HELD), self._majority(vb, PERSISTED))
        acks[node] = Ack(seqno, persisted, source)
        if (self._majority(vb, HELD), self._majority(vb, PERSISTED)) != before:
            self._changed((vb,), wake_all=False)
        return reason

    def forget(self, vb: int, node: str | None = None, *, source: object = None) -> None:
        """Drop acks of ``vb``: those made on stream ``source`` (it ended), else
        ``node``'s, else all of them. Nobody is woken: forgetting only lowers seqnos."""
        for acks in (self._acks[vb], self._held_back.get(vb)):
            if not acks:
                continue
            if source is not None:
                for name in [n for n, a in acks.items() if a.source is source]:
                    del acks[name]
            elif node is not None:
                acks.pop(node, None)
            else:
                acks.clear()

    def held_back(self, vb: int) -> dict[str, tuple[int, int]]:
        """The acks of ``vb`` that arrived while not trusted and do not count yet."""
        return {n: (a.held, a.persisted) for n, a in self._held_back.get(vb, {}).items()}

    def recheck(self) -> None:
        """Count the acks held back if this node is trusted now (the cluster agent calls
        it after every reconcile: a fence lifted, or the map read after registering
        again applied). Nothing happens while not trusted or with nothing held back."""
        self._release()

    def _release(self) -> None:
        """Move the acks held back into the counted ones, when trusted (module rules)."""
        if not self._held_back or (self.trusted is not None and not self.trusted()):
            return
        held, self._held_back = self._held_back, {}
        moved = []
        for vb, acks in held.items():
            if acks and self._is_active(vb):
                self._acks[vb].update(acks)
                moved.append(vb)
        if moved:
            self._changed(moved, wake_all=False)

    # ------------------------------------------------------------------ states

    def is_active(self, vb: int) -> bool:
        """Whether ``vb`` is active on this node now."""
        return self._is_active(vb)

    def term(self, vb: int) -> int:
        """Bumped whenever ``vb`` stops being active here: a durable write waiting since
        an older term is answered ambiguous."""
        return self._terms[vb]

    def state_changed(self, vb: int) -> None:
        """``vb`` may have changed state. Any change (it is not active now, or was not
        at the last call) drops its acks; not active here (any more) also bumps its term
        (a repeated call while it is not active bumps it again, which nothing can
        notice: no write waits on a vbucket that is not active). A call while it stays
        active changes nothing. Its ``wait_stable`` callbacks are all called and writers
        woken."""
        active = self._is_active(vb)
        if not active or not self._was_active[vb]:
            self._acks[vb].clear()
            self._held_back.pop(vb, None)
        if not active:
            self._terms[vb] += 1
        self._was_active[vb] = active
        self._changed((vb,), wake_all=True)
        self._release()

    def flushed(self) -> None:
        """This node persisted something (the flush listener): persisted seqnos moved."""
        self._changed(tuple(self._waiters), wake_all=False, any_vb=True)
        self._release()

    # ------------------------------------------------------------------ waiting

    def wait_stable(self, vb: int, seqno: int, wake: Wake) -> None:
        """Call ``wake()`` once, when ``stable_seqno(vb) >= seqno`` or ``vb``'s topology
        or state changed (the caller re-checks and may wait again)."""
        if self.stable_seqno(vb) >= seqno and self.call_soon is not None:
            self.call_soon(wake)
            return
        self._order += 1
        heapq.heappush(self._waiters.setdefault(vb, []), (seqno, self._order, wake))

    def cancel_wait(self, vb: int, wake: Wake) -> int:
        """Take back the ``wait_stable`` callbacks of ``vb`` equal to ``wake`` (their
        waiter went away); returns how many."""
        heap = self._waiters.get(vb)
        if not heap:
            return 0
        keep = [entry for entry in heap if entry[2] != wake]
        gone = len(heap) - len(keep)
        if keep:
            heapq.heapify(keep)
            self._waiters[vb] = keep
        else:
            del self._waiters[vb]
        return gone

    def waiting(self) -> int:
        """How many ``wait_stable`` callbacks are registered (stats, tests)."""
        return sum(len(h) for h in self._waiters.values())

    def _changed(self, vbs: Sequence[int], *, wake_all: bool, any_vb: bool = False) -> None:
        due: list[Wake] = []
        for vb in vbs:
            heap = self._waiters.get(vb)
            if not heap:
                continue
            if wake_all:
                due.extend(w for _, _, w in heap)
                heap.clear()
            else:
                stable = self.stable_seqno(vb)
                while heap and heap[0][0] <= stable:
                    due.append(heapq.heappop(heap)[2])
            if not heap:
                del self._waiters[vb]
        for wake in due:
            wake()
        if self.on_change is not None:
            self.on_change(None if any_vb else vbs)
