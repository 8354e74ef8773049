"""What ``KvClient`` returns: ``MutationResult`` (writes) and ``GetResult`` (reads).

Rules of this module:
- Frozen slotted dataclasses, built by the client from the server's answers; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GetResult", "MutationResult"]


@dataclass(frozen=True, slots=True)
class MutationResult:
    """Outcome of a write: the document's new CAS and, when the server reports it, the
    vbucket uuid and seqno of the change (HELLO MutationSeqno)."""

    key: bytes
    vbucket: int
    cas: int
    vb_uuid: int | None = None
    seqno: int | None = None


@dataclass(frozen=True, slots=True)
class GetResult:
    key: bytes
    value: bytes
    flags: int
    cas: int
    datatype: int
