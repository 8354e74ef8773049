"""``make cluster`` / ``make cluster-down``: etcd and three nodes on loopback, in the background.

``python -m tools.local_cluster up|down [--dir ./dcp-cluster] [--nodes 3]``

Rules of this module:
- Everything lives under ``--dir``: etcd's data in ``etcd/``, node I's data in ``nI/``,
  one log and one pid file per process (``etcd.log``, ``etcd.pid``, ``nI.log``,
  ``nI.pid``). ``down`` keeps the data: the next ``up`` brings back the same cluster.
- Processes start in their own session (they outlive ``make``) and are tracked only by
  their pid files; a pid file whose process is gone, or is another program, is stale and
  replaced. A process already running from a previous ``up`` is reported and left alone,
  never started twice.
- ``up`` returns once etcd answers ``/health`` and every node has registered itself in
  etcd (``/dcp/<cluster>/nodes/<name>``); a process that exits meanwhile fails ``up``
  with the tail of its log, and what was started stays up for ``down`` to stop.
- ``down`` sends SIGTERM (nodes first, then etcd), waits, then SIGKILL after
  ``STOP_GRACE`` seconds; it removes the pid files.
- Loopback only: etcd on 127.0.0.1:2379 (peer 2380), node I on 127.0.0.1:(11209 + I);
  ``--etcd-port`` and ``--first-port`` move them (tests use free ports).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import trio

from dcp.producer.cluster.membership import cluster_prefix
from dcp.producer.cluster.store import EtcdStore, StoreUnavailable

ETCD_PORT = 2379  # the peer port is the next one
FIRST_PORT = 11210
CLUSTER = "default"
STOP_GRACE = 5.0
BIN = Path(sys.executable).parent


def _alive(pid_file: Path, word: str) -> int | None:
    """The pid in ``pid_file`` if that process runs and its command line has ``word``."""
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ValueError):
        return None
    return pid if word in cmdline else None


def _spawn(root: Path, name: str, argv: list[str]) -> int:
    with open(root / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (root / f"{name}.pid").write_text(f"{proc.pid}\n")
    return proc.pid


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _etcd_healthy(client: str) -> bool:
    try:
        with urllib.request.urlopen(client + "/health", timeout=1) as r:
            return b'"health":"true"' in r.read()
    except (urllib.error.URLError, OSError):
        return False


def _registered(client: str, names: list[str]) -> set[str]:
    """Which of ``names`` have a ``nodes/`` key in etcd (one read through ``EtcdStore``)."""
    prefix = f"{cluster_prefix(CLUSTER)}nodes/"

    async def read() -> set[str]:
        store = EtcdStore(client)
        try:
            snap = await store.get_prefix(prefix)
        except StoreUnavailable:
            return set()
        finally:
            await store.aclose()
        return {key[len(prefix) :] for key in snap.entries}

    return trio.run(read) & set(names)


def _wait(
    root: Path, what: str, pids: dict[str, int], ready: Callable[[], bool], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        for name, pid in pids.items():
            if _exited(pid):
                log = root / f"{name}.log"
                raise SystemExit(f"{name} exited at start; {log} ends with:\n{_tail(log)}")
        time.sleep(0.2)
    raise SystemExit(f"{what} not ready within {timeout:g} s; logs in {root}/")


def _exited(pid: int) -> bool:
    """True when ``pid`` is gone or a zombie (our own child that exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
        with contextlib.suppress(ChildProcessError):  # reaped by its parent, not us
            os.waitpid(pid, os.WNOHANG)
        return True
    return False


def up(root: Path, nodes: int, etcd_port: int = ETCD_PORT, first_port: int = FIRST_PORT) -> int:
    client = f"http://127.0.0.1:{etcd_port}"
    peer = f"http://127.0.0.1:{etcd_port + 1}"
    etcd = shutil.which("etcd")
    if etcd is None:
        print("etcd is not installed: `make etcd` installs Debian's etcd-server (as root)")
        return 1
    root.mkdir(parents=True, exist_ok=True)
    started: dict[str, int] = {}
    pid = _alive(root / "etcd.pid", "etcd")
    if pid is not None:
        print(f"etcd already running (pid {pid}), not starting it again")
    else:
        started["etcd"] = _spawn(
            root,
            "etcd",
            [
                etcd,
                "--name=dcp-local",
                f"--data-dir={root / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=dcp-local={peer}",
            ],
        )
    _wait(root, "etcd", dict(started), lambda: _etcd_healthy(client), 30)
    names = [f"n{i}" for i in range(1, nodes + 1)]
    server = str(BIN / "dcp-server")
    for i, name in enumerate(names):
        pid = _alive(root / f"{name}.pid", "dcp-server")
        if pid is not None:
            print(f"{name} already running (pid {pid}), not starting it again")
            continue
        started[name] = _spawn(
            root,
            name,
            [
                server,
                "--cluster",
                client,
                "--node-name",
                name,
                "--cluster-name",
                CLUSTER,
                "--host",
                "127.0.0.1",
                "--port",
                str(first_port + i),
                "--data-dir",
                str(root / name),
            ],
        )
    node_pids = {n: p for n, p in started.items() if n != "etcd"}
    _wait(root, "the nodes", node_pids, lambda: _registered(client, names) == set(names), 60)
    ctl = BIN / "dcpctl"
    print(f"cluster {CLUSTER!r} is up: etcd {client}, logs and data in {root}/")
    for i, name in enumerate(names):
        print(f"  {name}  127.0.0.1:{first_port + i}")
    env = "" if etcd_port == ETCD_PORT else f"DCP_CLUSTER={client} "
    print(
        f"""
  {env}{ctl} cluster nodes          # nodes, up/down, copies each holds, the orchestrator
  {env}{ctl} cluster map --chains   # which node is active for which vbucket
  {ctl} --port {first_port + 1} vbuckets --active   # one node's own view

Each node serves the vbuckets it holds active (others answer NOT_MY_VBUCKET with the
cluster's bucket config); the SDK talks to one node: pass the vbuckets that node is
active for (dcpctl cluster map --chains), e.g.
  DcpClient("127.0.0.1", {first_port}, vbuckets=[...])
Stop everything with: make cluster-down (the data stays in {root}/)"""
    )
    return 0


def down(root: Path) -> int:
    """Stop every process with a pid file under ``root`` (whatever ``up`` started)."""
    names = [*sorted(p.stem for p in root.glob("n*.pid")), "etcd"]
    running: dict[str, int] = {}
    for name in names:
        pid = _alive(root / f"{name}.pid", "etcd" if name == "etcd" else "dcp-server")
        if pid is not None:
            running[name] = pid
        else:
            (root / f"{name}.pid").unlink(missing_ok=True)
    if not running:
        print(f"nothing running from {root}/")
        return 0
    for group in ([n for n in running if n != "etcd"], [n for n in running if n == "etcd"]):
        for name in group:
            os.kill(running[name], signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        while time.monotonic() < deadline and not all(_exited(running[n]) for n in group):
            time.sleep(0.1)
        for name in group:
            if not _exited(running[name]):
                os.kill(running[name], signal.SIGKILL)
                print(f"{name} (pid {running[name]}) did not stop on SIGTERM: killed")
            (root / f"{name}.pid").unlink(missing_ok=True)
            print(f"stopped {name}")
    print(f"data kept in {root}/ (remove it for a fresh cluster)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.local_cluster", description=__doc__)
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--dir", default="./dcp-cluster", help="data, logs and pid files")
    p.add_argument("--nodes", type=int, default=3, help="how many nodes (default 3)")
    p.add_argument("--etcd-port", type=int, default=ETCD_PORT, help="etcd's client port")
    p.add_argument("--first-port", type=int, default=FIRST_PORT, help="node n1's port")
    args = p.parse_args(argv)
    root = Path(args.dir).resolve()
    if args.action == "down":
        return down(root)
    return up(root, args.nodes, args.etcd_port, args.first_port)


if __name__ == "__main__":
    sys.exit(main())
