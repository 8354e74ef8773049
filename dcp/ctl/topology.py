"""Which nodes a live dcpctl command talks to: the bootstrap list, the cluster map, and
asking every node at once.

Rules of this module:
- ``--host`` (env DCP_HOST) is a bootstrap list, ``h1:p1,h2:p2`` (a bare host takes
  ``--port``), read by ``dcp.protocol.cluster_config.parse_addresses`` like every other
  client reads one. ``normalize`` runs before the command: ``args.bootstrap`` is the
  list and ``args.host``/``args.port`` its first entry, so single-node code is untouched.
- ``discover`` asks GET_CLUSTER_CONFIG of the bootstrap nodes in order and keeps the
  first config that parses. A malformed config is ignored with a warning on stderr (a
  hostile or broken answer never reroutes anything); UNKNOWN_COMMAND (an older server)
  and ETMPFAIL (a cluster node without a map yet) mean "no config from this one".
- One address and a config naming one server (or none) is a **single node**: the command
  talks to that address exactly as before, never to the config's serverList text.
  Otherwise it is a **cluster**: the nodes are the config's serverList entries (or, with
  no usable config, the bootstrap list itself).
- ``each_node`` asks every node concurrently, each bounded by ``--timeout``. A node that
  does not answer is a result, not an exception: the command shows it as
  ``unreachable: <error>`` and ``finish`` exits ``PARTIAL`` (3). Only when no node
  answers at all is it a plain failure (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from ..protocol import Status
from ..protocol.cluster_config import (
    Address,
    ClusterConfig,
    ConfigError,
    format_address,
    parse_address,
    parse_addresses,
)
from .output import CtlError, Output
from .remote import Remote, error_context, status_name

__all__ = [
    "PARTIAL",
    "NodeAnswers",
    "Topology",
    "discover",
    "each_node",
    "finish",
    "normalize",
    "warn",
]

log = logging.getLogger(__name__)

#: Exit status when the output is partial: some node of the map did not answer.
PARTIAL = 3

T = TypeVar("T")


def warn(text: str) -> None:
    """A warning on stderr (the output on stdout stays clean for scripts)."""
    print(f"dcpctl: warning: {text}", file=sys.stderr, flush=True)


def normalize(args: argparse.Namespace) -> None:
    """Read ``--host`` as a bootstrap list (``args.bootstrap``); ``args.host`` and
    ``args.port`` become its first entry. A malformed list is bad usage (exit 2)."""
    try:
        args.bootstrap = parse_addresses(args.host, args.port)
    except ConfigError as exc:
        raise CtlError(f"--host {args.host!r}: {exc}", code=2) from None
    host, port = args.bootstrap[0]
    if len(args.bootstrap) > 1 and getattr(args, "one_node", False):
        raise CtlError(
            f"{args.command} talks to one node: give --host a single HOST[:PORT]", code=2
        )
    args.host, args.port = host, port


@dataclass
class Topology:
    """What ``discover`` found: the bootstrap list, the config used (if any), which node
    sent it, and whether this is a cluster (see the module rules)."""

    bootstrap: list[Address]
    config: ClusterConfig | None = None
    #: the node whose config is used; the addressed node on a single node
    answered: Address | None = None
    cluster: bool = False
    #: bootstrap nodes that could not be asked, with why
    failed: dict[Address, str] = field(default_factory=dict)

    @property
    def nodes(self) -> list[Address]:
        """The nodes a command aggregates over: the map's servers, else the bootstrap
        list (the addressed node alone on a single node)."""
        if not self.cluster:
            return [self.bootstrap[0]]
        if self.config is not None:
            return list(self.config.servers)
        return list(self.bootstrap)

    @property
    def num_vbuckets(self) -> int | None:
        return self.config.num_vbuckets if self.config is not None else None

    @property
    def default_node(self) -> Address:
        """The node a one-node command asks unless told: the one that answered."""
        return self.answered or self.bootstrap[0]

    def name_of(self, addr: Address) -> str | None:
        return self.config.name_of(addr) if self.config is not None else None

    def label(self, addr: Address) -> str:
        """``n1 (127.0.0.1:11210)``, or the address alone when the node has no name."""
        name = self.name_of(addr)
        where = format_address(addr)
        return f"{name} ({where})" if name and name != where else where

    def find_node(self, text: str) -> Address:
        """``--node NAME|HOST:PORT``: a node of the map by name or address. An address
        the map does not name is used as given (any node can be asked)."""
        if self.config is not None:
            for i, name in enumerate(self.config.names):
                if name == text:
                    return self.config.servers[i]
        try:
            return parse_address(text)
        except ConfigError:
            known = ", ".join(n for n in (self.config.names if self.config else ()) if n)
            raise CtlError(
                f"--node {text!r}: no node of that name"
                + (f" (the map has {known})" if known else "")
                + "; give NAME or HOST:PORT",
                code=2,
            ) from None

    def pick(self, node: str | None, vb: int | None = None) -> Address | None:
        """The node a one-node command asks: ``--node``; else in a cluster ``vb``'s
        active node (or the node that answered); None on a single node (the addressed
        node, as always)."""
        if node:
            return self.find_node(node)
        if not self.cluster:
            return None
        if vb is None or self.config is None:
            return self.default_node
        cfg = self.config
        if vb >= cfg.num_vbuckets:
            raise CtlError(
                f"vbucket {vb} does not exist (the cluster has 0..{cfg.num_vbuckets - 1})"
            )
        active = cfg.active(vb)
        if active is None:
            copies = ", ".join(self.label(a) for a in cfg.replicas(vb)) or "none"
            raise CtlError(
                f"vb {vb} has no active copy in map rev {cfg.rev}; --node picks a copy "
                f"(replicas: {copies})"
            )
        return active

    def role(self, addr: Address, vb: int) -> str:
        """``active``, ``replica`` or ``not in the map`` for ``vb``'s copy on ``addr``."""
        if self.config is None:
            return "unknown"
        if self.config.active(vb) == addr:
            return "active"
        return "replica" if addr in self.config.replicas(vb) else "unmapped"

    def asked(self, addr: Address | None, vb: int | None = None) -> tuple[str, dict[str, Any]]:
        """The title suffix and JSON fields naming the node a one-node command asked
        (nothing when ``addr`` is None: a single node prints as it always did)."""
        if addr is None:
            return "", {}
        role = f", {self.role(addr, vb)} copy" if vb is not None and self.config else ""
        return f"{role} on {self.label(addr)}", self.node_doc(addr)

    @contextlib.contextmanager
    def on_node(self, addr: Address | None) -> Iterator[None]:
        """A one-node command's failure names the node it asked (in a cluster)."""
        try:
            yield
        except CtlError as exc:
            if addr is None:
                raise
            raise CtlError(f"{self.label(addr)}: {exc}", exc.code) from None

    def node_doc(self, addr: Address) -> dict[str, Any]:
        """The ``node`` / ``node_name`` fields JSON rows carry in a cluster."""
        return {"node": format_address(addr), "node_name": self.name_of(addr)}


def _read_config(addr: Address, status: int, value: bytes) -> ClusterConfig | None:
    """The config a node answered, or None (with a warning where it matters)."""
    where = format_address(addr)
    if status == Status.SUCCESS:
        try:
            return ClusterConfig.from_json(value)
        except ConfigError as exc:
            log.warning("ignoring a malformed cluster config from %s: %s", where, exc)
            warn(f"{where} sent a malformed cluster config ({exc}); ignored")
            return None
    if status == Status.ETMPFAIL:
        warn(f"{where} has no cluster map yet ({error_context(value) or 'ETMPFAIL'})")
    elif status not in (Status.UNKNOWN_COMMAND, Status.EACCESS):
        warn(f"{where} answered GET_CLUSTER_CONFIG with {status_name(status)}")
    return None


async def discover(args: argparse.Namespace) -> Topology:
    """The topology for a live command (see the module rules). With one address, an
    unreachable node is the command's own one-line failure, as it always was."""
    bootstrap: list[Address] = getattr(args, "bootstrap", None) or [(args.host, args.port)]
    topo = Topology(bootstrap)
    for addr in bootstrap:
        try:
            async with Remote.of(args, *addr) as r:
                status, value = await r.cluster_config()
        except CtlError as exc:
            if len(bootstrap) == 1:
                raise
            topo.failed[addr] = str(exc)
            continue
        topo.answered = topo.answered or addr
        config = _read_config(addr, status, value)
        if config is not None and len(config.servers) == 1 and config.servers != (addr,):
            # one server: it is the node we reached, whatever its serverList text says
            # (a single node may name 0.0.0.0 or a name we cannot use)
            config = dataclasses.replace(config, servers=(addr,))
        if config is not None:
            topo.config, topo.answered = config, addr
            break
    if topo.answered is None:
        tried = "; ".join(topo.failed.values())
        raise CtlError(f"no node of {len(bootstrap)} answered: {tried}")
    topo.cluster = len(bootstrap) > 1 or (topo.config is not None and len(topo.config.servers) > 1)
    return topo


@dataclass
class NodeAnswers:
    """What ``each_node`` got: per node its result, or why it did not answer."""

    results: dict[Address, Any]
    errors: dict[Address, str]

    def unreachable_docs(self, topo: Topology) -> list[dict[str, Any]]:
        return [{**topo.node_doc(a), "error": e} for a, e in self.errors.items()]

    def print_unreachable(self, out: Output, topo: Topology) -> None:
        for addr, err in self.errors.items():
            out.line(f"{topo.label(addr)} unreachable: {err}")


async def each_node(
    args: argparse.Namespace,
    topo: Topology,
    ask: Callable[[Remote], Awaitable[T]],
    nodes: list[Address] | None = None,
) -> NodeAnswers:
    """``ask(remote)`` on every node (default ``topo.nodes``) at once, each within
    ``--timeout``; results and errors in the nodes' order. No answer at all is a
    ``CtlError`` naming the first node's reason."""
    nodes = topo.nodes if nodes is None else nodes
    results: dict[Address, Any] = {}
    errors: dict[Address, str] = {}

    async def one(addr: Address) -> None:
        try:
            async with Remote.of(args, *addr) as r:
                results[addr] = await ask(r)
        except CtlError as exc:
            errors[addr] = str(exc)

    async with trio.open_nursery() as nursery:
        for addr in nodes:
            nursery.start_soon(one, addr)
    if not results and errors:
        first = next(a for a in nodes if a in errors)
        if len(nodes) == 1:
            raise CtlError(errors[first])
        raise CtlError(f"no node of the map answered ({topo.label(first)}: {errors[first]})")
    order = {a: i for i, a in enumerate(nodes)}
    return NodeAnswers(
        dict(sorted(results.items(), key=lambda kv: order[kv[0]])),
        dict(sorted(errors.items(), key=lambda kv: order[kv[0]])),
    )


def finish(answers: NodeAnswers, topo: Topology) -> int:
    """The exit status of an aggregated command: ``PARTIAL`` with one line on stderr
    when some node did not answer, else 0."""
    if not answers.errors:
        return 0
    n, total = len(answers.errors), len(answers.errors) + len(answers.results)
    print(
        f"dcpctl: partial output: {n} of {total} nodes did not answer "
        f"({', '.join(topo.label(a) for a in answers.errors)})",
        file=sys.stderr,
        flush=True,
    )
    return PARTIAL
