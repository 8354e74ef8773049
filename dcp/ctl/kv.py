"""``dcpctl get | set | delete``: quick single-key tests through the SDK's ``KvClient``.

Rules of this module:
- The vbucket count is discovered from the server (STAT "" ``ep_num_vbuckets``) before
  the ``KvClient`` is made, so keys are routed to the vbucket the server expects. In a
  cluster (``topology.discover``) the count is the map's and the ``KvClient`` gets the
  bootstrap list: it sends each key to its vbucket's active node and follows the map.
- A missing key, a refused write or a timeout is one line on stderr and exit status 1;
  ``KvClient`` already retries what is retriable (within ``--timeout``).
- ``--durability LEVEL`` (or ``--durable``, the same as ``persistActive``) is handed to
  ``KvClient`` as is; the answer waits for that level, within ``--timeout``. A level the
  cluster has too few copies for and an ambiguous outcome are one line each that says
  what is known about the write.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..consumer import (
    DcpClientError,
    DurabilityImpossibleError,
    KeyNotFound,
    KvClient,
    StatusError,
    SyncWriteAmbiguous,
)
from .access import sdk_options
from .output import CtlError, Output, preview, value_doc
from .remote import Remote
from .topology import discover

__all__ = ["cmd_delete", "cmd_get", "cmd_set"]


async def _client(args: argparse.Namespace) -> KvClient:
    topo = await discover(args)
    host: Any = args.host
    if topo.cluster and topo.num_vbuckets:  # the SDK routes by the map itself
        host, n = args.bootstrap, topo.num_vbuckets
    else:
        async with Remote.of(args) as r:
            n = await r.num_vbuckets()
    return KvClient(
        host,
        args.port,
        num_vbuckets=n,
        timeout=args.timeout,
        agent="dcpctl",
        **sdk_options(args),
    )


async def _run(args: argparse.Namespace, op: str, fn: Any) -> Any:
    kv = await _client(args)
    try:
        async with kv:
            return await fn(kv)
    except KeyNotFound:
        raise CtlError(f"key {args.key!r} not found") from None
    except DurabilityImpossibleError:
        raise CtlError(
            f"{op} {args.key!r} refused: durability {_level(args)} needs more copies of the "
            "vbucket than the cluster map has; nothing was written"
        ) from None
    except SyncWriteAmbiguous:
        raise CtlError(
            f"{op} {args.key!r} ambiguous: applied, but not known to be durable at "
            f"{_level(args)} within --timeout; read the key to see what is there"
        ) from None
    except (StatusError, DcpClientError) as exc:
        raise CtlError(f"{op} {args.key!r} failed: {exc}") from None


def _level(args: argparse.Namespace) -> str | None:
    """The level asked for: ``--durability``, or ``--durable`` (persistActive)."""
    return args.durability or ("persistActive" if args.durable else None)


def _result_doc(res: Any) -> dict[str, Any]:
    return {
        "key": res.key.decode("utf-8", "backslashreplace"),
        "vbucket": res.vbucket,
        "cas": res.cas,
        "vb_uuid": res.vb_uuid,
        "seqno": res.seqno,
    }


async def cmd_get(args: argparse.Namespace, out: Output) -> int:
    async def get(kv: KvClient) -> tuple[int, Any]:
        return kv.vbucket_for(args.key), await kv.get(args.key)

    vb, res = await _run(args, "get", get)
    doc = {
        "key": args.key,
        "vbucket": vb,
        "flags": res.flags,
        "cas": res.cas,
        "datatype": res.datatype,
    }
    if out.json_mode:
        out.json({**doc, **value_doc(res.value)})
        return 0
    out.pairs(None, [*doc.items(), ("value", preview(res.value, 0))])
    return 0


async def cmd_set(args: argparse.Namespace, out: Output) -> int:
    res = await _run(
        args,
        "set",
        lambda kv: kv.set(
            args.key, args.value, flags=args.flags, expiry=args.expiry, durability=_level(args)
        ),
    )
    doc = _result_doc(res)
    if out.json_mode:
        out.json(doc)
        return 0
    out.pairs(None, list(doc.items()))
    return 0


async def cmd_delete(args: argparse.Namespace, out: Output) -> int:
    res = await _run(args, "delete", lambda kv: kv.delete(args.key, durability=_level(args)))
    doc = _result_doc(res)
    if out.json_mode:
        out.json(doc)
        return 0
    out.pairs(None, list(doc.items()))
    return 0
