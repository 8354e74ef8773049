"""Resume positions as applications see them: ``Offset`` and ``StartFrom``.

Rules of this module:
- ``Offset`` is a frozen slotted dataclass, validated once when built (``InvalidOffsetError``
  for anything out of range or inconsistent); after ``__post_init__`` its snapshot
  fields are always ints (``None`` only means "the same as ``seqno``" when building).
- ``to_json``/``from_json`` are what offset stores (``offset_store.py``) write and read.
- No I/O and no trio in this module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from dcp.protocol.opcodes import SEQNO_MAX

from .errors import InvalidOffsetError

__all__ = ["FailoverLog", "Offset", "StartFrom"]

#: (vb_uuid, seqno) pairs, newest first.
FailoverLog = tuple[tuple[int, int], ...]


class StartFrom(enum.Enum):
    """Where a vbucket without a saved or explicit offset starts."""

    BEGINNING = "beginning"  #: seqno 0: every change the server still has
    NOW = "now"  #: the vbucket's high seqno when the client first connects


def _check_seqno(name: str, value: object) -> None:
    if type(value) is not int or not 0 <= value <= SEQNO_MAX:
        raise InvalidOffsetError(f"{name} must be an int in 0..2**64-1, not {value!r}")


@dataclass(frozen=True, slots=True)
class Offset:
    """A resume position of one vbucket (what an offset store saves).

    ``seqno`` is the last seqno the application has; committed offsets are snapshot
    ends, so ``snap_start == snap_end == seqno``. ``failover_log`` is newest first; when
    it is empty, ``vb_uuid`` stands alone (an offset from outside, e.g. another system).
    """

    vbucket: int
    vb_uuid: int = 0
    seqno: int = 0
    snap_start: int | None = None
    snap_end: int | None = None
    failover_log: FailoverLog = field(default=())
    purge_seqno: int = 0

    def __post_init__(self) -> None:
        if type(self.vbucket) is not int or not 0 <= self.vbucket <= 0xFFFF:
            raise InvalidOffsetError(f"vbucket must be an int in 0..65535, not {self.vbucket!r}")
        _check_seqno("vb_uuid", self.vb_uuid)
        _check_seqno("seqno", self.seqno)
        snap_start = self.seqno if self.snap_start is None else self.snap_start
        snap_end = self.seqno if self.snap_end is None else self.snap_end
        object.__setattr__(self, "snap_start", snap_start)
        object.__setattr__(self, "snap_end", snap_end)
        _check_seqno("snap_start", snap_start)
        _check_seqno("snap_end", snap_end)
        _check_seqno("purge_seqno", self.purge_seqno)
        if not snap_start <= self.seqno <= snap_end:
            raise InvalidOffsetError(
                f"vbucket {self.vbucket}: need snap_start <= seqno <= snap_end, got "
                f"{snap_start} <= {self.seqno} <= {snap_end}"
            )
        log = tuple((int(u), int(s)) for u, s in self.failover_log)
        for u, s in log:
            _check_seqno("failover log uuid", u)
            _check_seqno("failover log seqno", s)
        object.__setattr__(self, "failover_log", log)
        if log and self.vb_uuid == 0:
            object.__setattr__(self, "vb_uuid", log[0][0])
        elif log and self.vb_uuid != log[0][0]:
            raise InvalidOffsetError(
                f"vbucket {self.vbucket}: vb_uuid {self.vb_uuid} is not the newest failover "
                f"log entry {log[0][0]}"
            )

    @property
    def snapshot(self) -> tuple[int, int]:
        """``(snap_start, snap_end)`` as ints (``__post_init__`` filled in the defaults)."""
        start, end = self.snap_start, self.snap_end
        assert start is not None and end is not None
        return start, end

    @classmethod
    def beginning(cls, vbucket: int) -> Offset:
        return cls(vbucket)

    def to_json(self) -> dict[str, Any]:
        return {
            "vb_uuid": self.vb_uuid,
            "seqno": self.seqno,
            "snap_start": self.snap_start,
            "snap_end": self.snap_end,
            "purge_seqno": self.purge_seqno,
            "failover_log": [[u, s] for u, s in self.failover_log],
        }

    @classmethod
    def from_json(cls, vbucket: int, obj: object) -> Offset:
        if not isinstance(obj, dict):
            raise InvalidOffsetError(f"vbucket {vbucket}: offset must be an object, not {obj!r}")
        try:
            log = tuple((u, s) for u, s in obj.get("failover_log", ()))
            return cls(
                vbucket,
                obj.get("vb_uuid", 0),
                obj["seqno"],
                obj.get("snap_start"),
                obj.get("snap_end"),
                log,
                obj.get("purge_seqno", 0),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidOffsetError):
                raise
            raise InvalidOffsetError(f"vbucket {vbucket}: malformed offset {obj!r}: {exc}") from exc
