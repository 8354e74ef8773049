"""The vbucket map: which node holds the active copy and the replicas of each vbucket.

Rules of this module:
- Pure: no I/O, no clock. The map is stored in etcd (cluster/store.py) and its etcd
  revision is its epoch; here it is only a value, its JSON form and what clients are sent.
- A map names its servers by node name; a chain is ``[active, replica, ...]`` of
  indexes into ``servers``, always ``num_replicas + 1`` long, -1 where no node holds the
  copy (fewer nodes than copies, or a vbucket left without an active after a failover
  with no replica). The copies of one vbucket are on distinct nodes.
- ``VBucketMap.from_json`` accepts only a well-formed map, and with ``known`` only one
  that names known nodes: anything else is a ``ValueError`` that says what is wrong and
  where, so a bad map in etcd is refused rather than acted on.
- During a rebalance a map carries ``forward`` (Couchbase's ``vBucketMapForward``): per
  vbucket the chain it is moving to, the same shape as ``chains`` (a vbucket not moving
  has its current chain there). Nodes build the copies it names from the current active;
  the orchestrator switches a vbucket to its forward chain once they are built (and its
  active has been taken over). Servers named only by ``forward`` are in ``servers`` too.
- ``compute_map`` and ``moves`` live in cluster/placement.py; ``bucket_config`` builds
  the Couchbase-style bucket config JSON that GET_CLUSTER_CONFIG and NOT_MY_VBUCKET
  carry (the shape clients route with: ``vBucketServerMap.serverList`` and
  ``vBucketMap``, ``nodesExt[].services.kv``, ``rev``).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["VBucketMap", "bucket_config", "split_address"]

#: What this server offers that Couchbase clients check for in a bucket config.
BUCKET_CAPABILITIES = ("dcp", "cbhello", "cccp", "nodesExt")


@dataclass(frozen=True)
class VBucketMap:
    num_vbuckets: int
    num_replicas: int
    servers: tuple[str, ...]
    chains: tuple[tuple[int, ...], ...]
    #: the chains being moved to (a rebalance in flight), else None
    forward: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        _validate(self)
        if self.forward is not None:
            _validate(VBucketMap(self.num_vbuckets, self.num_replicas, self.servers, self.forward))

    @classmethod
    def from_names(
        cls,
        num_replicas: int,
        chains: Sequence[Sequence[str | None]],
        servers: Sequence[str] | None = None,
        forward: Sequence[Sequence[str | None]] | None = None,
    ) -> VBucketMap:
        """A map from chains of node names (None: no node). ``servers``: the server list
        (default: the nodes named, sorted); a node may be listed and hold nothing.
        ``forward``: the chains a rebalance is moving to (see the module rules)."""
        named = [c for c in chains] + (list(forward) if forward is not None else [])
        if servers is None:
            servers = sorted({n for chain in named for n in chain if n is not None})
        index = {n: i for i, n in enumerate(servers)}
        unknown = {n for chain in named for n in chain if n is not None} - index.keys()
        if unknown:
            raise ValueError(f"chains name node(s) not in servers: {', '.join(sorted(unknown))}")
        width = num_replicas + 1

        def indexed(source: Sequence[Sequence[str | None]]) -> tuple[tuple[int, ...], ...]:
            out = []
            for vb, chain in enumerate(source):
                if len(chain) > width:
                    raise ValueError(f"vb {vb}: {len(chain)} copies, more than {width}")
                padded = [index[n] if n is not None else -1 for n in chain]
                out.append(tuple(padded + [-1] * (width - len(padded))))
            return tuple(out)

        fwd = indexed(forward) if forward is not None else None
        if fwd is not None and len(fwd) != len(chains):
            raise ValueError(f"{len(fwd)} forward chains for {len(chains)} vbuckets")
        return cls(len(chains), num_replicas, tuple(servers), indexed(chains), fwd)

    # -- reading ------------------------------------------------------------------------

    def names(self, vb: int) -> tuple[str | None, ...]:
        """The chain of ``vb`` as node names (None: no node)."""
        return tuple(self.servers[i] if i >= 0 else None for i in self.chains[vb])

    def forward_names(self, vb: int) -> tuple[str | None, ...] | None:
        """The chain ``vb`` is moving to, or None when it is not moving."""
        if self.forward is None or self.forward[vb] == self.chains[vb]:
            return None
        return tuple(self.servers[i] if i >= 0 else None for i in self.forward[vb])

    def moving(self) -> list[int]:
        """The vbuckets whose forward chain differs from their chain."""
        if self.forward is None:
            return []
        return [vb for vb in range(self.num_vbuckets) if self.forward[vb] != self.chains[vb]]

    def active(self, vb: int) -> str | None:
        i = self.chains[vb][0]
        return self.servers[i] if i >= 0 else None

    def replicas(self, vb: int) -> list[str]:
        return [self.servers[i] for i in self.chains[vb][1:] if i >= 0]

    def counts(self) -> dict[str, tuple[int, int]]:
        """Per server (actives, replicas) it holds."""
        act = [0] * len(self.servers)
        rep = [0] * len(self.servers)
        for chain in self.chains:
            if chain[0] >= 0:
                act[chain[0]] += 1
            for i in chain[1:]:
                if i >= 0:
                    rep[i] += 1
        return {s: (act[i], rep[i]) for i, s in enumerate(self.servers)}

    def unavailable(self) -> list[int]:
        """The vbuckets that have no active copy."""
        return [vb for vb, chain in enumerate(self.chains) if chain[0] < 0]

    # -- JSON ---------------------------------------------------------------------------

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "numVBuckets": self.num_vbuckets,
            "numReplicas": self.num_replicas,
            "serverList": list(self.servers),
            "vBucketMap": [list(c) for c in self.chains],
        }
        if self.forward is not None:
            doc["vBucketMapForward"] = [list(c) for c in self.forward]
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str, known: Collection[str] | None = None) -> VBucketMap:
        """Decode and validate; with ``known``, every server must be one of those nodes."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"vbucket map is not JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise ValueError("vbucket map must be a JSON object")
        missing = {"numVBuckets", "numReplicas", "serverList", "vBucketMap"} - doc.keys()
        if missing:
            raise ValueError(f"vbucket map lacks {', '.join(sorted(missing))}")
        servers = doc["serverList"]
        chains = doc["vBucketMap"]
        if not isinstance(servers, list) or not all(isinstance(s, str) for s in servers):
            raise ValueError("vbucket map: serverList must be a list of node names")
        if not isinstance(chains, list) or not all(isinstance(c, list) for c in chains):
            raise ValueError("vbucket map: vBucketMap must be a list of chains")
        forward = doc.get("vBucketMapForward")
        if forward is not None and (
            not isinstance(forward, list) or not all(isinstance(c, list) for c in forward)
        ):
            raise ValueError("vbucket map: vBucketMapForward must be a list of chains")
        for vb, chain in enumerate(chains + (forward or [])):
            if not all(type(i) is int for i in chain):
                raise ValueError(f"vbucket map: vb {vb}: chain {chain} holds a non-integer")
        m = cls(
            _int(doc["numVBuckets"], "numVBuckets"),
            _int(doc["numReplicas"], "numReplicas"),
            tuple(servers),
            tuple(tuple(c) for c in chains),
            tuple(tuple(c) for c in forward) if forward is not None else None,
        )
        if known is not None:
            unknown = sorted(set(m.servers) - set(known))
            if unknown:
                raise ValueError(f"vbucket map names unknown node(s): {', '.join(unknown)}")
        return m


def _int(value: Any, field: str) -> int:
    if type(value) is not int:
        raise ValueError(f"vbucket map: {field} must be an integer, not {value!r}")
    return value


def _validate(m: VBucketMap) -> None:
    if m.num_vbuckets < 1:
        raise ValueError(f"vbucket map: numVBuckets must be at least 1, not {m.num_vbuckets}")
    if m.num_replicas < 0:
        raise ValueError(f"vbucket map: numReplicas must be >= 0, not {m.num_replicas}")
    if len(set(m.servers)) != len(m.servers) or not all(m.servers):
        raise ValueError(f"vbucket map: serverList has duplicate or empty names: {m.servers}")
    if len(m.chains) != m.num_vbuckets:
        raise ValueError(f"vbucket map: {len(m.chains)} chains for numVBuckets {m.num_vbuckets}")
    width = m.num_replicas + 1
    for vb, chain in enumerate(m.chains):
        if len(chain) != width:
            raise ValueError(f"vbucket map: vb {vb}: chain {list(chain)} is not {width} long")
        held = [i for i in chain if i != -1]
        if any(not 0 <= i < len(m.servers) for i in held):
            raise ValueError(
                f"vbucket map: vb {vb}: chain {list(chain)} points outside the "
                f"{len(m.servers)} servers"
            )
        if len(set(held)) != len(held):
            raise ValueError(f"vbucket map: vb {vb}: chain {list(chain)} repeats a node")


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) into its parts; ValueError when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"node address must be HOST:PORT, not {address!r}")
    return host.strip("[]"), int(port)


def bucket_config(
    vbmap: VBucketMap,
    addresses: Mapping[str, str],
    rev: int,
    this_node: str | None,
    *,
    bucket: str = "default",
    bucket_uuid: str = "",
) -> dict[str, Any]:
    """The bucket config clients are given, for ``json.dumps``.

    ``addresses`` maps every server of the map to its advertised ``HOST:PORT`` (nodes that
    are down stay in the map until failed over, so the caller keeps their addresses);
    ``rev`` is the map's epoch (its etcd revision); ``this_node`` is marked
    ``thisNode`` in ``nodesExt``. ``nodes`` and ``nodesExt`` list the servers in the
    order of ``serverList``, as clients expect.
    """
    missing = [s for s in vbmap.servers if s not in addresses]
    if missing:
        raise ValueError(f"no address for map server(s): {', '.join(missing)}")
    hosts = [split_address(addresses[s]) for s in vbmap.servers]
    nodes_ext = []
    for name, (host, port) in zip(vbmap.servers, hosts, strict=True):
        ext: dict[str, Any] = {"hostname": host, "services": {"kv": port}, "nodeName": name}
        if name == this_node:
            ext["thisNode"] = True
        nodes_ext.append(ext)
    return {
        "rev": rev,
        "revEpoch": 1,
        "name": bucket,
        "uuid": bucket_uuid,
        "nodeLocator": "vbucket",
        "bucketType": "membase",
        "numVBuckets": vbmap.num_vbuckets,
        "collectionsManifestUid": "0",
        "bucketCapabilitiesVer": "",
        "bucketCapabilities": list(BUCKET_CAPABILITIES),
        "nodes": [
            {"hostname": addresses[s], "ports": {"direct": port}}
            for s, (_h, port) in zip(vbmap.servers, hosts, strict=True)
        ],
        "nodesExt": nodes_ext,
        "vBucketServerMap": {
            "hashAlgorithm": "CRC",
            "numReplicas": vbmap.num_replicas,
            "serverList": [addresses[s] for s in vbmap.servers],
            "vBucketMap": [list(c) for c in vbmap.chains],
            **(
                {"vBucketMapForward": [list(c) for c in vbmap.forward]}
                if vbmap.forward is not None
                else {}
            ),
        },
        "clusterCapabilitiesVer": [1, 0],
        "clusterCapabilities": {},
    }
