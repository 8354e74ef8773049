"""One vbucket's chains as the durability monitor counts them: which copies vote, how
many make a majority, and the seqnos a majority (or a lone copy) holds.

Rules of this module:
- Pure: no I/O, no clock, no trio. ``DurabilityMonitor`` (durability.py) keeps one
  ``Topology`` per vbucket and hands in this node's own seqnos and the acks it holds.
- A chain is the map's ``(active, replica, ...)`` with None for a missing copy. Its
  length counts the Nones, so ``k = len(chain) // 2 + 1`` copies make a majority
  whatever is missing. The voters are the chain's NAMED nodes: this node votes (with
  its own seqnos) only where the chain names it. Failover promotes only a copy the map
  names (cluster/failover.py), so a copy the map does not name, this node's included
  (a takeover can make it active before the map says so), protects nothing and must
  not make up a majority; a chain that names too few nodes has no majority at all.
- While the map carries a forward chain for the vbucket (a rebalance or a failover of
  a live node moving it, cluster/vbmap.py ``forward``), a seqno holds only when it holds
  in BOTH chains: the map may flip to the forward chain at any moment, and a write a
  majority of only the old chain holds could then be on a minority of the new one
  (Couchbase counts the same second chain).
- Acks are kept by node name, whatever the chain (the monitor records every replica
  streaming from this node); only the voters' count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

__all__ = ["HELD", "PERSISTED", "Ack", "Chain", "Topology"]

HELD = 0
PERSISTED = 1


class Ack(NamedTuple):
    """What one replica acknowledged, and the stream it came on."""

    held: int
    persisted: int
    source: object

    def seqno(self, which: int) -> int:
        """``held`` (``which`` = HELD) or ``persisted``."""
        return self.persisted if which == PERSISTED else self.held


def _kth_largest(values: list[int], k: int) -> int:
    """The k-th largest of ``values`` (0 when there are fewer than k)."""
    if len(values) < k:
        return 0
    if k == 1:
        return max(values)
    values.sort(reverse=True)
    return values[k - 1]


class Chain:
    """One chain of a vbucket (see the module rules)."""

    __slots__ = ("k", "me_named", "names", "voters")

    def __init__(self, names: tuple[str | None, ...], me: str) -> None:
        self.names = names
        self.k = len(names) // 2 + 1
        #: the named nodes, each once, in chain order
        self.voters = tuple(dict.fromkeys(n for n in names if n is not None))
        self.me_named = me in self.voters

    @property
    def copies(self) -> int:
        """|D|: how many copies the chain names."""
        return len(self.voters)

    def _values(self, me: str, own: int, acks: Mapping[str, Ack], which: int) -> list[int]:
        values = []
        for node in self.voters:
            if node == me:
                values.append(own)
            else:
                ack = acks.get(node)
                values.append(ack.seqno(which) if ack is not None else 0)
        return values

    def majority(self, me: str, own: int, acks: Mapping[str, Ack], which: int) -> int:
        """The k-th largest held (``which`` = HELD) or persisted seqno over the voters;
        0 when fewer than k are named."""
        if len(self.voters) < self.k:
            return 0
        return _kth_largest(self._values(me, own, acks, which), self.k)

    def stable(self, me: str, own_held: int, own_persisted: int, acks: Mapping[str, Ack]) -> int:
        """The highest seqno no single failure among this chain's copies takes back: its
        majority seqno when at least two copies make the majority; else (one copy, or too
        few named for a majority) what every named copy has persisted: a lone copy's
        memory does not survive its own restart."""
        if len(self.voters) >= max(self.k, 2):
            return self.majority(me, own_held, acks, HELD)
        if not self.voters:
            return 0
        return min(self._values(me, own_persisted, acks, PERSISTED))


class Topology:
    """A vbucket's current chain and, while it moves, its forward chain."""

    __slots__ = ("chain", "chains", "forward", "members")

    def __init__(
        self, chain: Sequence[str | None], forward: Sequence[str | None] | None, me: str
    ) -> None:
        self.chain = tuple(chain)
        self.forward = tuple(forward) if forward is not None else None
        if self.forward == self.chain:
            self.forward = None
        self.chains: tuple[Chain, ...] = (Chain(self.chain, me),)
        if self.forward is not None:
            self.chains += (Chain(self.forward, me),)
        #: every node named by either chain
        self.members = frozenset(n for c in self.chains for n in c.voters)

    def same(self, chain: tuple[str | None, ...], forward: tuple[str | None, ...] | None) -> bool:
        return self.chain == chain and self.forward == (None if forward == chain else forward)

    def possible(self) -> bool:
        """Whether every chain names enough copies for a majority."""
        return all(c.copies >= c.k for c in self.chains)

    def majority(self, me: str, own: int, acks: Mapping[str, Ack], which: int) -> int:
        """What a majority of every chain holds (the least of the chains' majorities)."""
        return min(c.majority(me, own, acks, which) for c in self.chains)

    def stable(self, me: str, own_held: int, own_persisted: int, acks: Mapping[str, Ack]) -> int:
        """The least of the chains' stable seqnos."""
        return min(c.stable(me, own_held, own_persisted, acks) for c in self.chains)
