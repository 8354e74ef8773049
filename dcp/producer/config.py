"""Server configuration: defaults, a TOML file, ``DCP_*`` environment variables, flags.

Rules of this module:
- One dataclass, ``ServerConfig``, holds every setting with its default. Precedence, lowest
  first: defaults < TOML file (``--config``) < environment (``DCP_<FIELD>``) < flags.
- Values are validated once, here (``ServerConfig.validate``), with messages that name the
  setting, so a bad config stops the server before it binds a port.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "ServerConfig", "load_config"]


class ConfigError(ValueError):
    """A setting is missing, unknown or out of range."""


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 11210
    data_dir: str = "./dcp-data"
    num_vbuckets: int = 1024
    #: Bytes of checkpoint memory (all vbuckets) above which slow streams lose their cursor.
    checkpoint_memory_quota: int = 256 * 1024 * 1024
    checkpoint_max_items: int = 10_000
    #: Keep closed checkpoints no stream needs this long (memory pressure frees them
    #: sooner): a range planned a moment ago (Spark) is still read from memory, exactly.
    checkpoint_retain_seconds: float = 10.0
    max_item_size: int = 20 * 1024 * 1024
    #: A bounded change history, on by default (a retention, like a log's: an hour, at
    #: most 1 GiB, pruned by compaction): superseded versions stay on disk so a range a
    #: consumer planned earlier (a Spark batch's logged offsets) can still be read exactly
    #: after the memory checkpoints are gone or the server restarted. Clients that do not
    #: ask for change streams still get each key once. Both 0: off (docs/operations.md).
    history_seconds: float = 3600.0
    history_bytes: int = 1024 * 1024 * 1024
    tombstone_purge_age: float = 3 * 24 * 3600.0
    #: LMDB map size: the most the store may hold; full -> writes get ETMPFAIL.
    map_size: int = 8 * 1024 * 1024 * 1024
    #: Default DCP noop interval when a client enables noops without an interval.
    noop_interval: float = 20.0
    #: Disconnect a DCP client from which nothing was read for this long (noops enabled).
    idle_timeout: float = 360.0
    #: Unsent output (queued answers + the buffer being written) of one connection above
    #: which its requests are not handled until the client has read enough.
    connection_output_cap: int = 16 * 1024 * 1024
    #: Server-wide bound on output queued for all connections together; past it the
    #: connections holding the most unsent output are disconnected, worst first.
    total_output_cap: int = 512 * 1024 * 1024
    #: Most client connections served at once; further connects are refused (counted).
    max_connections: int = 4096
    #: Close a connection with no stream from which nothing was read for this long.
    kv_idle_timeout: float = 900.0
    #: A frame whose first byte arrived must be whole within this many seconds.
    partial_frame_timeout: float = 30.0
    #: Durable writes whose frame carries no timeout wait at most this long, then get
    #: SYNC_WRITE_AMBIGUOUS (ETMPFAIL without extended errors).
    durability_timeout: float = 30.0
    #: Bytes one write to a socket may carry (batching target).
    send_batch_bytes: int = 256 * 1024
    flush_batch_items: int = 50_000
    #: Pause between two flushes unless a durable write waits (fewer fsync'd
    #: transactions under a trickle of writes; durable writes are flushed at once).
    flush_interval: float = 0.05
    expiry_interval: float = 10.0
    compaction_interval: float = 3600.0
    #: Backfill buffer per stream (bytes) before the disk scan pauses.
    backfill_buffer_bytes: int = 8 * 1024 * 1024
    #: Disk backfills one connection runs at once (each keeps its slot until the items
    #: it buffered are sent): more than one lets a stream's items go out while the next
    #: vbucket is read. Server-wide, reads are limited by ``backfill_disk_readers``.
    max_concurrent_backfills: int = 4
    #: Backfill disk reads at once, server-wide (each is one chunk of one scan, so the
    #: backfills of every connection take turns). A read from the page cache is Python
    #: holding the GIL: two at once only trade it back and forth (4 cost ~40 % more
    #: server CPU per item than 1, at the same throughput). Raise it when the data is
    #: mostly not in memory, where reads wait on the disk.
    backfill_disk_readers: int = 1
    log_level: str = "INFO"
    #: "HOST:PORT": every vbucket of this node is a replica of that node (a hot standby).
    #: Empty: vbuckets keep the states they were given (SET_VBUCKET_STATE, dcpctl).
    replica_of: str = ""
    #: "HOST:PORT" other nodes know this one by (replication connection names); empty:
    #: the listen address.
    advertise: str = ""
    metrics_port: int = 0
    #: TOML file of users with their roles and salted SCRAM keys (docs/security.md).
    #: Empty: authentication is off, and the server refuses a non-loopback ``host``.
    users_file: str = ""
    #: Seconds a connection may stay unauthenticated when users are configured: then it
    #: is closed (NOOPs do not keep it open).
    auth_timeout: float = 30.0
    #: etcd endpoint (``http://127.0.0.1:2379``) whose keys under ``users_etcd_prefix``
    #: are the users (one JSON record per user; docs/security.md): the users of a
    #: cluster, followed live. An alternative to ``users_file``.
    users_etcd: str = ""
    users_etcd_prefix: str = "/dcp/default/users/"
    #: Port of a second, TLS listener (0: off); needs ``tls_cert`` and ``tls_key``.
    tls_port: int = 0
    #: PEM certificate chain and private key of the TLS listener.
    tls_cert: str = ""
    tls_key: str = ""
    #: PEM CA file of client certificates: when set, TLS clients must present a
    #: certificate it signed (mutual TLS).
    tls_ca: str = ""
    #: Seconds a TLS handshake may take before the connection is dropped.
    tls_handshake_timeout: float = 10.0
    #: The user this node's replication connections authenticate as to their sources
    #: (empty: they do not authenticate). The password may come from the environment
    #: (``DCP_REPLICATION_PASSWORD``) rather than a file or a flag.
    replication_user: str = ""
    replication_password: str = field(default="", repr=False)  # never in a log line
    #: Connect to replication sources over TLS (their address is then a TLS port),
    #: trusting the CAs in ``replication_tls_ca`` (empty: the system's).
    replication_tls: bool = False
    replication_tls_ca: str = ""
    #: Seconds a thread may hold the GIL while another waits for it (``sys.setswitchinterval``).
    #: The flusher and backfills run Python in worker threads; at CPython's 5 ms default
    #: the event loop could wait that long behind them (write-to-delivery p99).
    gil_switch_interval: float = 0.0005
    #: etcd endpoint (``http://127.0.0.1:2379``) of the cluster this node joins
    #: (docs/cluster.md); empty: a single node. Exclusive with ``replica_of``.
    cluster: str = ""
    #: This node's name in the cluster (required with ``cluster``; unique, stable: the
    #: data directory remembers it).
    node_name: str = ""
    #: The cluster's name: its keys in etcd live under ``/dcp/<cluster_name>/``.
    cluster_name: str = "default"
    #: Seconds of the node's etcd lease: a node that cannot renew it fences itself before
    #: it could expire, and the orchestrator counts a node down once it has.
    cluster_lease_ttl: int = 5
    #: Seconds a node's lease must have been gone before the orchestrator fails it over.
    auto_failover_timeout: float = 10.0
    #: Automatic failovers allowed until an operator resets the count.
    auto_failover_max_count: int = 1
    #: Replica copies of each vbucket the orchestrator places (0..3).
    num_replicas: int = 1
    #: Vbuckets a rebalance moves at a time.
    rebalance_moves: int = 32
    #: Seconds one vbucket move may take before it is rolled back.
    move_timeout: float = 120.0
    #: Seconds a node restarted after an UNCLEAN shutdown, still named active for
    #: vbuckets with other copies, waits to be failed over before it rejoins
    #: (cluster/rejoin.py); then it rejoins anyway, with a warning. Negative: derived,
    #: ``auto_failover_timeout + cluster_lease_ttl + 10``; 0: rejoin at once.
    unclean_rejoin_wait: float = -1.0

    def rejoin_wait(self) -> float:
        """``unclean_rejoin_wait`` in seconds, the derived default resolved: the old lease
        lapses within the TTL, the failover follows the timeout after the last keepalive,
        and 10 s covers an orchestrator's election, its reads of the replicas' seqnos
        and this node's next read of the map."""
        if self.unclean_rejoin_wait >= 0:
            return self.unclean_rejoin_wait
        return self.auto_failover_timeout + self.cluster_lease_ttl + 10.0

    def validate(self) -> ServerConfig:
        n = self.num_vbuckets
        if n <= 0 or n & (n - 1) or n > 1024:
            raise ConfigError(f"num_vbuckets must be a power of two in 1..1024, not {n}")
        for name in ("port", "tls_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be 0..65535, not {getattr(self, name)}")
        if self.tls_port and not (self.tls_cert and self.tls_key):
            raise ConfigError("tls_port needs tls_cert and tls_key (PEM files)")
        if self.replication_password and not self.replication_user:
            raise ConfigError("replication_password is set but replication_user is empty")
        if self.replication_user and not self.replication_password:
            raise ConfigError(
                "replication_user needs replication_password (better given as the "
                "environment variable DCP_REPLICATION_PASSWORD)"
            )
        if self.users_file and self.users_etcd:
            raise ConfigError("give users_file or users_etcd, not both")
        if self.users_etcd and not self.users_etcd_prefix.endswith("/"):
            prefix = self.users_etcd_prefix
            raise ConfigError(f"users_etcd_prefix must end with '/', not {prefix!r}")
        for name in (
            "checkpoint_memory_quota",
            "max_item_size",
            "map_size",
            "send_batch_bytes",
            "flush_batch_items",
            "checkpoint_max_items",
            "connection_output_cap",
            "backfill_buffer_bytes",
            "max_concurrent_backfills",
            "backfill_disk_readers",
            "total_output_cap",
            "max_connections",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, not {getattr(self, name)}")
        for name in (
            "history_seconds",
            "history_bytes",
            "tombstone_purge_age",
            "checkpoint_retain_seconds",
            "flush_interval",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, not {getattr(self, name)}")
        for name in (
            "noop_interval",
            "idle_timeout",
            "expiry_interval",
            "compaction_interval",
            "gil_switch_interval",
            "kv_idle_timeout",
            "partial_frame_timeout",
            "durability_timeout",
            "tls_handshake_timeout",
            "auth_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, not {getattr(self, name)}")
        for name in ("replica_of", "advertise"):
            value = getattr(self, name)
            host, sep, port = value.rpartition(":")
            if value and (not sep or not host or not port.isdigit() or not 0 < int(port) < 65536):
                raise ConfigError(f"{name} must be HOST:PORT, not {value!r}")
        self._validate_cluster()
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(
                f"log_level must be DEBUG, INFO, WARNING or ERROR, not {self.log_level}"
            )
        return self

    def _validate_cluster(self) -> None:
        if self.cluster:
            if not self.node_name:
                raise ConfigError("cluster needs node_name (this node's unique name)")
            if self.replica_of:
                raise ConfigError(
                    "give cluster or replica_of, not both (the cluster map decides replicas)"
                )
            if not self.cluster.startswith(("http://", "https://")):
                raise ConfigError(
                    f"cluster must be an etcd URL http://HOST:PORT, not {self.cluster!r}"
                )
        for name in ("node_name", "cluster_name"):
            value = getattr(self, name)
            if not _NAME.fullmatch(value) and (value or name == "cluster_name"):
                raise ConfigError(
                    f"{name} must be 1..64 letters, digits, '.', '_' or '-', not {value!r}"
                )
        if not 2 <= self.cluster_lease_ttl <= 300:
            raise ConfigError(f"cluster_lease_ttl must be 2..300 s, not {self.cluster_lease_ttl}")
        if not 0 <= self.num_replicas <= 3:
            raise ConfigError(f"num_replicas must be 0..3, not {self.num_replicas}")
        if self.auto_failover_max_count < 0:
            raise ConfigError(
                f"auto_failover_max_count must be >= 0, not {self.auto_failover_max_count}"
            )
        if self.rebalance_moves < 1:
            raise ConfigError(f"rebalance_moves must be positive, not {self.rebalance_moves}")
        for name in ("auto_failover_timeout", "move_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, not {getattr(self, name)}")
        if not self.auto_failover_timeout > self.cluster_lease_ttl:  # counted from the last
            raise ConfigError(  # keepalive: a timeout within the TTL would not wait at all
                f"auto_failover_timeout ({self.auto_failover_timeout:g} s) must exceed "
                f"cluster_lease_ttl ({self.cluster_lease_ttl} s)"
            )
        if not -1e9 < self.unclean_rejoin_wait < 1e9:  # also NaN: a wait must end
            raise ConfigError(
                f"unclean_rejoin_wait must be a number of seconds, not {self.unclean_rejoin_wait}"
            )


_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _coerce(name: str, typ: Any, raw: Any) -> Any:
    if typ in (bool, "bool"):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ConfigError(f"{name}: cannot use {raw!r} (true or false)")
    try:
        if typ in (int, "int"):
            return int(raw)
        if typ in (float, "float"):
            return float(raw)
        return str(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: cannot use {raw!r} ({exc})") from exc


def _types() -> dict[str, Any]:
    return {f.name: f.type for f in fields(ServerConfig)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting (``--data-dir``, ``--num-vbuckets``...)."""
    parser.add_argument("--config", help="TOML file with settings (same names as the flags)")
    for f in fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"default: {f.default}"
        if f.type in (bool, "bool"):  # ``--replication-tls`` alone means true
            parser.add_argument(
                flag, dest=f.name, default=None, nargs="?", const="true", help=help_text
            )
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text)


def load_config(
    args: argparse.Namespace | None = None, environ: dict[str, str] | None = None
) -> ServerConfig:
    env = os.environ if environ is None else environ
    types = _types()
    values: dict[str, Any] = {}
    path = getattr(args, "config", None) if args is not None else None
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
        data = data.get("server", data)
        for k, v in data.items():
            key = k.replace("-", "_")
            if key not in types:
                raise ConfigError(f"config file {path}: unknown setting {k!r}")
            values[key] = _coerce(key, types[key], v)
    for key, typ in types.items():
        raw = env.get("DCP_" + key.upper())
        if raw is not None:
            values[key] = _coerce(key, typ, raw)
    if args is not None:
        for key, typ in types.items():
            raw = getattr(args, key, None)
            if raw is not None:
                values[key] = _coerce(key, typ, raw)
    return ServerConfig(**values).validate()
