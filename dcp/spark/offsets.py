"""Stream offsets: one position per vbucket, as canonical JSON.

Rules of this module:
- An offset names, for every vbucket the query reads, the vbucket uuid of the history
  branch and a seqno that is a snapshot end (or 0): ``(uuid, seqno)`` with the zero-width
  snapshot ``[seqno, seqno]`` is a legal DCP resume point. Two optional facts ride along
  so that a rollback found after a restart still rewinds correctly: ``p``, the start of
  the change set that ended at ``seqno`` (a rollback below ``seqno`` must re-read from a
  change-set boundary, or versions that set deduplicated away would be lost), and ``g``,
  the number of rollbacks the query applied to the vbucket (the high part of the rows'
  ``position`` column, so rows after a rollback sort after the rows it undoes).
- Spark compares offsets **as JSON text**, so the JSON is canonical: the same positions
  always give the same text. Vbuckets in ascending numeric order, every vbucket always
  present, keys in the fixed order ``u``, ``s``, ``p``, ``g``, ``rb`` (``p`` only when
  known, ``g`` only when not 0, ``rb`` only on a rollback); uuids as decimal strings (they
  are unsigned 64-bit). ``to_json`` builds exactly that shape; nothing else builds offsets.
- ``rb`` (optional) marks that the batch ending at this offset starts, for that vbucket,
  with a rollback to seqno ``rb``: the batch emits an ``op='rollback'`` row for it.
- Pure: no I/O except ``read_file``/``write_file_atomic`` for ``startingOffsetsFile``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import OffsetError

__all__ = [
    "MAX_GEN",
    "VERSION",
    "VbPosition",
    "dumps",
    "earliest",
    "from_json",
    "parse_starting_offsets",
    "read_file",
    "to_json",
    "write_file_atomic",
]

VERSION = 1
_U64 = (1 << 64) - 1
#: Rollback generations fit in the top 15 bits of the signed ``position`` column.
MAX_GEN = 1 << 15


@dataclass(frozen=True, slots=True)
class VbPosition:
    """Where one vbucket stands: history branch ``uuid`` (0 = unknown yet) and ``seqno``."""

    uuid: int = 0
    seqno: int = 0
    rollback: int | None = None  # the batch ending here starts with a rollback to this seqno
    prev: int | None = None  # start of the change set that ended here (None: unknown)
    gen: int = 0  # rollbacks applied to this vbucket so far

    def __post_init__(self) -> None:
        for name in ("uuid", "seqno"):
            v = getattr(self, name)
            if type(v) is not int or not 0 <= v <= _U64:
                raise OffsetError(f"{name} must be an integer in 0..2**64-1, not {v!r}")
        for name, value in (("rollback seqno", self.rollback), ("change-set start", self.prev)):
            if value is not None and (type(value) is not int or not 0 <= value <= self.seqno):
                raise OffsetError(f"{name} {value!r} must be in 0..{self.seqno}")
        if type(self.gen) is not int or not 0 <= self.gen < MAX_GEN:
            raise OffsetError(f"rollback generation {self.gen!r} must be in 0..{MAX_GEN - 1}")

    def plain(self) -> VbPosition:
        """The same position without the rollback mark."""
        if self.rollback is None:
            return self
        return VbPosition(self.uuid, self.seqno, None, self.prev, self.gen)


Offsets = dict[int, VbPosition]


def earliest(vbuckets: Iterable[int]) -> Offsets:
    return {vb: VbPosition() for vb in sorted(vbuckets)}


def to_json(offsets: Mapping[int, VbPosition]) -> dict[str, Any]:
    """The canonical dict (Spark serialises it with ``json.dumps``)."""
    vbs: dict[str, Any] = {}
    for vb in sorted(offsets):
        p = offsets[vb]
        entry: dict[str, Any] = {"u": str(p.uuid), "s": p.seqno}
        if p.prev is not None:
            entry["p"] = p.prev
        if p.gen:
            entry["g"] = p.gen
        if p.rollback is not None:
            entry["rb"] = p.rollback
        vbs[str(vb)] = entry
    return {"v": VERSION, "vb": vbs}


def dumps(offsets: Mapping[int, VbPosition]) -> str:
    return json.dumps(to_json(offsets))


def _position(vb: str, obj: Any) -> VbPosition:
    if isinstance(obj, int) and not isinstance(obj, bool):
        return VbPosition(0, obj)
    if not isinstance(obj, dict):
        raise OffsetError(f"vbucket {vb}: expected {{'u': uuid, 's': seqno}}, not {obj!r}")
    unknown = set(obj) - {"u", "s", "p", "g", "rb"}
    if unknown:
        raise OffsetError(f"vbucket {vb}: unknown offset fields {sorted(unknown)}")
    try:
        uuid = int(obj.get("u", 0))
        seqno = obj["s"]
    except (KeyError, TypeError, ValueError) as exc:
        raise OffsetError(f"vbucket {vb}: malformed offset {obj!r}") from exc
    if type(seqno) is not int:
        raise OffsetError(f"vbucket {vb}: seqno must be an integer, not {seqno!r}")
    rb = obj.get("rb")
    try:
        return VbPosition(uuid, seqno, rb, obj.get("p"), obj.get("g", 0))
    except OffsetError as exc:
        raise OffsetError(f"vbucket {vb}: {exc}") from None


def from_json(obj: Any) -> Offsets:
    """Parse a canonical offset (as Spark hands it back: a dict, or its JSON text)."""
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except ValueError as exc:
            raise OffsetError(f"offset is not JSON: {exc}") from exc
    if not isinstance(obj, dict) or "vb" not in obj:
        raise OffsetError(f"not a dcp offset (expected {{'v': 1, 'vb': {{...}}}}): {obj!r}")
    if obj.get("v") != VERSION:
        raise OffsetError(f"offset version {obj.get('v')!r} is not supported (expected {VERSION})")
    vbs = obj["vb"]
    if not isinstance(vbs, dict):
        raise OffsetError("offset field 'vb' must be an object")
    out: Offsets = {}
    for k, v in vbs.items():
        try:
            vb = int(k)
        except ValueError:
            raise OffsetError(f"vbucket {k!r} is not a number") from None
        out[vb] = _position(k, v)
    return out


def parse_starting_offsets(text: str, vbuckets: Iterable[int]) -> Offsets:
    """Explicit ``startingOffsets`` JSON for the given vbuckets.

    Accepted shapes: the canonical offset (``{"v": 1, "vb": {...}}``), or a bare map
    ``{"<vb>": {"u": "<uuid>", "s": seqno}}`` / ``{"<vb>": seqno}``. Vbuckets that are
    not mentioned start at the beginning (seqno 0). Mentioning a vbucket the query does
    not read is an error.
    """
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise OffsetError(f"startingOffsets is not JSON: {exc}") from exc
    if isinstance(obj, dict) and "vb" in obj:
        given = from_json(obj)
    elif isinstance(obj, dict):
        given = {}
        for k, v in obj.items():
            try:
                given[int(k)] = _position(k, v)
            except ValueError:
                raise OffsetError(f"startingOffsets: vbucket {k!r} is not a number") from None
    else:
        raise OffsetError("startingOffsets must be a JSON object")
    vbs = sorted(vbuckets)
    extra = sorted(set(given) - set(vbs))
    if extra:
        raise OffsetError(f"startingOffsets names vbuckets the query does not read: {extra}")
    out = earliest(vbs)
    for vb, p in given.items():
        out[vb] = p.plain()
    return out


def read_file(path: str) -> Offsets | None:
    """The offsets kept in ``path``, or None when the file does not exist."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        return from_json(text)
    except OffsetError as exc:
        raise OffsetError(f"startingOffsetsFile {path}: {exc}") from exc


def write_file_atomic(path: str, offsets: Mapping[int, VbPosition]) -> None:
    """Replace ``path`` atomically: temp file in the same directory, fsync, rename,
    fsync of the directory. A reader sees the old file or the new one, never a part."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".dcp-offsets-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dumps(offsets) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
