"""DurabilityMonitor: what a majority of each vbucket's copies hold, for durable writes
and stable-only streams.

Rules of this module:
- One monitor per server (``DcpServer.durability``), built once the bucket is open. It
  is synchronous and knows no sockets, no clock and no trio: this node's seqnos and
  states reach it as callables, replicas' as ``acknowledge`` calls (DCP_SEQNO_ACKNOWLEDGED,
  dcp_handlers.py), the cluster map as ``set_topology`` (cluster/agent.py), this node's
  flushes as ``flushed`` (a ``Persistence`` flush listener) and state changes as
  ``state_changed`` (vbucket_states.py).
- A vbucket's chain is the map's ``(active, replica, ...)`` with None for a missing
  copy; its length counts the Nones, so ``k = len(chain) // 2 + 1`` copies make a
  majority whatever is missing. Before any map, and on a single node, it is
  ``(node_name,)``. While the vbucket is active here this node is its active copy: the
  other named nodes of the chain are its replicas, whose acks count (a takeover can make
  this node active before the map says so; the old active then replicates from it).
- Nothing is trusted from a replica beyond what this node sent it: an ack above the
  stream's last sent seqno is clamped to it, a persisted seqno above the held one to the
  held one, and an ack from a node that is not a replica in the chain is ignored. The
  caller logs the reason returned. So the majority never passes this node's own high
  seqno.
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
  have moved a seqno, ``on_change`` is called (the server wakes the connections with
  durable writes waiting; their writers re-check ``satisfied``) and due ``wait_stable``
  callbacks are called. Callbacks run on the caller's (trio) thread, never from inside
  ``wait_stable`` itself: one already due when registered is handed to ``call_soon``.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from ..protocol.opcodes import DurabilityLevel, VBucketState

__all__ = ["DurabilityMonitor"]

log = logging.getLogger("dcp.durability")

_NONE = int(DurabilityLevel.NONE)
_MAJORITY = int(DurabilityLevel.MAJORITY)
_MAJORITY_AND_PERSIST = int(DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE)
_PERSIST_TO_MAJORITY = int(DurabilityLevel.PERSIST_TO_MAJORITY)
_PERSIST_TO_ACTIVE = int(DurabilityLevel.PERSIST_TO_ACTIVE)
_MAJORITY_LEVELS = frozenset((_MAJORITY, _MAJORITY_AND_PERSIST, _PERSIST_TO_MAJORITY))

Wake = Callable[[], None]


class _VBucket(Protocol):
    """What ``of_vbuckets`` reads of an engine vbucket."""

    @property
    def high_seqno(self) -> int: ...

    @property
    def persisted_seqno(self) -> int: ...

    @property
    def state(self) -> VBucketState: ...


def _kth_largest(values: list[int], k: int) -> int:
    """The k-th largest of ``values`` (0 when there are fewer than k)."""
    if len(values) < k:
        return 0
    if k == 1:
        return max(values)
    values.sort(reverse=True)
    return values[k - 1]


class _Topology:
    """One vbucket's chain as the monitor uses it."""

    __slots__ = ("chain", "copies", "k", "replicas")

    def __init__(self, chain: tuple[str | None, ...], me: str) -> None:
        self.chain = chain
        self.k = len(chain) // 2 + 1
        seen: dict[str, None] = {}
        for name in chain:
            if name is not None and name != me:
                seen[name] = None
        #: the nodes whose acks count: the chain's named nodes other than this one
        self.replicas = tuple(seen)
        #: |D|: this node (the active) and its replicas
        self.copies = 1 + len(self.replicas)


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
        self._single = _Topology((node_name,), node_name)
        self._topo: list[_Topology] = [self._single] * num_vbuckets
        #: per vb: {node: (held, persisted)} last acknowledged by that replica
        self._acks: list[dict[str, tuple[int, int]]] = [{} for _ in range(num_vbuckets)]
        self._terms = [0] * num_vbuckets
        #: per vb with waiters: a heap of (seqno, order, wake)
        self._waiters: dict[int, list[tuple[int, int, Wake]]] = {}
        self._order = 0
        #: called after anything that may have moved a seqno (the server wakes writers)
        self.on_change: Callable[[], None] | None = None
        #: how a ``wait_stable`` already due when registered gets called later (the
        #: server: trio's ``run_sync_soon``); None: at the next re-evaluation
        self.call_soon: Callable[[Wake], None] | None = None
        #: whether acks may count now (module rules); None: always (a single node)
        self.trusted: Callable[[], bool] | None = None
        #: per vb: {node: (held, persisted)} acked while not trusted, not counted yet
        self._held_back: dict[int, dict[str, tuple[int, int]]] = {}

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

    def set_topology(self, chains: Sequence[Sequence[str | None]] | None) -> None:
        """Every vbucket's chain (active first, None for a missing copy), or None: a
        single node. Acks of nodes that left a vbucket's chain are dropped.

        Raises:
            ValueError: not one chain per vbucket, or an empty chain.
        """
        if chains is None:
            new = [self._single] * self.num_vbuckets
        else:
            if len(chains) != self.num_vbuckets:
                raise ValueError(f"{len(chains)} chains for {self.num_vbuckets} vbuckets")
            new = []
            for vb, chain in enumerate(chains):
                t = tuple(chain)
                if not t:
                    raise ValueError(f"vb {vb}: empty chain")
                old = self._topo[vb]
                new.append(old if old.chain == t else _Topology(t, self.node_name))
        changed = [vb for vb in range(self.num_vbuckets) if new[vb] is not self._topo[vb]]
        self._topo = new
        for vb in changed:
            keep = new[vb].replicas
            for acks in (self._acks[vb], self._held_back.get(vb, {})):
                for node in [n for n in acks if n not in keep]:
                    del acks[node]
        if changed:
            self._changed(changed, wake_all=True)
        self._release()

    def chain(self, vb: int) -> tuple[str | None, ...]:
        return self._topo[vb].chain

    # ------------------------------------------------------------------ seqnos

    def majority_seqno(self, vb: int) -> int:
        """The k-th largest held seqno over the vbucket's copies (0 when fewer than k
        copies exist or the vbucket is not active here)."""
        return self._majority(vb, 0)

    def majority_persisted_seqno(self, vb: int) -> int:
        """The same over persisted seqnos."""
        return self._majority(vb, 1)

    def _majority(self, vb: int, which: int) -> int:
        t = self._topo[vb]
        if t.copies < t.k or not self._is_active(vb):
            return 0
        own = self._high(vb) if which == 0 else self._persisted(vb)
        if t.k == 1:
            return own
        acks = self._acks[vb]
        values = [own]
        for node in t.replicas:
            ack = acks.get(node)
            values.append(ack[which] if ack is not None else 0)
        return _kth_largest(values, t.k)

    def stable_seqno(self, vb: int) -> int:
        """The highest seqno no single node failure can take back: the majority seqno
        when at least two copies make the majority, else (one copy) what this node has
        persisted. 0 when the vbucket is not active here."""
        t = self._topo[vb]
        if t.copies >= max(t.k, 2):
            return self._majority(vb, 0)
        return self._persisted(vb) if self._is_active(vb) else 0

    def possible(self, vb: int, level: int) -> bool:
        """Whether the chain has enough copies for ``level`` (else DURABILITY_IMPOSSIBLE)."""
        if level in _MAJORITY_LEVELS:
            t = self._topo[vb]
            return t.copies >= t.k
        return True

    def satisfied(self, vb: int, seqno: int, level: int) -> bool:
        """Whether a write of ``vb`` at ``seqno`` now holds at ``level``."""
        if level == _PERSIST_TO_ACTIVE:
            return self._persisted(vb) >= seqno
        if level == _MAJORITY:
            return self._majority(vb, 0) >= seqno
        if level == _MAJORITY_AND_PERSIST:
            return self._persisted(vb) >= seqno and self._majority(vb, 0) >= seqno
        if level == _PERSIST_TO_MAJORITY:
            return self._persisted(vb) >= seqno and self._majority(vb, 1) >= seqno
        return level == _NONE

    # ------------------------------------------------------------------ acks

    def acknowledge(
        self, vb: int, node: str, seqno: int, persisted: int | None, *, sent: int
    ) -> str:
        """Record that replica ``node`` holds ``seqno`` of ``vb`` and has persisted
        ``persisted`` (None: not said; the last persisted seqno it said is kept, within
        ``seqno``). ``sent``: the highest seqno this node sent on that replica's stream.
        Returns "" or why the ack was clamped or ignored (the caller logs it)."""
        t = self._topo[vb]
        if node not in t.replicas:
            return f"{node!r} is not a replica of vb {vb} (chain {list(t.chain)}): ignored"
        acks = self._acks[vb]
        reason = ""
        if seqno > sent:
            reason = f"seqno {seqno} above the {sent} sent to {node!r}: clamped"
            seqno = sent
        if persisted is None:
            prev = self._held_back.get(vb, {}).get(node) or acks.get(node)
            persisted = min(prev[1], seqno) if prev is not None else 0
        elif persisted > seqno:
            reason = reason or f"persisted {persisted} above held {seqno}: clamped"
            persisted = seqno
        if self.trusted is not None and not self.trusted():
            self._held_back.setdefault(vb, {})[node] = (seqno, persisted)
            held = (
                "this node's lease may have lapsed (fenced, or no map yet): held back, "
                "not counted until it is sure"
            )
            return f"{reason}; {held}" if reason else held
        self._release()
        before = (self._majority(vb, 0), self._majority(vb, 1))
        acks[node] = (seqno, persisted)
        if (self._majority(vb, 0), self._majority(vb, 1)) != before:
            self._changed((vb,), wake_all=False)
        return reason

    def forget(self, vb: int, node: str | None = None) -> None:
        """Drop ``node``'s acks for ``vb`` (its stream or connection is gone), or all of
        ``vb``'s. Nobody is woken: forgetting only lowers seqnos."""
        if node is None:
            self._acks[vb].clear()
            self._held_back.pop(vb, None)
        else:
            self._acks[vb].pop(node, None)
            self._held_back.get(vb, {}).pop(node, None)

    def held_back(self, vb: int) -> dict[str, tuple[int, int]]:
        """The acks of ``vb`` that arrived while not trusted and do not count yet."""
        return dict(self._held_back.get(vb, {}))

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
        """``vb`` may have changed state. Not active here (any more): its acks are
        dropped and its term bumped (a repeated call while it is not active bumps it
        again, which nothing can notice: no write waits on a vbucket that is not active).
        Its ``wait_stable`` callbacks are all called and writers woken."""
        if not self._is_active(vb):
            self._terms[vb] += 1
            self._acks[vb].clear()
            self._held_back.pop(vb, None)
        self._changed((vb,), wake_all=True)
        self._release()

    def flushed(self) -> None:
        """This node persisted something (the flush listener): persisted seqnos moved."""
        self._changed(tuple(self._waiters), wake_all=False)
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

    def waiting(self) -> int:
        """How many ``wait_stable`` callbacks are registered (stats, tests)."""
        return sum(len(h) for h in self._waiters.values())

    def _changed(self, vbs: Sequence[int], *, wake_all: bool) -> None:
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
            self.on_change()
