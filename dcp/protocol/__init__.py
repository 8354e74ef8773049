"""Sans-I/O codec of Couchbase's memcached-binary framing and the DCP opcodes.

No trio, no sockets, no clock: bytes in, frames out; fields in, bytes out.
``spec`` (construct) is the executable specification; ``codec`` and ``frames`` are the
struct-based code that runs.
"""

from . import codec
from .errors import (
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    RollbackRequired,
    StatusError,
    for_status,
)
from .frames import DEFAULT_MAX_BODY_SIZE, HEADER_SIZE, Frame, FrameReader, encode_frame
from .opcodes import (
    SEQNO_MAX,
    Datatype,
    DcpOpenFlag,
    DurabilityLevel,
    FrameInfoId,
    HelloFeature,
    Magic,
    Opcode,
    SnapshotMarkerFlag,
    Status,
    StreamEndStatus,
    StreamRequestFlag,
    VBucketState,
)

__all__ = [
    "DEFAULT_MAX_BODY_SIZE",
    "HEADER_SIZE",
    "SEQNO_MAX",
    "Datatype",
    "DcpOpenFlag",
    "DurabilityLevel",
    "Frame",
    "FrameInfoId",
    "FrameReader",
    "HelloFeature",
    "LocalProtocolError",
    "Magic",
    "Opcode",
    "ProtocolError",
    "RemoteProtocolError",
    "RollbackRequired",
    "SnapshotMarkerFlag",
    "Status",
    "StatusError",
    "StreamEndStatus",
    "StreamRequestFlag",
    "VBucketState",
    "codec",
    "encode_frame",
    "for_status",
]
