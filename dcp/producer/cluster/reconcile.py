"""What one node should hold of each vbucket, given the cluster map: the node side's rules.

Rules of this module:
- Pure: a function of the map, this node's name, the members' addresses and what the
  node holds now (its engine states and its current assignments). No I/O, no clock; the
  agent (cluster/agent.py) applies the result through ``VBucketStates`` in one batch.
- The rules, per vbucket (C = its chain of node names, F = its forward chain when it is
  moving, else None; ``me`` = this node):
  * F is None: me == C[0] -> ACTIVE; me in C[1:] -> REPLICA fed from C[0]'s address
    (no source while C[0] is None or has no known address: the replica waits); else DEAD.
  * F given: me == C[0] -> ACTIVE, except a vbucket the engine holds PENDING or DEAD
    keeps that state (a takeover is handing it to F[0] or has: re-activating it would
    abort the hand-over or make two actives);
    me == F[0] != C[0] -> REPLICA fed from C[0], except a vbucket the engine already
    holds ACTIVE stays ACTIVE (the takeover is done) and an assignment that already
    asks for a takeover from C[0] is kept (the orchestrator started it: replacing it
    would cancel the hand-over); me elsewhere in C or F -> REPLICA fed from C[0];
    else DEAD.
- Fencing is not a state: a fenced node's write gate refuses writes (cluster/agent.py)
  and its vbuckets keep the states the map gave them, so a fence that ends with the lease
  kept costs no stream and no new history branch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ...protocol.opcodes import VBucketState
from ..replication.target import Assignment
from .vbmap import VBucketMap

__all__ = ["desired_assignment"]

#: the states a takeover's source passes through (dcp/producer/takeover.py)
_HANDING_OVER = (VBucketState.PENDING, VBucketState.DEAD)

_ACTIVE = Assignment(VBucketState.ACTIVE)
_DEAD = Assignment(VBucketState.DEAD)


def desired_assignment(
    vbmap: VBucketMap,
    me: str,
    addresses: Mapping[str, str],
    engine_state: Callable[[int], VBucketState],
    current: Callable[[int], Assignment | None],
) -> dict[int, Assignment]:
    """The assignment of every vbucket of ``vbmap`` on node ``me`` (see the module rules).

    ``addresses``: node name -> "HOST:PORT"; ``engine_state(vb)``: the state the node
    holds now; ``current(vb)``: its current assignment (None: none).
    """
    out: dict[int, Assignment] = {}
    for vb in range(vbmap.num_vbuckets):
        chain = vbmap.names(vb)
        head = chain[0]
        source = addresses.get(head) if head is not None else None
        replica = Assignment(VBucketState.REPLICA, source)
        forward = vbmap.forward_names(vb)
        if forward is None:
            if head == me:
                a = _ACTIVE
            elif me in chain[1:]:
                a = replica
            else:
                a = _DEAD
        elif head == me:
            held = engine_state(vb)
            a = Assignment(held) if held in _HANDING_OVER else _ACTIVE
        elif forward[0] == me:
            now = current(vb)
            if engine_state(vb) == VBucketState.ACTIVE:
                a = _ACTIVE
            elif now is not None and now.takeover and now.source == source and source:
                a = now
            else:
                a = replica
        elif me in chain or me in forward:
            a = replica
        else:
            a = _DEAD
        out[vb] = a
    return out
