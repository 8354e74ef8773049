"""Where the copies of each vbucket go: ``compute_map`` and ``moves``.

Rules of this module:
- Pure and deterministic: the same nodes, sizes and current map give the same map, so
  an orchestrator that restarts a computation (a new one after a crash) computes what its
  predecessor did.
- Balanced: every node has ``V // N`` or ``V // N + 1`` actives, and ``V*R // N`` or one
  more replicas (R: ``min(num_replicas, N - 1)``, as many replicas as distinct nodes allow);
  the extra replicas go to nodes with fewer actives first, so that when every node holds
  every vbucket (R = N - 1) the counts still add up.
- Few moves: with a current map, a copy stays where it is whenever its node is still in
  the cluster and under its quota (a former active may stay as a replica); a vbucket that
  needs a new active takes a node that already holds a copy when one has room (a
  promotion moves no data); new copies go to the node with the most room left.
- Measured (tests/etcd/test_placement.py, 1-8 nodes, 4-1024 vbuckets, 0-2 replicas):
  adding a node builds exactly the new node's share of copies; removing one rebuilds
  the copies it held, at worst 9 % more where balance forces it (5 -> 4 nodes with 2
  replicas: each vbucket is on 3 of the 4 nodes, so the free node of a vbucket is fixed).
- ``prefer`` (node -> vbuckets it still holds data for, e.g. a failed-over node's former
  copies) only chooses *replicas*, in three places: a node over its replica quota drops
  its copies of vbuckets another node prefers first; the greedy pass gives a free
  replica slot to a node that prefers the vbucket first while that node has room; a
  shift (below) moves a replica onto a node that prefers it first. Actives keep their
  own rules (a returning node's data may be behind the promoted copy) and the quotas
  are the same, so balance and distinct copies hold as without it, and with no
  preference the map is exactly the one without the argument.
- Measured with ``prefer`` (tests/etcd/test_placement.py; 3-9 nodes, 64-1024 vbuckets,
  1-2 replicas): a failed-over node that returns gets only its former vbuckets as
  replicas, also when the survivors rebuilt their replicas in between (about 2/3 or
  less without), and half as many copies are built from nothing then. Right after the
  failover the only free slots are its former vbuckets anyway; there the greedy order
  changes and a few more copies are built from nothing (1 % overall, at worst 8 %).
- The greedy pass can corner itself (the only nodes with room already hold a copy of
  the vbucket): an augmenting path then shifts other vbuckets' replicas one step each
  until a slot frees up, so a balanced map is always found.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .vbmap import VBucketMap

__all__ = ["Move", "compute_map", "moves"]


@dataclass(frozen=True)
class Move:
    """One vbucket whose chain changes."""

    vb: int
    old: tuple[str | None, ...]
    new: tuple[str | None, ...]

    @property
    def new_copies(self) -> list[str]:
        """Nodes that must build a copy they do not hold (data to stream)."""
        held = set(self.old)
        return [n for n in self.new if n is not None and n not in held]

    @property
    def changes_active(self) -> bool:
        return self.old[0] != self.new[0]


def moves(old: VBucketMap, new: VBucketMap) -> list[Move]:
    """Per vbucket whose chain (by node names) differs, old and new chains."""
    if old.num_vbuckets != new.num_vbuckets:
        raise ValueError(f"maps of {old.num_vbuckets} and {new.num_vbuckets} vbuckets")
    width = max(old.num_replicas, new.num_replicas) + 1
    out = []
    for vb in range(new.num_vbuckets):
        a = _pad(old.names(vb), width)
        b = _pad(new.names(vb), width)
        if a != b:
            out.append(Move(vb, a, b))
    return out


def _pad(chain: tuple[str | None, ...], width: int) -> tuple[str | None, ...]:
    return chain + (None,) * (width - len(chain))


def _quotas(total: int, order: Sequence[str]) -> dict[str, int]:
    """``total`` split as evenly as possible; the first nodes of ``order`` get the extras."""
    base, extra = divmod(total, len(order))
    return {n: base + (1 if i < extra else 0) for i, n in enumerate(order)}


def compute_map(
    nodes: Iterable[str],
    num_vbuckets: int,
    num_replicas: int,
    current: VBucketMap | None = None,
    *,
    prefer: Mapping[str, Collection[int]] | None = None,
) -> VBucketMap:
    """A balanced map over ``nodes``, as close to ``current`` as balance allows.

    ``prefer``: per node, the vbuckets it still holds data for that ``current`` does not
    name (a failed-over node that returns holds its former copies): where a vbucket needs
    a new replica, a node that prefers it takes it first while under its replica quota,
    so that it catches up from its own data (a rollback of its un-replicated tail and
    the rest) instead of building a copy from nothing. It never makes a node an active
    and never changes the quotas. Nodes not in ``nodes`` and vbuckets out of range are
    ignored: a node that left for good holds nothing here, and a stale record must not
    stop the orchestrator from computing a map.
    """
    names = sorted(set(nodes))
    if not names:
        raise ValueError("a vbucket map needs at least one node")
    if num_vbuckets < 1 or num_replicas < 0:
        raise ValueError(f"bad sizes: {num_vbuckets} vbuckets, {num_replicas} replicas")
    if current is not None and current.num_vbuckets != num_vbuckets:
        raise ValueError(f"current map has {current.num_vbuckets} vbuckets, not {num_vbuckets}")
    live = set(names)
    vbs = range(num_vbuckets)
    width = min(num_replicas, len(names) - 1)
    # old[vb]: the live nodes holding a copy now, the active first when it is live
    old: list[list[str]] = [
        [n for n in current.names(vb) if n in live] if current is not None else [] for vb in vbs
    ]
    old_active = [
        current.active(vb) if current is not None and current.active(vb) in live else None
        for vb in vbs
    ]
    active = _place_actives(names, old, old_active)
    acts = Counter(active)

    # replicas: the extras go to nodes with fewer actives, then to those holding more now
    had_rep = Counter(n for vb in vbs for n in old[vb] if n != old_active[vb])
    quota = _quotas(num_vbuckets * width, sorted(names, key=lambda n: (acts[n], -had_rep[n], n)))
    left = dict(quota)
    reps: list[list[str]] = [[] for _ in vbs]
    on: dict[str, set[int]] = {n: set() for n in names}

    # pairs[a, n]: vbuckets active on a with a replica on n. New replicas of a node's
    # actives spread over the other nodes, so that when it fails its actives are promoted
    # on many nodes (not all on one), and its loss moves little to restore balance.
    pairs: Counter[tuple[str | None, str]] = Counter()

    def place(vb: int, node: str) -> None:
        reps[vb].append(node)
        on[node].add(vb)
        pairs[active[vb], node] += 1

    # keep: replicas first, in chain order, then a former active that lost the active role
    former = [
        [n for n in [*(x for x in old[vb] if x != old_active[vb]), old_active[vb]] if n]
        for vb in vbs
    ]
    former = [[n for n in f if n != active[vb]] for vb, f in enumerate(former)]
    # most constrained first: a vbucket with one copy to keep claims its slot before one
    # that could keep either of two (otherwise the second may take the first's only slot).
    # Among equals, vbuckets another node prefers come last: a node over its quota then
    # drops those copies first, and the slots they free go to the preferring node (the
    # same number of copies is dropped either way; the new ones are built from data the
    # preferring node already has).
    wanted = _preferred(prefer, names, num_vbuckets)
    wanting = Counter(vb for n in names for vb in wanted[n] if n != active[vb] and n not in old[vb])
    for vb in sorted(vbs, key=lambda vb: (len(former[vb]), wanting[vb], vb)):
        for n in former[vb][:width]:
            if left[n] > 0:
                place(vb, n)
                left[n] -= 1

    preferring = any(wanted.values())
    wanters: dict[int, list[str]] = {}
    for n in names:
        for vb in sorted(wanted[n]):
            wanters.setdefault(vb, []).append(n)

    def replica_shifts(z: str) -> Iterable[tuple[int, str]]:
        # a vbucket with a replica on z may move it to any node holding no copy of it.
        # With preferences, moves onto a node that prefers the vbucket come first and a
        # replica z itself prefers moves last: the search keeps the first way it finds
        # to each node, so a shift then lands copies where their data already is.
        if not preferring:
            order = sorted(on[z])
        else:
            order = sorted(on[z], key=lambda w: (w in wanted[z], w))
            for w in order:
                for y in wanters.get(w, ()):
                    if y != active[w] and y not in reps[w]:
                        yield w, y
        for w in order:
            chain = {active[w], *reps[w]}
            for y in names:
                if y not in chain:
                    yield w, y

    for vb in vbs:
        while len(reps[vb]) < width:
            taken = {active[vb], *reps[vb]}
            pool = [n for n in names if n not in taken and left[n] > 0]
            if pool:
                a = active[vb]
                pick = max(
                    pool,
                    key=lambda n: (
                        n in old[vb],
                        vb in wanted[n],
                        -pairs[a, n],
                        left[n],
                        -names.index(n),
                    ),
                )
                left[pick] -= 1
            else:
                # every node that could take it is full: shift other replicas along a path
                # (from a node holding a copy when possible: then only one copy is built)
                starts = [n for n in old[vb] if n not in taken]
                starts += [n for n in names if n not in taken and n not in starts]
                found = _shift_path(starts, left, replica_shifts)
                if found is None:  # not reachable: the quotas always admit a placement
                    raise RuntimeError(f"no balanced place for a replica of vb {vb}")
                pick, path = found
                for w, z, y in path:
                    reps[w][reps[w].index(z)] = y
                    on[z].discard(w)
                    on[y].add(w)
                    pairs[active[w], z] -= 1
                    pairs[active[w], y] += 1
            place(vb, pick)
    chains = [[active[vb], *reps[vb]] for vb in vbs]
    return VBucketMap.from_names(num_replicas, chains, servers=names)


def _preferred(
    prefer: Mapping[str, Collection[int]] | None, names: list[str], num_vbuckets: int
) -> dict[str, set[int]]:
    """``prefer`` restricted to the cluster's nodes and to vbuckets that exist."""
    out: dict[str, set[int]] = {n: set() for n in names}
    for n, vbs in (prefer or {}).items():
        if n in out:
            out[n] = {vb for vb in vbs if 0 <= vb < num_vbuckets}
    return out


def _place_actives(
    names: list[str], old: list[list[str]], old_active: list[str | None]
) -> list[str]:
    """The active node of every vbucket: a live current active stays while its node is
    within its share; any other vbucket goes to a node that holds a copy of it, directly
    or by handing another vbucket's active role to that vbucket's replica (role changes
    build no copy); only when no such path exists does it go where data must be built."""
    had = Counter(a for a in old_active if a is not None)
    # the extra one goes to nodes holding the most actives now (fewer moves)
    left = _quotas(len(old), sorted(names, key=lambda n: (-had[n], n)))
    active: list[str | None] = [None] * len(old)
    assigned: dict[str, set[int]] = {n: set() for n in names}

    def assign(vb: int, node: str) -> None:
        active[vb] = node
        assigned[node].add(vb)
        left[node] -= 1

    for vb, a in enumerate(old_active):
        if a is not None and left[a] > 0:
            assign(vb, a)

    def role_shifts(z: str) -> Iterable[tuple[int, str]]:
        for w in sorted(assigned[z]):
            for y in old[w]:
                if y != z:
                    yield w, y

    for vb in range(len(old)):
        if active[vb] is not None:
            continue
        holders = sorted(old[vb], key=lambda n: -left[n])  # the most room first
        found = _shift_path(holders, left, role_shifts) if holders else None
        if found is None:
            pool = [n for n in names if left[n] > 0]
            assign(vb, max(pool, key=lambda n: (left[n], -names.index(n))))
            continue
        pick, path = found
        for w, z, y in path:
            assigned[z].discard(w)
            active[w] = y
            assigned[y].add(w)
        left[pick] += 1  # _shift_path took the slot at the path's end; assign takes it
        assign(vb, pick)
    return [a for a in active if a is not None]


def _shift_path(
    starts: list[str],
    left: dict[str, int],
    shifts: Callable[[str], Iterable[tuple[int, str]]],
) -> tuple[str, list[tuple[int, str, str]]] | None:
    """Find room for one more copy on one of ``starts``.

    Breadth-first: a start node with room takes it; from a full node ``z``, a vbucket
    ``w`` placed on ``z`` could move to ``y`` (``shifts(z)`` lists the ``(w, y)``); go on
    from ``y`` until a node with room is reached. Returns the start node and the shifts
    ``(w, from z, to y)`` to apply (each node keeps its count except the last, whose room
    is taken here), or None when no start can be reached. Shortest paths first: the
    fewest vbuckets disturbed.
    """
    parent: dict[str, tuple[str, int] | None] = {n: None for n in starts}
    queue = deque(starts)
    while queue:
        z = queue.popleft()
        if left[z] > 0:
            left[z] -= 1
            path = []
            y = z
            step = parent[y]
            while step is not None:
                prev, w = step
                path.append((w, prev, y))
                y = prev
                step = parent[y]
            return y, path
        for w, y in shifts(z):
            if y not in parent:
                parent[y] = (z, w)
                queue.append(y)
    return None
