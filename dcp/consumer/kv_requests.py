"""Encoding the requests of ``KvClient``: keys, documents, durability, GET.

Rules of this module:
- Pure functions over bytes (no I/O); bad arguments raise ``UsageError`` at once.
- A durable request carries its durability timeout at a fixed place (``DURABILITY_AT``):
  requests are encoded once, and ``with_durability_timeout`` rewrites the timeout per
  attempt (as the opaque is rewritten) so that the server's deadline is always the time
  the client will still wait, less a margin for the answer's trip. Without it the
  server's default (30 s) would outlast the client's own timeout, and the client would
  give up before the server could say SYNC_WRITE_AMBIGUOUS.
- A write's level comes from ``durability_level``: a ``DurabilityLevel``, one of the
  ``LEVEL_NAMES`` (any case), or the older ``durable=True``, which means
  PERSIST_TO_ACTIVE (persisted on the active node, what it always meant). Level NONE
  sends no frame info at all: the request is the plain one, byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from dcp.protocol import codec
from dcp.protocol.layout import HDR_STORE, HEADER_SIZE, vbucket_for_key
from dcp.protocol.opcodes import Datatype, DurabilityLevel, Opcode

from .errors import UsageError
from .kv_connection import Op

__all__ = [
    "DURABILITY_AT",
    "LEVEL_NAMES",
    "DocValue",
    "KvItems",
    "doc_bytes",
    "durability_info",
    "durability_level",
    "durability_timeout_ms",
    "get_request",
    "key_bytes",
    "plain_sets",
    "with_durability_timeout",
]

#: A document: bytes and str are stored as they are, dict and list as JSON.
DocValue = bytes | bytearray | memoryview | str | dict[str, Any] | list[Any]
#: What ``set_many`` writes: a mapping key -> document, or (key, document) pairs.
KvItems = Mapping[str, DocValue] | Mapping[bytes, DocValue] | Iterable[tuple[str | bytes, DocValue]]

#: Where the u16 timeout of a durable request lies: its framing extras come right after
#: the header and start with the durability frame info (1 byte id/length, 1 byte level).
DURABILITY_AT = HEADER_SIZE + 2
#: Time kept for the server's answer to travel back (at most a tenth of the time left).
_ANSWER_MARGIN = 0.25


def key_bytes(key: str | bytes) -> bytes:
    k = key.encode() if isinstance(key, str) else bytes(key)
    if not 0 < len(k) <= 250:
        raise UsageError(f"keys must be 1..250 bytes, got {len(k)}")
    return k


def doc_bytes(value: DocValue) -> tuple[bytes, int]:
    """(the bytes, the datatype) of a document."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), 0
    if isinstance(value, str):
        return value.encode(), 0
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":")).encode(), Datatype.JSON
    raise UsageError(f"values must be bytes, str, dict or list, not {type(value).__name__}")


def durability_timeout_ms(seconds_left: float) -> int:
    """The durability timeout (ms) to send when the client will wait ``seconds_left`` more.

    A little shorter than that, so the server's SYNC_WRITE_AMBIGUOUS arrives before the
    client gives up; kept in 1..0xFFFE because 0 means "the server's default" and 0xFFFF
    is reserved (refused with DURABILITY_INVALID_LEVEL).
    """
    ms = int((seconds_left - min(_ANSWER_MARGIN, seconds_left / 10)) * 1000)
    return min(max(ms, 1), 0xFFFE)


#: What ``durability=`` takes as a string (compared lowercased): the names the
#: Couchbase SDKs use for levels 0-3, and ``persistActive`` for our level 4.
LEVEL_NAMES: dict[str, DurabilityLevel] = {
    "none": DurabilityLevel.NONE,
    "majority": DurabilityLevel.MAJORITY,
    "majorityAndPersistActive": DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE,
    "persistToMajority": DurabilityLevel.PERSIST_TO_MAJORITY,
    "persistActive": DurabilityLevel.PERSIST_TO_ACTIVE,
}
_BY_LOWER = {name.lower(): level for name, level in LEVEL_NAMES.items()}


def durability_level(
    durability: DurabilityLevel | str | None, durable: bool | None
) -> DurabilityLevel:
    """The level a write asks for, from its ``durability=`` and ``durable=`` arguments.

    Raises:
        TypeError: both were given, or either has the wrong type.
        UsageError: (a ``ValueError``) an unknown level name or number; the message
            lists the valid names.
    """
    if durability is None:
        if durable is None or durable is False:
            return DurabilityLevel.NONE
        if durable is True:
            return DurabilityLevel.PERSIST_TO_ACTIVE
        raise TypeError(f"durable must be True or False, not {durable!r}")
    if durable is not None:
        raise TypeError("give either durable= or durability=, not both")
    valid = ", ".join(LEVEL_NAMES)
    if isinstance(durability, str):
        level = _BY_LOWER.get(durability.lower())
        if level is None:
            raise UsageError(f"unknown durability level {durability!r}; valid: {valid}")
        return level
    if isinstance(durability, bool) or not isinstance(durability, int):
        raise TypeError(f"durability must be a DurabilityLevel or a name, not {durability!r}")
    try:
        return DurabilityLevel(durability)
    except ValueError:
        raise UsageError(f"unknown durability level {durability!r}; valid: {valid}") from None


def durability_info(level: int, seconds_left: float) -> bytes:
    """The framing extras of a write at ``level`` (b"" for NONE: a plain request), with
    the timeout the client will still wait."""
    if not level:
        return b""
    return codec.durability_frame_info(level, durability_timeout_ms(seconds_left))


def with_durability_timeout(frame: bytes, ms: int) -> bytes:
    """``frame`` (a request encoded with ``durability_info``) with its timeout set to ``ms``."""
    return frame[:DURABILITY_AT] + ms.to_bytes(2, "big") + frame[DURABILITY_AT + 2 :]


_SET = int(Opcode.SET)


def plain_sets(
    pairs: Iterable[tuple[str | bytes, DocValue]], flags: int, expiry: int, nvb: int
) -> list[Op]:
    """Plain SETs (no CAS, not durable) of ``pairs`` routed over ``nvb`` vbuckets: the
    hot path of ``set_many``, with ``codec.request`` inlined (one header pack per item)."""
    codec.store_extras(flags, expiry)  # range check once
    head = HDR_STORE.pack
    hash_key = vbucket_for_key
    ops: list[Op] = []
    append = ops.append
    for key, value in pairs:
        k = key if type(key) is bytes and 0 < len(key) <= 250 else key_bytes(key)
        if type(value) is bytes:
            v = value
            dt = 0
        else:
            v, dt = doc_bytes(value)
        vb = hash_key(k, nvb)
        kl = len(k)
        append(
            Op(
                _SET,
                k,
                vb,
                head(0x80, _SET, kl, 8, dt, vb, 8 + kl + len(v), 0, 0, flags, expiry) + k + v,
                True,
            )
        )
    return ops


def get_request(vb: int, key: bytes) -> bytes:
    return codec.request(Opcode.GET, vbucket=vb, key=key)
