"""Opcode -> handler table for client requests (KV and DCP share one port).

Rules of this module: one table, no logic; an opcode not in it is answered
UNKNOWN_COMMAND (never a disconnect), so clients can probe for features.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..protocol.frames import Frame
from ..protocol.opcodes import Status
from .dcp_handlers import DCP_HANDLERS
from .kv_handlers import KV_HANDLERS

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["HANDLERS", "unknown_command"]


def unknown_command(conn: Connection, f: Frame) -> None:
    conn.error(f.opcode, Status.UNKNOWN_COMMAND, f.opaque, f"unknown opcode 0x{f.opcode:02x}")


HANDLERS = {**KV_HANDLERS, **DCP_HANDLERS}
