"""ClusterAgent: one node's part in the cluster — it joins, follows the map, holds what the
map gives it, fences itself when its lease may lapse, and runs the orchestrator while it
holds that office.

Rules of this module:
- The one bridge between the cluster package and the server: ``DcpServer.run`` builds
  the agent when ``cluster`` is set and starts ``run`` before it accepts a connection.
  ``run`` joins first (``JoinRefused`` and ``StoreUnavailable`` propagate: the server
  refuses to start; after an unclean shutdown the join may first wait to be failed
  over, cluster/rejoin.py, and a node that waited reconciles with the map it last read
  before the server serves), then reports started and runs, until cancelled: membership
  (cluster/membership.py; the agent is its ``NodeHooks``), the follower of the whole
  cluster prefix, and the campaign for orchestrator.
- The follower reads ``/dcp/<cluster>/`` every ``interval`` (one range read: the map,
  the members' addresses, the live nodes). A new map (or a member's new address) is
  reconciled into ``VBucketStates`` in one batch (cluster/reconcile.py has the rules),
  and so is the same map every ``DRIFT_TICKS`` reads: states changed outside the map,
  or a vbucket a change skipped while it rolled back, are put right without waiting for
  the next map. Each new map's chains and forward chains go to the durability monitor
  (``server.durability.set_topology``: majority durability counts them). A map that
  does not decode, or is for another vbucket count, is logged and ignored. etcd away:
  the last map stays in force and the lease decides whether writes continue
  (membership's fencing).
- The write gate: ``writes_allowed()`` is false while membership says the lease may
  have lapsed, and until the node has read a map that names it (a node never placed,
  or one that may have been failed over while away, takes no write). The KV write
  paths call it synchronously on each request (kv_handlers.py): a process frozen by
  SIGSTOP may serve a request before any task of its runs again.
- Fencing (``fence``): the gate closes at once (writes: ETMPFAIL, retry); the
  orchestrator, if this node runs it, is cancelled. The vbuckets keep their states: a
  fence is a precaution, not a decision (only the map decides who is active), and
  turning actives pending would end every stream and, on the way back, start a new
  history branch per vbucket for each etcd hiccup. ``restored``: the gate opens again.
  ``rejoined`` (the lease lapsed: the node may have been failed
  over): stay fenced until a read shows the new registration, then ``resume`` and
  reconcile with the map of that read.
- The orchestrator (cluster/orchestrator.py) runs only while this node holds the office
  (cluster/election.py) under its current lease, in a cancel scope of its own: it ends
  when the term is lost, the node fences or leaves. A term that survived a fence (the
  lease was kept) is taken up again rather than waited out. Tests inject
  ``run_orchestrator`` (a fake, or None for no orchestration).
- ``config_json`` is the bucket config of the last map (cluster/vbmap.py
  ``bucket_config``), built once per change: GET_CLUSTER_CONFIG and NOT_MY_VBUCKET
  answers send these bytes as they are.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from .election import Election, Leadership, map_key
from .membership import JoinRefused, Membership, NodeRecord, cluster_prefix
from .reconcile import desired_assignment
from .rejoin import UncleanRejoin
from .store import LeaseExpired, Snapshot, StoreUnavailable
from .vbmap import VBucketMap, bucket_config, split_address

if TYPE_CHECKING:
    from ..server import DcpServer
    from .store import EtcdStore

__all__ = ["ClusterAgent", "JoinRefused", "RunOrchestrator"]

#: every how many reads of etcd the node reconciles even without a map change: what a
#: map change could not apply (a vbucket that was rolling back) or what changed its
#: states outside the map (a stale SET_VBUCKET_STATE) is put right within about a second
DRIFT_TICKS = 4

log = logging.getLogger("dcp.cluster")

#: Runs the orchestrator for one term until cancelled (or returns when the term is lost).
RunOrchestrator = Callable[[Leadership], Awaitable[None]]

_DEFAULT: Any = object()


class ClusterAgent:
    """See the module rules."""

    def __init__(
        self,
        server: DcpServer,
        store: EtcdStore,
        *,
        interval: float = 0.25,
        run_orchestrator: RunOrchestrator | None = _DEFAULT,
    ) -> None:
        cfg = server.config
        self.server = server
        self.store = store
        self.interval = interval
        self.cluster = cfg.cluster_name
        self.node_name = cfg.node_name
        self.address = cfg.advertise or f"{cfg.host}:{server.port}"
        self.membership = Membership(
            store,
            self,
            cluster=self.cluster,
            node_name=self.node_name,
            address=self.address,
            num_vbuckets=cfg.num_vbuckets,
            data_dir=cfg.data_dir,
            lease_ttl=cfg.cluster_lease_ttl,
        )
        self.rejoin = UncleanRejoin(
            store,
            cluster=self.cluster,
            node_name=self.node_name,
            data_dir=cfg.data_dir,
            unclean=server.bucket.warmup_unclean,
            limit=cfg.rejoin_wait(),
            interval=interval,
        )
        self._run_orchestrator: RunOrchestrator | None = (
            self._default_orchestrator if run_orchestrator is _DEFAULT else run_orchestrator
        )
        self.prefix = cluster_prefix(self.cluster)
        #: the last map read (None: none yet) and its mod revision (its epoch)
        self.vbmap: VBucketMap | None = None
        self.revision = 0
        #: node name -> "HOST:PORT" of every member (the roster, and live nodes)
        self.addresses: dict[str, str] = {}
        #: names of the nodes whose lease is alive (``nodes/<name>``)
        self.live: set[str] = set()
        self.leadership: Leadership | None = None
        self.etcd_reachable = False
        self._named = False
        self._awaiting_map = False
        self._ticks = 0
        self._leaving = False
        self._config = b""
        self._config_key: tuple[int, tuple[tuple[str, str], ...]] | None = None
        self._bad_map_revision = 0
        self._bad_records: set[tuple[str, int]] = set()
        self._lead_scope: trio.CancelScope | None = None

    # ------------------------------------------------------------------ the gate

    def writes_allowed(self) -> bool:
        """May an active vbucket of this node take a write now? (See the module rules.)"""
        return self._named and self.membership.writes_allowed()

    @property
    def fenced(self) -> bool:
        return self.membership.fenced

    def config_json(self) -> bytes:
        """The bucket config of the last map (b"" before the first map)."""
        return self._config

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Join, then follow the cluster and take part in it until cancelled."""
        record = await self.membership.join(hold=self.rejoin.hold)
        if self.rejoin.read is not None:  # it waited: hold what the map says before serving
            self.take(self.rejoin.read)
        log.info(
            "joined cluster %s as %s at %s (etcd %s)",
            self.cluster,
            self.node_name,
            self.address,
            self.store.endpoint,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(self.membership.run)
            nursery.start_soon(self._follow)
            if self._run_orchestrator is not None:
                nursery.start_soon(self._lead, record)
            task_status.started()

    async def leave(self) -> None:
        """A graceful stop: give up the office and revoke the lease, so the node key goes
        at once (the orchestrator sees the node gone without waiting for its TTL)."""
        self._leaving = True
        if self._lead_scope is not None:
            self._lead_scope.cancel()
        with trio.move_on_after(5):
            await self.membership.leave()

    # ------------------------------------------------------------------ following

    async def _follow(self) -> None:
        failures = 0
        while True:
            try:
                snap = await self.store.get_prefix(self.prefix)
            except StoreUnavailable as exc:
                failures += 1
                self.etcd_reachable = False
                if failures == 1 or failures % 40 == 0:
                    log.warning(
                        "cluster: etcd unreachable, keeping map rev %d: %s", self.revision, exc
                    )
                await trio.sleep(self.interval)
                continue
            if failures:
                log.info("cluster: etcd answers again after %d failed reads", failures)
                failures = 0
            self.etcd_reachable = True
            self.take(snap)
            await trio.sleep(self.interval)

    def take(self, snap: Snapshot) -> None:
        """Act on one read of the cluster prefix (public for tests)."""
        addresses: dict[str, str] = {}
        live: set[str] = set()
        for kind in ("members/", "nodes/"):  # a live node's record is the newest
            start = self.prefix + kind
            for key, entry in snap.entries.items():
                if not key.startswith(start):
                    continue
                try:
                    record = NodeRecord.from_json(entry.value)
                    split_address(record.address)
                except (ValueError, TypeError, KeyError) as exc:
                    if (key, entry.mod_revision) not in self._bad_records:
                        self._bad_records.add((key, entry.mod_revision))
                        log.warning("cluster: ignoring malformed %s: %s", key, exc)
                    continue
                addresses[record.name] = record.address
                if kind == "nodes/":
                    live.add(record.name)
        self.live = live
        changed = addresses != self.addresses
        self.addresses = addresses
        stored = snap.entries.get(map_key(self.cluster))
        if stored is not None and stored.mod_revision != self.revision:
            changed |= self._read_map(stored.value, stored.mod_revision)
        if changed:
            self._refresh_config()
        if self._awaiting_map:
            mine = snap.entries.get(f"{self.prefix}nodes/{self.node_name}")
            # a read from before the new registration could predate a failover of this node
            if mine is None or mine.lease != self.membership.lease or not self.membership.resume():
                return
            self._awaiting_map = False
            log.warning("cluster: %s resumes with map rev %d", self.node_name, self.revision)
            changed = True
        self._ticks += 1
        if changed or self._ticks % DRIFT_TICKS == 0:
            self.reconcile()

    def _read_map(self, value: bytes, revision: int) -> bool:
        if revision == self._bad_map_revision:
            return False
        try:
            vbmap = VBucketMap.from_json(value)
            if vbmap.num_vbuckets != self.server.bucket.num_vbuckets:
                raise ValueError(
                    f"{vbmap.num_vbuckets} vbuckets, this node has "
                    f"{self.server.bucket.num_vbuckets}"
                )
        except ValueError as exc:
            self._bad_map_revision = revision
            log.error(
                "cluster: ignoring map rev %d, keeping rev %d: %s", revision, self.revision, exc
            )
            return False
        if self.revision:
            log.info("cluster: map rev %d -> %d", self.revision, revision)
        else:
            log.info("cluster: map rev %d", revision)
        self.vbmap, self.revision = vbmap, revision
        # the chains by node name, and the ones vbuckets move to: what majority
        # durability counts (durability.py)
        vbs = range(vbmap.num_vbuckets)
        self.server.durability.set_topology(
            [vbmap.names(vb) for vb in vbs],
            [vbmap.forward_names(vb) for vb in vbs] if vbmap.forward is not None else None,
        )
        return True

    def _refresh_config(self) -> None:
        vbmap = self.vbmap
        if vbmap is None:
            return
        named = {s: self.addresses[s] for s in vbmap.servers if s in self.addresses}
        key = (self.revision, tuple(sorted(named.items())))
        if key == self._config_key:
            return
        missing = [s for s in vbmap.servers if s not in named]
        if missing:  # a map server removed from members: keep what clients had
            log.warning("cluster: no address for %s; config not updated", ", ".join(missing))
            return
        doc = bucket_config(vbmap, named, self.revision, self.node_name)
        self._config = json.dumps(doc, separators=(",", ":")).encode()
        self._config_key = key

    def reconcile(self) -> int:
        """Make this node's vbuckets follow the last map (one batch); returns how many
        changed. Nothing before the first map, nor while waiting for a fresh one."""
        vbmap = self.vbmap
        self._named = vbmap is not None and self.node_name in vbmap.servers
        if vbmap is None or self._awaiting_map or self._leaving:
            return 0
        states = self.server.vbucket_states
        want = desired_assignment(
            vbmap,
            self.node_name,
            self.addresses,
            states.state,
            states.assignment,
        )
        changed = states.assign(want)
        if changed:
            log.info("cluster: map rev %d changed %d vbuckets here", self.revision, changed)
        self.server.durability.recheck()  # acks held back while fenced may count now
        return changed

    # ------------------------------------------------------------------ NodeHooks

    def fence(self, reason: str) -> None:
        """The gate is closed already (membership); stop orchestrating. States stay."""
        if self._lead_scope is not None:
            self._lead_scope.cancel()
        if not self._leaving:
            log.warning("cluster: fenced (%s): writes refused until the lease is sure", reason)

    def restored(self) -> None:
        log.warning("cluster: lease kept after all; back to map rev %d", self.revision)
        self.reconcile()

    def rejoined(self, lease: int) -> None:
        log.warning("cluster: registered again (lease %x); waiting for the map", lease)
        self._awaiting_map = True

    # ------------------------------------------------------------------ orchestrator

    async def _lead(self, record: NodeRecord) -> None:
        election = Election(self.store, self.cluster, self.node_name, record.uuid)
        while True:
            while self.membership.fenced or not self.membership.lease or self._leaving:
                await trio.sleep(self.interval)
            with trio.CancelScope() as scope:
                self._lead_scope = scope
                try:
                    leadership = await self._campaign(election)
                except LeaseExpired:
                    leadership = None
                if leadership is not None:
                    self.leadership = leadership
                    try:
                        await self._hold(leadership)
                    finally:
                        self.leadership = None
            self._lead_scope = None
            await trio.sleep(self.interval)

    async def _campaign(self, election: Election) -> Leadership:
        """This node's term: the one it still holds under its lease (a fence that the
        lease outlived), else a new one when the office is free."""
        lease = self.membership.lease
        try:
            held = await self.store.get(election.key)
        except StoreUnavailable:
            held = None
        if held is not None and held.lease == lease:
            return Leadership(self.store, self.cluster, self.node_name, held.create_revision)
        return await election.campaign(lease, interval=self.interval)

    async def _hold(self, leadership: Leadership) -> None:
        run = self._run_orchestrator
        assert run is not None
        log.info("cluster: %s orchestrates (term %d)", self.node_name, leadership.term)
        async with trio.open_nursery() as nursery:

            async def orchestrate() -> None:
                try:
                    await run(leadership)
                except Exception:  # a bug must not stop the node: give the office up
                    log.exception("cluster: the orchestrator failed; resigning")
                    try:
                        await leadership.resign()
                    except StoreUnavailable:
                        pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(orchestrate)
            await leadership.wait_lost(self.interval)
            nursery.cancel_scope.cancel()
        log.info("cluster: %s no longer orchestrates (term %d)", self.node_name, leadership.term)

    async def _default_orchestrator(self, leadership: Leadership) -> None:
        # imported here: the orchestrator's modules are only needed on the node that leads
        from .control import LinkControl
        from .orchestrator import Orchestrator, OrchestratorSettings

        cfg = self.server.config
        settings = OrchestratorSettings(
            cluster=self.cluster,
            num_vbuckets=cfg.num_vbuckets,
            num_replicas=cfg.num_replicas,
            auto_failover_timeout=cfg.auto_failover_timeout,
            auto_failover_max_count=cfg.auto_failover_max_count,
            rebalance_moves=cfg.rebalance_moves,
            move_timeout=cfg.move_timeout,
        )
        control = LinkControl(**self.server.replication_options())
        try:
            await Orchestrator(self.store, leadership, control, settings).run()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await control.aclose()

    # ------------------------------------------------------------------ STAT cluster

    def stat_pairs(self) -> list[tuple[str, Any]]:
        vbmap = self.vbmap
        counts = vbmap.counts().get(self.node_name, (0, 0)) if vbmap is not None else (0, 0)
        return [
            ("node_name", self.node_name),
            ("cluster", self.cluster),
            ("etcd", self.store.endpoint),
            ("etcd_reachable", str(self.etcd_reachable).lower()),
            ("address", self.address),
            ("map_rev", self.revision),
            ("map_servers", len(vbmap.servers) if vbmap is not None else 0),
            ("map_active", counts[0]),
            ("map_replica", counts[1]),
            ("moving", len(vbmap.moving()) if vbmap is not None else 0),
            ("fenced", str(self.membership.fenced).lower()),
            ("writes_allowed", str(self.writes_allowed()).lower()),
            ("orchestrator", str(self.leadership is not None).lower()),
            ("term", self.leadership.term if self.leadership is not None else 0),
            ("lease_ttl", self.membership.lease_ttl),
            ("members", len(self.addresses)),
            ("live_nodes", len(self.live)),
        ]
