"""Data directory checks before LMDB maps ``data.mdb``: what is refused, what is not, and
what ``--reset-data`` (``set_aside_damaged``) does to each."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from dcp.producer.engine import Bucket, DataDirError
from dcp.producer.engine.datafiles import (
    MARKER,
    check_data_files,
    read_meta_pages,
    set_aside_damaged,
)


def _store(open_bucket: Callable[..., Bucket], data: Path) -> None:
    b = open_bucket()
    for i in range(200):
        b.set(i % 4, b"k%d" % i, b"v" * 1000)
    b.flusher.flush_all()
    b.close()
    assert (data / MARKER).exists()


def test_a_new_directory_and_an_intact_store_pass(
    tmp_path: Path, open_bucket: Callable[..., Bucket]
) -> None:
    check_data_files(tmp_path / "nothing-yet")
    data = tmp_path / "data"
    _store(open_bucket, data)
    check_data_files(data)
    (newest, older) = read_meta_pages(data / "data.mdb")
    assert newest.txnid > older.txnid and newest.page_size == 4096
    assert newest.used_bytes <= (data / "data.mdb").stat().st_size
    assert set_aside_damaged(data) == []  # --reset-data leaves an intact store alone
    assert (data / "data.mdb").exists()


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda f: os.truncate(f, f.stat().st_size - 4096), "is truncated"),
        (lambda f: os.truncate(f, 0), "is empty (0 bytes), but"),
        (lambda f: f.unlink(), "is missing, but"),
        (lambda f: f.write_bytes(b"\0" * 65536), "has no valid LMDB meta page"),
    ],
    ids=["truncated", "emptied", "deleted", "zeroed"],
)
def test_damage_is_refused_before_lmdb_maps_the_file(
    tmp_path: Path, open_bucket: Callable[..., Bucket], damage, says: str
) -> None:
    data = tmp_path / "data"
    _store(open_bucket, data)
    damage(data / "data.mdb")
    with pytest.raises(DataDirError, match=re.escape(says)) as ei:
        check_data_files(data)
    assert "\n" not in ei.value.detail and "--reset-data" in ei.value.detail
    with pytest.raises(DataDirError):  # the engine refuses it too, and creates nothing
        open_bucket()
    assert not (data / "data.mdb.damaged").exists()
    done = set_aside_damaged(data)
    assert done[0].startswith("--reset-data: ") and says in done[0]
    assert not (data / MARKER).exists() and not (data / "lock.mdb").exists()
    b = open_bucket()  # an empty store from now on
    assert b.vbucket(0).high_seqno == 0
    b.close()
    check_data_files(data)


def test_a_store_from_before_the_marker_is_protected_by_its_lock_file(
    tmp_path: Path, open_bucket: Callable[..., Bucket]
) -> None:
    data = tmp_path / "data"
    _store(open_bucket, data)
    (data / MARKER).unlink()  # as written by a version without the marker
    check_data_files(data)
    (data / "data.mdb").unlink()
    with pytest.raises(
        DataDirError,
        match=r"is missing, but .*lock\.mdb shows an LMDB "
        "environment was created here",
    ):
        check_data_files(data)


def test_the_marker_is_written_at_the_first_open_of_an_old_store(
    tmp_path: Path, open_bucket: Callable[..., Bucket]
) -> None:
    data = tmp_path / "data"
    _store(open_bucket, data)
    (data / MARKER).unlink()
    open_bucket().close()
    assert (data / MARKER).exists()
