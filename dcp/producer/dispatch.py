"""The handler table for what clients send (KV and DCP share one port).

Rules of this module: one table, no logic. ``HANDLERS`` is built once here and handed to
each ``Connection`` by the server (a constructor argument), so the connection's reader
imports no handler module. When a users file is set, each connection gets its own gated
copy instead (``auth.handlers_for``: EACCESS until SASL succeeds, then by privilege). An
opcode not in ``requests`` is answered UNKNOWN_COMMAND (never a disconnect), so clients can
probe for features.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..protocol.events import Rejected, StateAcked
from ..protocol.frames import Frame
from ..protocol.opcodes import Status
from .dcp_handlers import DCP_HANDLERS, handle_response
from .kv_handlers import KV_HANDLERS, set_run
from .vbucket_handlers import VBUCKET_HANDLERS

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["HANDLERS", "Handler", "HandlerTable", "RefusalHandler", "SetRun", "unknown_command"]

#: A request handler: synchronous, queues its own answer.
Handler = Callable[["Connection", Frame], None]
#: What to do when the client answers a DCP message the session reports: a refusal
#: (``Rejected``) or a takeover stream's acknowledged state (``StateAcked``).
RefusalHandler = Callable[["Connection", Rejected | StateAcked], None]
#: The pipelined-SET fast path: (conn, buffer, position, end, max body, answers) ->
#: (position after the SETs applied, SETs applied); see ``kv_handlers.set_run``.
SetRun = Callable[["Connection", bytes, int, int, int, bytearray], tuple[int, int]]


def unknown_command(conn: Connection, f: Frame) -> None:
    conn.error(f.opcode, Status.UNKNOWN_COMMAND, f.opaque, f"unknown opcode 0x{f.opcode:02x}")


@dataclass(frozen=True, slots=True)
class HandlerTable:
    """Who handles what a connection reads."""

    #: client requests by opcode
    requests: Mapping[int, Handler]
    #: a request whose opcode is not in ``requests``
    unknown: Handler
    #: a client's error answer to a DCP message the server sent, or its SUCCESS to a
    #: DCP_SET_VBUCKET_STATE (noop answers and other answers are the connection's
    #: ``ServerSession``'s business)
    response: RefusalHandler
    #: runs of plain SETs, straight from the received bytes
    set_run: SetRun


HANDLERS = HandlerTable(
    requests={**KV_HANDLERS, **VBUCKET_HANDLERS, **DCP_HANDLERS},
    unknown=unknown_command,
    response=handle_response,
    set_run=set_run,
)
