"""Error tiers of the protocol layer.

Rules of this module:
- ``ProtocolError`` is never raised itself. ``LocalProtocolError`` means *we* tried to
  build something the protocol forbids (a bug or bad user input to a builder);
  ``RemoteProtocolError`` means bytes from the peer broke the protocol. The I/O layer
  answers the second with EINVAL or by closing that one connection.
- ``StatusError`` and its subclasses carry a response status from the peer. One table,
  ``for_status``, maps a status to its class; ``retriable`` tells callers whether trying
  again later can succeed.
"""

from __future__ import annotations

from .opcodes import Status

__all__ = [
    "AccessDenied",
    "AuthenticationError",
    "DcpStreamIdInvalid",
    "DurabilityImpossibleError",
    "InvalidArguments",
    "KeyExists",
    "KeyNotFound",
    "LocalProtocolError",
    "NotMyVbucket",
    "NotStored",
    "NotSupported",
    "OutOfMemory",
    "ProtocolError",
    "RangeError",
    "RemoteProtocolError",
    "RollbackRequired",
    "StatusError",
    "SyncWriteAmbiguous",
    "TemporaryFailure",
    "TooBig",
    "UnknownCommand",
    "for_status",
]


class ProtocolError(Exception):
    """Base of the two protocol-violation tiers; catch it, never raise it."""

    def __init__(self, msg: str) -> None:
        if type(self) is ProtocolError:
            raise TypeError("raise LocalProtocolError or RemoteProtocolError, not ProtocolError")
        super().__init__(msg)


class LocalProtocolError(ProtocolError):
    """We were asked to produce a frame the protocol does not allow."""

    @classmethod
    def out_of_range(cls, what: str, exc: Exception) -> LocalProtocolError:
        """``struct.error``/``ValueError`` of a builder given a field that does not fit."""
        return cls(f"{what}: field out of range ({exc})")


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol (bad magic, lengths, extras...)."""


class StatusError(Exception):
    """A non-success response status from the peer."""

    status: Status | int = Status.EINTERNAL
    retriable: bool = False

    def __init__(self, status: int, message: str = "", value: bytes = b"") -> None:
        self.status = status
        self.value = value
        try:
            name = Status(status).name
        except ValueError:
            name = f"0x{status:02x}"
        super().__init__(f"{name}: {message}" if message else name)


class KeyNotFound(StatusError):
    pass


class KeyExists(StatusError):
    pass


class TooBig(StatusError):
    pass


class InvalidArguments(StatusError):
    pass


class NotStored(StatusError):
    pass


class NotMyVbucket(StatusError):
    retriable = True


class RangeError(StatusError):
    pass


class RollbackRequired(StatusError):
    """Stream request refused: the client must roll back to ``rollback_seqno`` first."""

    def __init__(self, status: int, message: str = "", value: bytes = b"") -> None:
        super().__init__(status, message, value)
        self.rollback_seqno = int.from_bytes(value[:8], "big") if len(value) >= 8 else 0


class UnknownCommand(StatusError):
    pass


class OutOfMemory(StatusError):
    retriable = True


class NotSupported(StatusError):
    pass


class TemporaryFailure(StatusError):
    retriable = True


class DcpStreamIdInvalid(StatusError):
    pass


class SyncWriteAmbiguous(StatusError):
    """A durable write was not known to be durable by its deadline (SYNC_WRITE_AMBIGUOUS).

    The write was applied in memory and may still be persisted, or may be lost if the
    server stops first: the caller cannot tell which. Not retriable as it is: read the
    key to see what happened, or repeat the write only where repeating it is harmless.
    """

    def __init__(self, status: int, message: str = "", value: bytes = b"") -> None:
        advice = (
            "the durable write may or may not have been persisted: check the document "
            "or retry the write only if repeating it is safe (idempotent)"
        )
        super().__init__(status, f"{message}; {advice}" if message else advice, value)


class DurabilityImpossibleError(StatusError):
    """DURABILITY_IMPOSSIBLE: the vbucket's chain in the cluster map has too few copies
    for the level asked (a majority level with replicas missing); nothing was written.
    Retrying helps only once the map has the copies again."""


class AuthenticationError(StatusError):
    """Authentication failed: the server answered AUTH_ERROR (bad user, password or
    mechanism), or the server's own SCRAM signature did not check out (``sasl.py``)."""

    def __init__(
        self, status: int = Status.AUTH_ERROR, message: str = "", value: bytes = b""
    ) -> None:
        super().__init__(status, message, value)


class AccessDenied(StatusError):
    """EACCESS: not authenticated yet, or the user lacks the privilege the request needs."""


_BY_STATUS: dict[int, type[StatusError]] = {
    Status.KEY_ENOENT: KeyNotFound,
    Status.KEY_EEXISTS: KeyExists,
    Status.E2BIG: TooBig,
    Status.EINVAL: InvalidArguments,
    Status.NOT_STORED: NotStored,
    Status.NOT_MY_VBUCKET: NotMyVbucket,
    Status.ERANGE: RangeError,
    Status.ROLLBACK: RollbackRequired,
    Status.UNKNOWN_COMMAND: UnknownCommand,
    Status.ENOMEM: OutOfMemory,
    Status.NOT_SUPPORTED: NotSupported,
    Status.ETMPFAIL: TemporaryFailure,
    Status.EBUSY: TemporaryFailure,
    Status.DCP_STREAMID_INVALID: DcpStreamIdInvalid,
    Status.SYNC_WRITE_AMBIGUOUS: SyncWriteAmbiguous,
    Status.DURABILITY_IMPOSSIBLE: DurabilityImpossibleError,
    Status.AUTH_ERROR: AuthenticationError,
    Status.EACCESS: AccessDenied,
}


def for_status(status: int, value: bytes = b"", message: str = "") -> StatusError:
    """Build the ``StatusError`` subclass that matches ``status`` (unknown codes too)."""
    cls = _BY_STATUS.get(status, StatusError)
    if not message and value and cls is not RollbackRequired:
        try:
            message = bytes(value[:200]).decode("utf-8", "replace")
        except Exception:  # pragma: no cover - decode with "replace" cannot fail
            message = ""
    return cls(status, message, value)
