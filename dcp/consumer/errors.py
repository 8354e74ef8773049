"""Errors the consumer SDK raises, in two tiers.

Rules of this module:
- Tier 1, usage errors: the caller passed something wrong (bad argument, invalid offset,
  client used after close). Raised immediately, never retried. They subclass
  ``ValueError`` so ``except ValueError`` works.
- Tier 2, transient trouble (connection lost, dead connection, NOT_MY_VBUCKET, ETMPFAIL):
  retried inside the SDK with backoff. Only when retries run out within the configured
  timeout does the caller see ``RetryTimeoutError``, carrying what is known (the
  operation, the vbucket if any, attempts, the last error as ``__cause__``).
- Outcomes the application must decide about are their own classes: ``RollbackError``
  (rollback policy "fail"), ``StreamError`` (the server refused a stream for a reason
  retrying cannot fix) and ``TlsError`` (a certificate or TLS mismatch). Refused
  credentials are the protocol's ``AuthenticationError``, a missing privilege its
  ``AccessDenied``: never retried. Server status errors of single KV operations are the protocol
  layer's ``StatusError`` family (``KeyNotFound``, ``KeyExists``, ``SyncWriteAmbiguous``
  for a durable write whose outcome is unknown, ``DurabilityImpossibleError`` for a
  level the cluster has too few copies for...), re-exported here.
"""

from __future__ import annotations

from dcp.protocol.errors import (
    AccessDenied,
    AuthenticationError,
    DurabilityImpossibleError,
    KeyExists,
    KeyNotFound,
    NotStored,
    StatusError,
    SyncWriteAmbiguous,
)

__all__ = [
    "AccessDenied",
    "AuthenticationError",
    "BatchWriteError",
    "ClientClosedError",
    "ConnectionLostError",
    "DcpClientError",
    "DeadConnectionError",
    "DurabilityImpossibleError",
    "InvalidOffsetError",
    "KeyExists",
    "KeyNotFound",
    "NoNodeAnsweredError",
    "NotStored",
    "RetryTimeoutError",
    "RollbackError",
    "StatusError",
    "StreamError",
    "SyncWriteAmbiguous",
    "TlsError",
    "TransientError",
    "UsageError",
]


class DcpClientError(Exception):
    """Base of every error the consumer SDK defines."""


class UsageError(DcpClientError, ValueError):
    """Tier 1: the caller passed a bad argument. Never retried."""


class InvalidOffsetError(UsageError):
    """An offset (given by the caller or loaded from an offset store) is not valid."""


class ClientClosedError(UsageError):
    """The client was used after ``aclose()``/``close()``."""


class TransientError(DcpClientError):
    """Tier 2: trouble that retrying may fix. Handled inside the SDK."""


class ConnectionLostError(TransientError):
    """The TCP connection closed or broke."""


class DeadConnectionError(ConnectionLostError):
    """Nothing was read for twice the noop interval; the connection was closed."""


class RetryTimeoutError(DcpClientError):
    """Retries of a transient failure did not succeed within the timeout.

    Attributes:
        operation: what was being attempted ("connect", "stream request", "set"...).
        vbucket: the vbucket concerned, or None.
        attempts: how many attempts were made.
        elapsed: seconds spent retrying.
        last_error: the last transient error (also ``__cause__``).
    """

    def __init__(
        self,
        operation: str,
        *,
        vbucket: int | None = None,
        attempts: int = 0,
        elapsed: float = 0.0,
        last_error: BaseException | None = None,
    ) -> None:
        self.operation = operation
        self.vbucket = vbucket
        self.attempts = attempts
        self.elapsed = elapsed
        self.last_error = last_error
        where = f" for vbucket {vbucket}" if vbucket is not None else ""
        super().__init__(
            f"{operation}{where} failed after {attempts} attempt(s) over {elapsed:.1f}s: "
            f"{last_error!r}"
        )


class NoNodeAnsweredError(ConnectionLostError):
    """No node of a bootstrap list (or of the cluster map) could be reached.

    Transient (a cluster may be restarting); when the client's retries run out it is the
    ``last_error`` of the ``RetryTimeoutError`` raised, so the message the application
    sees names every address tried.

    Attributes:
        addresses: the ``HOST:PORT`` strings tried, in order.
        errors: the error each one gave (same order).
    """

    def __init__(self, addresses: list[str], errors: list[BaseException]) -> None:
        self.addresses = addresses
        self.errors = errors
        tried = "; ".join(f"{a}: {e!r}" for a, e in zip(addresses, errors, strict=False))
        super().__init__(f"no node answered (tried {len(addresses)}: {tried})")


class RollbackError(DcpClientError):
    """The server told us to roll back and the rollback policy is "fail".

    Attributes:
        vbucket: the vbucket whose history diverged.
        vb_uuid: the vbucket uuid the client asked with.
        seqno: the start seqno the client asked for.
        rollback_seqno: the seqno the server says the client must roll back to.
    """

    def __init__(self, vbucket: int, vb_uuid: int, seqno: int, rollback_seqno: int) -> None:
        self.vbucket = vbucket
        self.vb_uuid = vb_uuid
        self.seqno = seqno
        self.rollback_seqno = rollback_seqno
        super().__init__(
            f"vbucket {vbucket}: history diverged; asked for seqno {seqno} with vb_uuid "
            f"{vb_uuid}, server requires a rollback to seqno {rollback_seqno}"
        )


class StreamError(DcpClientError):
    """The server refused or ended a stream for a reason retrying cannot fix.

    Attributes:
        vbucket, status (response status or stream-end reason), detail.
    """

    def __init__(self, vbucket: int, status: int, detail: str) -> None:
        self.vbucket = vbucket
        self.status = status
        self.detail = detail
        super().__init__(f"vbucket {vbucket}: {detail} (status/reason 0x{status:02x})")


class TlsError(DcpClientError):
    """The TLS handshake failed for a reason retrying cannot fix: the server's certificate
    is not trusted or does not name the host, the server refused our certificate, or the
    port does not speak TLS."""


class BatchWriteError(DcpClientError):
    """Some writes of a pipelined batch failed.

    Attributes:
        results: one entry per input item, in input order: a ``MutationResult`` or the
            ``StatusError``/``DcpClientError`` that item failed with.
    """

    def __init__(self, results: list) -> None:
        self.results = results
        failed = [r for r in results if isinstance(r, BaseException)]
        super().__init__(f"{len(failed)} of {len(results)} writes failed; first: {failed[0]!r}")
