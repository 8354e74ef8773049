"""A throwaway etcd for the cluster's store, membership and election tests.

Rules of this module:
- ``EtcdProcess`` runs Debian's ``etcd`` (3.4; ``make test`` installs ``etcd-server``) on
  free loopback ports (client and peer) with its data in a temporary directory. ``start``
  returns once etcd answers ``/health``; ``stop`` kills it and waits; ``remove`` deletes
  the directory. A test may stop and start it again on the same ports and data (etcd
  away and back).
- ``etcd_server`` is one etcd for the whole session (starting one costs about a second);
  tests keep apart by using their own key prefix (``cluster_name``). Tests that stop
  etcd use ``etcd_factory`` for their own.
- Without the binary the tests are skipped, saying so; every process started here is
  stopped at teardown, pass or fail.
"""

from __future__ import annotations

import itertools
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ETCD = shutil.which("etcd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdProcess:
    def __init__(self, root: Path) -> None:
        assert ETCD is not None
        self.root = root
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        assert self.proc is None, "already running"
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.root / "etcd.log", "ab")  # the child writes it; closed here after the fork
        self.proc = subprocess.Popen(
            [
                str(ETCD),
                "--name=test",
                f"--data-dir={self.root / 'data'}",
                f"--listen-client-urls={self.endpoint}",
                f"--advertise-client-urls={self.endpoint}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                "--logger=zap",
                "--log-level=error",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                log_text = (self.root / "etcd.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"etcd exited at start:\n{log_text}")
            try:
                with urllib.request.urlopen(self.endpoint + "/health", timeout=1) as r:
                    if b'"health":"true"' in r.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not answer on {self.endpoint} within {timeout} s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _need_etcd() -> None:
    if ETCD is None:
        pytest.skip("etcd is not installed (make test installs Debian's etcd-server)")


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdProcess]:
    _need_etcd()
    e = EtcdProcess(Path(tempfile.mkdtemp(prefix="dcp-etcd-")))
    try:
        e.start()
        yield e
    finally:
        e.remove()


@pytest.fixture
def etcd_factory() -> Iterator[Callable[[], EtcdProcess]]:
    """Makes etcds of the test's own (started); all removed at teardown."""
    _need_etcd()
    made: list[EtcdProcess] = []

    def make() -> EtcdProcess:
        e = EtcdProcess(Path(tempfile.mkdtemp(prefix="dcp-etcd-")))
        made.append(e)
        e.start()
        return e

    try:
        yield make
    finally:
        for e in made:
            e.remove()


_names = itertools.count()


@pytest.fixture
def cluster_name(request: pytest.FixtureRequest) -> str:
    """A key prefix of the test's own in the shared etcd."""
    return f"t{next(_names)}-{request.node.name[:40]}".replace("[", "_").replace("]", "_")
