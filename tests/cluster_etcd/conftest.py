"""The ``etcd_cluster`` fixture: an etcd of the test's own and the ``dcp-server --cluster``
nodes the test starts on it (``harness.py``), every one of them killed and the etcd
removed when the test ends, pass or fail.

Rules of this module: the etcd comes from ``tests/etcd/conftest.py``'s ``etcd_factory``
(imported, so this directory uses the same throwaway etcd and is skipped the same way
when the binary is missing); nothing else is started here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.etcd.conftest import EtcdProcess, etcd_factory

from .harness import EtcdCluster

__all__ = ["etcd_cluster", "etcd_factory"]


@pytest.fixture
async def etcd_cluster(
    tmp_path: Path, etcd_factory: Callable[[], EtcdProcess]
) -> AsyncIterator[EtcdCluster]:
    c = EtcdCluster(tmp_path, etcd_factory())
    try:
        yield c
    finally:
        await c.aclose()
