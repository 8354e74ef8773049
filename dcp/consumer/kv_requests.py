"""Encoding the requests of ``KvClient``: keys, documents, durability, GET.

Rules of this module:
- Pure functions over bytes (no I/O); bad arguments raise ``UsageError`` at once.
- A durable request carries its durability timeout at a fixed place (``DURABILITY_AT``):
  requests are encoded once, and ``with_durability_timeout`` rewrites the timeout per
  attempt (as the opaque is rewritten) so that the server's deadline is always the time
  the client will still wait, less a margin for the answer's trip. Without it the
  server's default (30 s) would outlast the client's own timeout, and the client would
  give up before the server could say SYNC_WRITE_AMBIGUOUS.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from dcp.protocol import codec
from dcp.protocol.layout import HEADER_SIZE
from dcp.protocol.opcodes import Datatype, DurabilityLevel, Opcode

from .errors import UsageError

__all__ = [
    "DURABILITY_AT",
    "DocValue",
    "KvItems",
    "doc_bytes",
    "durability_info",
    "durability_timeout_ms",
    "get_request",
    "key_bytes",
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


def durability_info(seconds_left: float) -> bytes:
    """The framing extras of a durable write: PERSIST_TO_MAJORITY with a timeout."""
    return codec.durability_frame_info(
        DurabilityLevel.PERSIST_TO_MAJORITY, durability_timeout_ms(seconds_left)
    )


def with_durability_timeout(frame: bytes, ms: int) -> bytes:
    """``frame`` (a request encoded with ``durability_info``) with its timeout set to ``ms``."""
    return frame[:DURABILITY_AT] + ms.to_bytes(2, "big") + frame[DURABILITY_AT + 2 :]


def get_request(vb: int, key: bytes) -> bytes:
    return codec.request(Opcode.GET, vbucket=vb, key=key)
