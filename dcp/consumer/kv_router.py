"""Where ``KvClient`` sends each vbucket: the bootstrap list and the cluster map it follows.

Rules of this module:
- Pure: no I/O. ``kv_nodes.py`` fetches configs and feeds them in; ``kv_execute.py``
  asks ``group`` where each pending operation goes.
- Single mode: one bootstrap address and a config naming one server that is the node
  which sent it (``thisNode``, or a config made up for a server that does not know
  GET_CLUSTER_CONFIG). Every vbucket then goes to the bootstrap address itself, never to
  the config's serverList text (a single server may advertise 0.0.0.0 or a name the
  client cannot reach): exactly what a one-node client always did.
- Cluster mode otherwise: a vbucket goes to the serverList entry of its active; a
  vbucket without an active (-1) has no node (``group`` puts it under None, and the
  caller waits for a newer map).
- Pinned (the client was given a ``connector``): single mode for good; the configs
  NOT_MY_VBUCKET answers carry are not read.
- A config replaces the current one only when it is newer (``ClusterConfig.newer_than``)
  and has the same vbucket count (keys were already hashed with it). A malformed config,
  or one that cannot be used, is ignored with a logged warning: the old map is kept.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from dcp.protocol.cluster_config import Address, ClusterConfig, ConfigError, format_address

from .errors import UsageError
from .kv_connection import Op

__all__ = ["KvRouter", "NoActive"]

log = logging.getLogger(__name__)

#: The key ``group`` files vbuckets without an active node under.
NoActive = None


class KvRouter:
    """The current map and the node of each vbucket (see the module rules)."""

    def __init__(
        self, bootstrap: Sequence[Address], num_vbuckets: int | None, *, pinned: bool = False
    ) -> None:
        self.bootstrap = list(bootstrap)
        #: pinned to the first bootstrap address: configs in answers are not followed
        self.pinned = pinned
        #: the count the caller asked for (None: the config's)
        self.wanted_vbuckets = num_vbuckets
        self.num_vbuckets = num_vbuckets or 1024
        self.config: ClusterConfig | None = None
        #: single mode: the one address every vbucket goes to (else None)
        self.single: Address | None = None
        #: cluster mode: the active's address per vbucket (None: no active)
        self.nodes: list[Address | None] = []

    # ------------------------------------------------------------------ configs

    def made_up(self, addr: Address) -> ClusterConfig:
        """The config of a server that has none to give (UNKNOWN_COMMAND): one node,
        rev 0, the vbucket count the caller gave (or the default)."""
        cfg = ClusterConfig.single(addr, self.num_vbuckets)
        return dataclasses.replace(cfg, this_node=addr)

    def check_first(self, config: ClusterConfig) -> None:
        """``UsageError`` when the caller's ``num_vbuckets`` contradicts the first config:
        every key would go to the wrong vbucket."""
        want = self.wanted_vbuckets
        if want is not None and want != config.num_vbuckets:
            raise UsageError(
                f"num_vbuckets={want} but the server's config has {config.num_vbuckets} "
                "vbuckets: leave num_vbuckets out to use the server's"
            )

    def adopt(self, config: ClusterConfig) -> bool:
        """Route with ``config`` if it is newer than the current one; True if it was."""
        current = self.config
        if not config.newer_than(current):
            return False
        if current is not None and config.num_vbuckets != current.num_vbuckets:
            log.warning(
                "ignoring cluster config rev %d: %d vbuckets, the client routes with %d",
                config.rev,
                config.num_vbuckets,
                current.num_vbuckets,
            )
            return False
        self.config = config
        self.num_vbuckets = config.num_vbuckets
        if (
            len(self.bootstrap) == 1
            and len(config.servers) == 1
            and config.this_node == config.servers[0]
        ):
            self.single = self.bootstrap[0]
            self.nodes = []
        else:
            self.single = None
            self.nodes = [config.active(vb) for vb in range(config.num_vbuckets)]
        return True

    def from_answer(self, value: bytes, where: Address | None = None) -> ClusterConfig | None:
        """The config a NOT_MY_VBUCKET answer carries (None: it carries none, or a
        malformed one, which is logged). A single server's answer is an error context,
        not a config: only a value that claims to be one (an object with a ``rev``) is
        parsed, so ordinary answers log nothing."""
        if self.pinned or not value.startswith(b"{") or b'"rev"' not in value:
            return None
        try:
            return ClusterConfig.from_json(value)
        except ConfigError as exc:
            at = f" from {format_address(where)}" if where else ""
            log.warning("ignoring a malformed cluster config%s: %s", at, exc)
            return None

    # ------------------------------------------------------------------ routing

    def node_of(self, vb: int) -> Address | None:
        if self.single is not None:
            return self.single
        return self.nodes[vb] if vb < len(self.nodes) else None

    def group(self, ops: Sequence[Op], pending: list[int]) -> dict[Address | None, list[int]]:
        """``pending`` (indexes into ``ops``) by the node each one's vbucket goes to;
        those without an active under ``NoActive``. Order within a node is kept."""
        if self.single is not None:
            return {self.single: pending}
        nodes = self.nodes
        out: dict[Address | None, list[int]] = {}
        for i in pending:
            node = nodes[ops[i].vbucket]
            idxs = out.get(node)
            if idxs is None:
                out[node] = [i]
            else:
                idxs.append(i)
        return out

    def addresses(self) -> list[Address]:
        """Every node worth asking for a config: the map's, then the bootstrap list's."""
        out = list(self.config.servers) if self.config and self.single is None else []
        out += [a for a in self.bootstrap if a not in out]
        return out
