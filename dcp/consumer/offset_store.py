"""Offset stores: where committed positions survive a restart.

Rules of this module:
- An offset store saves and loads ``{vbucket: Offset}``. The client saves the complete
  mapping after every commit that moved something, so a store never merges.
- ``save`` and ``load`` are plain blocking methods (easy to implement); the client calls
  ``asave``/``aload``, which run them in a worker thread unless the store says it never
  blocks (``MemoryOffsetStore``). Saves of one client are serialised.
- ``FileOffsetStore`` survives ``kill -9`` at any instant: the file is always a complete
  old or new version. It writes a temp file in the same directory, fsyncs it, renames
  it over the target (atomic on POSIX) and fsyncs the directory so the rename itself is
  durable. A leftover temp file from a killed writer is ignored (and removed later).
- A store whose content is not valid raises ``InvalidOffsetError`` on load (tier 1:
  the operator must look at it; the SDK never silently starts over).
"""

from __future__ import annotations

import abc
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import trio

from .errors import InvalidOffsetError
from .offset import Offset

__all__ = ["FileOffsetStore", "MemoryOffsetStore", "OffsetStore"]

FORMAT_VERSION = 1


class OffsetStore(abc.ABC):
    """Pluggable persistence of committed offsets."""

    #: True when ``save``/``load`` may block (file, database): run them in a thread.
    blocking: bool = True

    @abc.abstractmethod
    def load(self) -> dict[int, Offset]:
        """Every saved offset (empty when nothing was saved yet)."""

    @abc.abstractmethod
    def save(self, offsets: Mapping[int, Offset]) -> None:
        """Replace the saved offsets with ``offsets``, durably, before returning."""

    async def aload(self) -> dict[int, Offset]:
        if self.blocking:
            return await trio.to_thread.run_sync(self.load)
        return self.load()

    async def asave(self, offsets: Mapping[int, Offset]) -> None:
        if self.blocking:
            await trio.to_thread.run_sync(self.save, offsets)
        else:
            self.save(offsets)


class MemoryOffsetStore(OffsetStore):
    """Keeps offsets in memory (tests; or sharing one store between client instances)."""

    blocking = False

    def __init__(self, offsets: Mapping[int, Offset] | None = None) -> None:
        self.offsets: dict[int, Offset] = dict(offsets or {})
        self.saves = 0

    def load(self) -> dict[int, Offset]:
        return dict(self.offsets)

    def save(self, offsets: Mapping[int, Offset]) -> None:
        self.offsets = dict(offsets)
        self.saves += 1


def encode_offsets(offsets: Mapping[int, Offset]) -> bytes:
    doc = {
        "v": FORMAT_VERSION,
        "vbuckets": {str(vb): offsets[vb].to_json() for vb in sorted(offsets)},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_offsets(data: bytes, source: str = "offsets") -> dict[int, Offset]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidOffsetError(f"{source}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("v") != FORMAT_VERSION:
        raise InvalidOffsetError(f'{source}: expected an object with "v": {FORMAT_VERSION}')
    vbs = doc.get("vbuckets")
    if not isinstance(vbs, dict):
        raise InvalidOffsetError(f'{source}: "vbuckets" must be an object')
    out: dict[int, Offset] = {}
    for key, obj in vbs.items():
        try:
            vb = int(key)
        except ValueError as exc:
            raise InvalidOffsetError(f"{source}: vbucket key {key!r} is not a number") from exc
        out[vb] = Offset.from_json(vb, obj)
    return out


class FileOffsetStore(OffsetStore):
    """Offsets in one JSON file, replaced atomically and durably on every save.

    Args:
        path: the file. Its directory must exist.
        fsync: set False only for tests that do not need durability.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self._cleaned = False

    def _temp_prefix(self) -> str:
        return f".{self.path.name}."

    def load(self) -> dict[int, Offset]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        return decode_offsets(data, str(self.path))

    def save(self, offsets: Mapping[int, Offset]) -> None:
        data = encode_offsets(offsets)
        directory = self.path.parent
        fd, tmp = tempfile.mkstemp(prefix=self._temp_prefix(), suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if self.fsync:
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        if not self._cleaned:
            self._cleaned = True
            self._clean_leftovers()

    def _clean_leftovers(self, min_age: float = 60.0) -> None:
        """Remove temp files a killed writer left behind (old ones only: another
        process may be writing its own right now)."""
        prefix = self._temp_prefix()
        now = time.time()
        try:
            names = os.listdir(self.path.parent)
        except OSError:
            return
        for name in names:
            if name.startswith(prefix) and name.endswith(".tmp"):
                p = self.path.parent / name
                try:
                    if now - p.stat().st_mtime > min_age:
                        p.unlink()
                except OSError:
                    pass
