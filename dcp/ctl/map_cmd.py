"""``dcpctl map``: the cluster map as the nodes serve it to clients, without etcd.

Rules of this module:
- Read-only, GET_CLUSTER_CONFIG only (protocol_spec/README.md §6.9): the same config every
  client routes with, so an operator sees what the clients see. ``dcpctl cluster``
  (``cluster_cmd.py``) is the etcd side and needs etcd access; this needs none.
- Every node of the map and every node of the bootstrap list is asked at once, each
  within ``--timeout``. The map shown is the newest that parses (``newer_than``: a stale
  node never hides a newer map); each node's own revision is shown next to it, so a node
  that has not caught up stands out. A malformed config is ignored with a warning.
- A node of the map that does not answer is a row ``unreachable: <error>`` and exit
  status 3 (partial: what it serves is unknown). A bootstrap node the map no longer names
  (a failed-over node) is a row ``not in the map``, reachable or not; it does not make
  the output partial, as the map is complete without it.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..protocol import Status
from ..protocol.cluster_config import Address, ClusterConfig, ConfigError, format_address
from .args import ranges_text
from .output import CtlError, Output
from .remote import status_name
from .topology import NodeAnswers, discover, each_node, finish, warn

__all__ = ["cmd_map", "map_document"]


def _configs(answers: NodeAnswers) -> dict[Address, ClusterConfig | str]:
    """Per answering node: its config, or why it gave none."""
    out: dict[Address, ClusterConfig | str] = {}
    for addr, (status, value) in answers.results.items():
        if status != Status.SUCCESS:
            out[addr] = f"no map ({status_name(status)})"
            continue
        try:
            out[addr] = ClusterConfig.from_json(value)
        except ConfigError as exc:
            warn(f"{format_address(addr)} sent a malformed cluster config ({exc}); ignored")
            out[addr] = "malformed config (ignored)"
    return out


def map_document(
    cfg: ClusterConfig,
    source: Address,
    served: dict[Address, ClusterConfig | str],
    errors: dict[Address, str],
    bootstrap: list[Address],
) -> dict[str, Any]:
    """The map and each node's view of it, as the JSON document (and the table's rows);
    ``bootstrap`` nodes the map does not name get rows too."""
    nodes: list[dict[str, Any]] = []
    extra = [a for a in bootstrap if a not in cfg.servers]
    for i, addr in enumerate([*cfg.servers, *extra]):
        in_map = i < len(cfg.servers)
        got = served.get(addr)
        own = got if isinstance(got, ClusterConfig) else None
        name = cfg.name_of(addr) if in_map else (own.name_of(addr) if own else None)
        nodes.append(
            {
                "node": format_address(addr),
                "node_name": name,
                "in_map": in_map,
                "actives": [vb for vb in range(cfg.num_vbuckets) if cfg.active(vb) == addr],
                "replicas": [vb for vb in range(cfg.num_vbuckets) if addr in cfg.replicas(vb)],
                "reachable": addr not in errors,
                "rev": own.rev if own else None,
                "error": errors.get(addr) or (got if isinstance(got, str) else None),
            }
        )
    moving = []
    if cfg.forward is not None:
        moving = [vb for vb in range(cfg.num_vbuckets) if cfg.forward[vb] != cfg.chains[vb]]
    return {
        "rev": cfg.rev,
        "from": format_address(source),
        "num_vbuckets": cfg.num_vbuckets,
        "num_replicas": cfg.num_replicas,
        "nodes": nodes,
        "without_active": cfg.without_active(),
        "moving": moving,
    }


def _status(node: dict[str, Any], rev: int) -> str:
    where = "" if node["in_map"] else "not in the map; "
    if not node["reachable"]:
        return f"{where}unreachable: {node['error']}"
    if node["rev"] is None:
        return f"{where}{node['error']}"
    if node["rev"] < rev:
        return f"{where}serves rev {node['rev']} (older)"
    return f"{where}serves rev {node['rev']}"


async def cmd_map(args: argparse.Namespace, out: Output) -> int:
    topo = await discover(args)
    if topo.config is None:
        raise CtlError(
            f"{topo.label(topo.default_node)} serves no cluster map (GET_CLUSTER_CONFIG): "
            "an older server, or a cluster node that has no map yet"
        )
    cfg, source = topo.config, topo.default_node
    if topo.cluster:
        nodes = list(dict.fromkeys([*cfg.servers, *topo.bootstrap]))
        answers = await each_node(args, topo, lambda r: r.cluster_config(), nodes=nodes)
        served = _configs(answers)
        for addr, got in served.items():
            if isinstance(got, ClusterConfig) and got.newer_than(cfg):
                cfg, source = got, addr
        topo.config = cfg  # names and labels from the map shown
        bootstrap = topo.bootstrap
    else:  # one node: its serverList text may not be an address we can use (§6.9)
        answers = NodeAnswers({cfg.servers[0]: None}, {})
        served, bootstrap = {cfg.servers[0]: cfg}, []
    doc = map_document(cfg, source, served, answers.errors, bootstrap)
    in_map = NodeAnswers(
        {a: r for a, r in answers.results.items() if a in cfg.servers},
        {a: e for a, e in answers.errors.items() if a in cfg.servers},
    )
    if out.json_mode:
        out.json(doc)
        return finish(in_map, topo)
    out.line(
        f"map rev {cfg.rev} from {topo.label(source)}: {len(cfg.servers)} nodes, "
        f"{cfg.num_vbuckets} vbuckets, {cfg.num_replicas} "
        f"replica{'' if cfg.num_replicas == 1 else 's'} per vbucket"
    )
    out.table(
        None,
        ["node", "address", "active", "replica", "active vbuckets", "status"],
        [
            [
                n["node_name"] or "-",
                n["node"],
                len(n["actives"]) if n["in_map"] else None,
                len(n["replicas"]) if n["in_map"] else None,
                ranges_text(n["actives"]) if n["in_map"] else None,
                _status(n, cfg.rev),
            ]
            for n in doc["nodes"]
        ],
        numeric=["active", "replica"],
    )
    if doc["without_active"]:
        out.line(f"vbuckets without an active copy: {ranges_text(doc['without_active'])}")
    if doc["moving"]:
        out.line(f"moving (rebalance in progress): {len(doc['moving'])} vbuckets")
    return finish(in_map, topo)
