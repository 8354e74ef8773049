"""Where vbuckets live, as clients see it: bootstrap address lists and the bucket config a
node sends (GET_CLUSTER_CONFIG, and the value of a NOT_MY_VBUCKET answer in a cluster).

Rules of this module:
- Pure: no I/O. Every client (the SDK's ``DcpClient`` and ``KvClient``, the Spark
  connector, ``dcpctl``) routes with ``ClusterConfig`` so they agree on one reading of
  protocol_spec/README.md §6.9.
- Parsing is strict: anything that is not the shape §6.9 describes (a field missing or of
  the wrong type, a chain naming a server index that does not exist, a vbucket count that
  is not a power of two, a map whose length is not that count) raises ``ConfigError`` with
  what was wrong. A client that gets one keeps the map it had and logs a warning: a
  malformed or hostile answer must never reroute anything.
- A node is named by its address, ``(host, port)``; a config replaces another only when
  its ``rev`` is higher (``newer_than``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Address",
    "ClusterConfig",
    "ConfigError",
    "format_address",
    "parse_address",
    "parse_addresses",
]

#: A node: (host, port).
Address = tuple[str, int]
#: Bound on a config's size a client will parse (a 1024-vbucket map of 100 nodes is ~40 KB).
MAX_CONFIG_BYTES = 16 * 1024 * 1024


class ConfigError(ValueError):
    """A bucket config or an address list that cannot be used (the message says why)."""


def parse_address(text: str, default_port: int | None = None) -> Address:
    """``HOST:PORT``, ``[V6]:PORT`` or (with ``default_port``) a bare ``HOST``."""
    text = text.strip()
    if not text:
        raise ConfigError("empty address")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not host:
            raise ConfigError(f"address must be HOST:PORT, not {text!r}")
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            raise ConfigError(f"address must be HOST:PORT, not {text!r}")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:  # a bare host (an IPv6 literal without brackets has several colons)
        host, port_text = text, None
    if port_text is None:
        if default_port is None:
            raise ConfigError(f"address must be HOST:PORT, not {text!r}")
        port = default_port
    elif port_text.isdigit():
        port = int(port_text)
    else:
        raise ConfigError(f"port of {text!r} is not a number")
    if not host or not 0 < port < 65536:
        raise ConfigError(f"address must be HOST:PORT with a port in 1..65535, not {text!r}")
    return host, port


def parse_addresses(
    hosts: str | Address | Iterable[str | Address], default_port: int | None = None
) -> list[Address]:
    """A bootstrap list: ``"h1:p1,h2:p2"``, one ``(host, port)``, or an iterable of either.

    Duplicates are dropped (the first wins the order). Raises ``ConfigError`` when the list
    is empty or an entry is malformed.
    """
    entries: list[str | Address]
    if isinstance(hosts, str):
        entries = [h for h in hosts.split(",") if h.strip()]
    elif isinstance(hosts, tuple) and len(hosts) == 2 and isinstance(hosts[1], int):
        entries = [hosts]  # one (host, port) pair
    else:
        entries = list(hosts)
    out: list[Address] = []
    for e in entries:
        if isinstance(e, str):
            addr = parse_address(e, default_port)
        elif (
            isinstance(e, (tuple, list))
            and len(e) == 2
            and isinstance(e[0], str)
            and type(e[1]) is int
        ):
            addr = (e[0].strip().strip("[]"), e[1])
            if not addr[0] or not 0 < addr[1] < 65536:
                raise ConfigError(f"address must be (host, port in 1..65535), not {e!r}")
        else:
            raise ConfigError(f"an address is 'HOST:PORT' or (host, port), not {e!r}")
        if addr not in out:
            out.append(addr)
    if not out:
        raise ConfigError("no address given")
    return out


def format_address(addr: Address) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _chains(raw: Any, what: str, n_vbs: int, n_servers: int) -> tuple[tuple[int, ...], ...]:
    if not isinstance(raw, list) or len(raw) != n_vbs:
        raise ConfigError(f"{what} must be a list of {n_vbs} chains")
    out = []
    for vb, chain in enumerate(raw):
        if not isinstance(chain, list) or not chain:
            raise ConfigError(f"{what}[{vb}] must be a non-empty list of server indexes")
        for i in chain:
            if type(i) is not int or not -1 <= i < n_servers:
                raise ConfigError(f"{what}[{vb}] names server index {i!r}, not in serverList")
        out.append(tuple(chain))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """One bucket config: which node holds each vbucket's active and replica copies."""

    rev: int
    servers: tuple[Address, ...]
    #: per vbucket: indexes into ``servers``, active first, then replicas; -1 = no copy
    chains: tuple[tuple[int, ...], ...]
    #: while a rebalance moves vbuckets: the chains they move to (else None)
    forward: tuple[tuple[int, ...], ...] | None = None
    num_replicas: int = 0
    #: the node that sent this config, when it said so (``nodesExt[].thisNode``)
    this_node: Address | None = None
    #: the node names (``nodesExt[].nodeName``) by server index, when given
    names: tuple[str | None, ...] = field(default=())

    @property
    def num_vbuckets(self) -> int:
        return len(self.chains)

    @classmethod
    def from_json(cls, data: bytes | bytearray | str | Mapping[str, Any]) -> ClusterConfig:
        """Parse a bucket config (the JSON text or its decoded object); ``ConfigError``
        when it is malformed."""
        if isinstance(data, Mapping):
            obj: Any = data
        else:
            if len(data) > MAX_CONFIG_BYTES:
                raise ConfigError(f"config of {len(data)} bytes is over {MAX_CONFIG_BYTES}")
            try:
                obj = json.loads(data)
            except (ValueError, UnicodeDecodeError) as exc:
                raise ConfigError(f"config is not JSON: {exc}") from None
        if not isinstance(obj, Mapping):
            raise ConfigError("config must be a JSON object")
        rev = obj.get("rev")
        if type(rev) is not int or rev < 0:
            raise ConfigError(f"config rev must be a non-negative integer, not {rev!r}")
        smap = obj.get("vBucketServerMap")
        if not isinstance(smap, Mapping):
            raise ConfigError("config has no vBucketServerMap object")
        server_list = smap.get("serverList")
        if not isinstance(server_list, list) or not server_list:
            raise ConfigError("vBucketServerMap.serverList must be a non-empty list")
        servers = []
        for s in server_list:
            if not isinstance(s, str):
                raise ConfigError(f"serverList entry {s!r} is not a HOST:PORT string")
            servers.append(parse_address(s))
        n_vbs = obj.get("numVBuckets", len(smap.get("vBucketMap") or ()))
        if type(n_vbs) is not int or n_vbs <= 0 or n_vbs & (n_vbs - 1):
            raise ConfigError(f"numVBuckets must be a power of two, not {n_vbs!r}")
        chains = _chains(smap.get("vBucketMap"), "vBucketMap", n_vbs, len(servers))
        fwd_raw = smap.get("vBucketMapForward")
        forward = (
            _chains(fwd_raw, "vBucketMapForward", n_vbs, len(servers))
            if fwd_raw is not None
            else None
        )
        replicas = smap.get("numReplicas", 0)
        if type(replicas) is not int or replicas < 0:
            raise ConfigError(f"numReplicas must be a non-negative integer, not {replicas!r}")
        this_node: Address | None = None
        names: list[str | None] = []
        ext = obj.get("nodesExt")
        if isinstance(ext, list) and len(ext) == len(servers):
            for addr, e in zip(servers, ext, strict=True):
                name = e.get("nodeName") if isinstance(e, Mapping) else None
                names.append(name if isinstance(name, str) else None)
                if isinstance(e, Mapping) and e.get("thisNode") is True:
                    this_node = addr
        return cls(rev, tuple(servers), chains, forward, replicas, this_node, tuple(names))

    @classmethod
    def single(cls, addr: Address, num_vbuckets: int) -> ClusterConfig:
        """A one-node map (rev 0): what a client assumes before it has asked."""
        return cls(0, (addr,), tuple((0,) for _ in range(num_vbuckets)))

    def is_lone(self) -> bool:
        """A server outside any cluster: one server, rev 1 or less (a cluster's map has its
        etcd revision, always higher)."""
        return len(self.servers) == 1 and self.rev <= 1

    def seen_from(self, addr: Address) -> ClusterConfig:
        """This config as routed by a client that reached its sender at ``addr``.

        A lone server names itself by its configured ``HOST:PORT``, which may be 0.0.0.0
        or a name the client cannot resolve, so every client routes a lone server's
        vbuckets to the address that answered; a cluster's map is used as given (its
        nodes advertise addresses meant for clients)."""
        if not self.is_lone() or self.servers[0] == addr:
            return self
        return ClusterConfig(
            self.rev, (addr,), self.chains, self.forward, self.num_replicas, addr, self.names
        )

    # ------------------------------------------------------------------ queries

    def newer_than(self, other: ClusterConfig | None) -> bool:
        return other is None or self.rev > other.rev

    def active(self, vb: int) -> Address | None:
        """The node holding ``vb``'s active copy (None: no active now)."""
        i = self.chains[vb][0]
        return self.servers[i] if i >= 0 else None

    def replicas(self, vb: int) -> list[Address]:
        """The nodes holding ``vb``'s replica copies, in chain order."""
        return [self.servers[i] for i in self.chains[vb][1:] if i >= 0]

    def actives_by_node(self, vbuckets: Iterable[int] | None = None) -> dict[Address, list[int]]:
        """Node -> the vbuckets (of ``vbuckets``, default all) it holds active, ascending;
        vbuckets without an active are left out."""
        out: dict[Address, list[int]] = {}
        vbs = range(self.num_vbuckets) if vbuckets is None else sorted(vbuckets)
        for vb in vbs:
            node = self.active(vb)
            if node is not None:
                out.setdefault(node, []).append(vb)
        return out

    def without_active(self, vbuckets: Iterable[int] | None = None) -> list[int]:
        vbs = range(self.num_vbuckets) if vbuckets is None else vbuckets
        return [vb for vb in vbs if self.chains[vb][0] < 0]

    def name_of(self, addr: Address) -> str | None:
        """The node name of ``addr`` (``nodesExt[].nodeName``), if the config gave it."""
        try:
            i = self.servers.index(addr)
        except ValueError:
            return None
        return self.names[i] if i < len(self.names) else None

    def describe(self, addrs: Sequence[Address] | None = None) -> str:
        """``h:p, h:p`` of ``addrs`` (default every server), for messages."""
        return ", ".join(format_address(a) for a in (addrs or self.servers))
