"""Replication columns of ``dcpctl vbuckets``: each replica's source and how far behind it is.

Rules of this module:
- The replica's own view comes from its STAT group ``replication`` (dcp/producer/stats.py):
  ``vb_N:source``, ``vb_N:high_seqno``, ``vb_N:source_seqno`` (the highest snapshot end
  the source announced), ``vb_N:lag`` and ``vb_N:stream``. A server without the group
  (older versions) simply has no replication columns.
- The lag shown is measured against the source itself when it answers: one connection
  per distinct source, all at once, each bounded by the command's ``--timeout``; lag =
  the source's high seqno minus the replica's. A source that does not answer is reported
  as unreachable and the lag falls back to what the replica last heard from it; it never
  fails the command (a dead source is exactly when people look at this).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from .args import split_address
from .output import CtlError
from .remote import Remote

if TYPE_CHECKING:
    from ..consumer.security import Security

__all__ = [
    "lag_cell",
    "replica_columns",
    "replication_fields",
    "source_high_cell",
    "source_high_seqnos",
]


def replication_fields(pairs: list[tuple[str, str]]) -> dict[int, dict[str, Any]]:
    """``vb_N:FIELD`` pairs of the ``replication`` group as ``{N: {FIELD: value}}``
    (per-source ``source:HOST:PORT:FIELD`` pairs are left out)."""
    out: dict[int, dict[str, Any]] = {}
    for k, v in pairs:
        head, sep, field = k.partition(":")
        if sep and head.startswith("vb_") and head[3:].isdigit():
            out.setdefault(int(head[3:]), {})[field] = int(v) if v.isdigit() else v
    return out


async def _highs(address: str, timeout: float, security: Security | None) -> dict[int, int] | None:
    try:
        host, port = split_address(address)
        async with Remote(host, port, timeout, security) as r:
            (pairs,) = await r.stats("vbucket-seqno")
    except (CtlError, ValueError):
        return None
    out = {}
    for k, v in pairs:
        head, _, field = k.partition(":")
        if field == "high_seqno" and head[3:].isdigit():
            out[int(head[3:])] = int(v)
    return out


async def source_high_seqnos(
    sources: set[str], timeout: float, security: Security | None = None
) -> dict[str, dict[int, int] | None]:
    """``{source: {vb: high seqno}}``, ``None`` for a source that did not answer. The
    sources are asked with ``security``: the command's own credentials and TLS."""
    found: dict[str, dict[int, int] | None] = {}

    async def one(address: str) -> None:
        found[address] = await _highs(address, timeout, security)

    async with trio.open_nursery() as nursery:
        for s in sorted(sources):
            nursery.start_soon(one, s)
    return found


def replica_columns(
    fields: dict[str, Any], own_high: int | None, highs: dict[str, dict[int, int] | None], vb: int
) -> dict[str, Any]:
    """The replication part of one ``vbuckets`` row (all None without a source)."""
    source = fields.get("source")
    if not source:
        return {
            "source": None,
            "stream": None,
            "source_high_seqno": None,
            "source_reachable": None,
            "lag": None,
            "replication_lag": None,
        }
    src = highs.get(source)
    source_high = src.get(vb) if src is not None else None
    lag = None
    if source_high is not None and isinstance(own_high, int):
        lag = source_high - own_high
    return {
        "source": source,
        "stream": fields.get("stream"),
        "source_high_seqno": source_high,
        "source_reachable": src is not None,
        "lag": lag,
        "replication_lag": fields.get("lag"),
    }


def lag_cell(row: dict[str, Any]) -> Any:
    """The table's lag: against the source; ``N*`` when only the replica's own figure
    is known (source unreachable); ``-`` for vbuckets without a source."""
    if row["source"] is None:
        return None
    if row["lag"] is not None:
        return row["lag"]
    return f"{row['replication_lag']}*" if row["replication_lag"] is not None else "?"


def source_high_cell(row: dict[str, Any]) -> Any:
    if row["source"] is None:
        return None
    if not row["source_reachable"]:
        return "unreachable"
    return row["source_high_seqno"]
