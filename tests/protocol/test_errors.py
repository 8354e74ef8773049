"""Error tiers: who broke the protocol, and which status maps to which exception."""

from __future__ import annotations

import pytest

from dcp.protocol import errors
from dcp.protocol.errors import (
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    RollbackRequired,
    StatusError,
    for_status,
)
from dcp.protocol.opcodes import Status


def test_protocol_error_cannot_be_raised_directly():
    with pytest.raises(TypeError):
        ProtocolError("who broke it?")


@pytest.mark.parametrize("cls", [LocalProtocolError, RemoteProtocolError])
def test_both_tiers_are_protocol_errors_and_can_be_caught_as_one(cls):
    with pytest.raises(ProtocolError, match="bad"):
        raise cls("bad")


def test_local_and_remote_tiers_are_distinct():
    assert not issubclass(LocalProtocolError, RemoteProtocolError)
    assert not issubclass(RemoteProtocolError, LocalProtocolError)


@pytest.mark.parametrize(
    ("status", "cls", "retriable"),
    [
        (Status.KEY_ENOENT, errors.KeyNotFound, False),
        (Status.KEY_EEXISTS, errors.KeyExists, False),
        (Status.E2BIG, errors.TooBig, False),
        (Status.EINVAL, errors.InvalidArguments, False),
        (Status.NOT_STORED, errors.NotStored, False),
        (Status.NOT_MY_VBUCKET, errors.NotMyVbucket, True),
        (Status.ERANGE, errors.RangeError, False),
        (Status.ROLLBACK, RollbackRequired, False),
        (Status.UNKNOWN_COMMAND, errors.UnknownCommand, False),
        (Status.ENOMEM, errors.OutOfMemory, True),
        (Status.NOT_SUPPORTED, errors.NotSupported, False),
        (Status.ETMPFAIL, errors.TemporaryFailure, True),
        (Status.EBUSY, errors.TemporaryFailure, True),
        (Status.DCP_STREAMID_INVALID, errors.DcpStreamIdInvalid, False),
    ],
)
def test_for_status_maps_each_status_to_its_class(status, cls, retriable):
    err = for_status(status)
    assert type(err) is cls
    assert isinstance(err, StatusError)
    assert err.status == status
    assert err.retriable is retriable


def test_unknown_statuses_become_a_plain_status_error():
    err = for_status(0xFF01, b"proxy says no")
    assert type(err) is StatusError
    assert err.status == 0xFF01
    assert "0xff01" in str(err) and "proxy says no" in str(err)


def test_rollback_required_carries_the_rollback_seqno_from_the_value():
    err = for_status(Status.ROLLBACK, (90).to_bytes(8, "big"))
    assert isinstance(err, RollbackRequired)
    assert err.rollback_seqno == 90


def test_rollback_without_a_seqno_means_roll_back_to_zero():
    assert for_status(Status.ROLLBACK).rollback_seqno == 0


def test_error_text_in_the_value_becomes_the_message():
    err = for_status(Status.EINVAL, b"unknown control key")
    assert "EINVAL" in str(err) and "unknown control key" in str(err)
    assert err.value == b"unknown control key"
