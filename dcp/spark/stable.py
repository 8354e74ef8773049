"""Stable seqnos for planning a ``stableOnly`` query: where no single node failure can
take a vbucket's changes back, as the node holding the vbucket active reports it.

Rules of this module:
- Asked only when option ``stableOnly`` is set (the other queries make no extra request):
  STAT ``vbucket-seqno <vb>`` for each vbucket, pipelined in one write per node on the
  planner's kept connection to the node its high seqno came from (``cluster.NodeView``),
  right after that high seqno. The key is ``vb_N:stable_seqno``, which a server reports
  for the vbuckets it holds active only (dcp/producer/stats.py).
- A stable seqno is clamped to the high seqno of the same refresh: asked a moment later,
  it may have passed it, and a planned end is never above an observed high seqno.
- A node that reports no stable seqno for any vbucket asked, or does not know the
  group, is a server without stable seqnos (an older one): ``RangeUnavailableError``
  naming option stableOnly, never retried, never a plan from the high seqnos instead
  (those are what a failover can take back). Some vbuckets missing while others are
  reported: they stopped being active between the two requests; on a cluster that is
  ``MapChanged`` (retried after a config refresh), on a single server an error naming
  them. A user without the ``stats`` privilege gets an error saying so.
- Blocking, like the rest of the planner; imports only the connector's own modules and
  ``dcp.protocol``.
"""

from __future__ import annotations

from collections.abc import Mapping

from dcp.protocol import Status, StatusError
from dcp.protocol.cluster_config import Address, format_address

from .cluster import MapChanged, NodeLost, NodeView
from .errors import RangeUnavailableError
from .wire import ConnectionLost

__all__ = ["stable_seqnos"]

#: STAT answers of a server that does not know the group (or its argument)
_UNKNOWN = (Status.KEY_ENOENT, Status.EINVAL, Status.UNKNOWN_COMMAND, Status.NOT_SUPPORTED)


def stable_seqnos(
    nodes: NodeView,
    highs: Mapping[int, int],
    owners: Mapping[int, tuple[Address, int]],
) -> dict[int, int]:
    """Per vbucket of ``highs``, its stable seqno (at most its high seqno), from the node
    in ``owners`` (see the module rules for the errors)."""
    by_node: dict[Address, list[int]] = {}
    for vb in sorted(highs):
        by_node.setdefault(owners[vb][0], []).append(vb)
    out: dict[int, int] = {}
    for node, vbs in by_node.items():
        where = _where(nodes, node)
        try:
            answers = nodes.client(node).stats([f"vbucket-seqno {vb}" for vb in vbs])
        except ConnectionLost as exc:
            nodes.clients.pop(node, None)
            raise NodeLost(node, exc) from exc
        except StatusError as exc:
            raise _refused(exc, where) from exc
        got = {
            vb: pairs.get(f"vb_{vb}:stable_seqno") for vb, pairs in zip(vbs, answers, strict=True)
        }
        missing = [vb for vb, s in got.items() if s is None]
        if len(missing) == len(vbs):
            raise RangeUnavailableError(
                f"option stableOnly=true: {where} reports no stable seqno (STAT "
                f"vbucket-seqno has no vb_N:stable_seqno for vbuckets {missing[:16]}): a "
                f"server without stable seqnos (an older version), or those vbuckets are "
                f"not active there. A stable-only query cannot be planned from high "
                f"seqnos; upgrade the server or read without stableOnly"
            )
        if missing:
            text = (
                f"{where} does not hold vbuckets {missing[:16]} active any more (no "
                f"stable seqno for them in STAT vbucket-seqno; option stableOnly)"
            )
            if nodes.topology.cluster:
                raise MapChanged(text)
            raise RangeUnavailableError(text)
        for vb, s in got.items():
            try:
                seqno = int(s)  # type: ignore[arg-type]
            except ValueError as exc:
                raise RangeUnavailableError(
                    f"option stableOnly=true: {where} reports vb_{vb}:stable_seqno={s!r}, "
                    f"not a number"
                ) from exc
            out[vb] = max(0, min(seqno, highs[vb]))
    return out


def _where(nodes: NodeView, node: Address) -> str:
    if nodes.topology.cluster:
        return f"node {format_address(node)}"
    return nodes.describe()


def _refused(exc: StatusError, where: str) -> Exception:
    if exc.status == Status.EACCESS:
        return RangeUnavailableError(
            f"option stableOnly=true: {where} refused STAT vbucket-seqno ({exc}): a "
            f"stable-only query plans from the stable seqnos that STAT reports, so its "
            f"user needs the 'stats' privilege besides 'stream'"
        )
    if exc.status in _UNKNOWN:
        return RangeUnavailableError(
            f"option stableOnly=true: {where} does not serve STAT vbucket-seqno with "
            f"stable seqnos ({exc}): a server without stable seqnos (an older version); "
            f"upgrade it or read without stableOnly"
        )
    return exc
