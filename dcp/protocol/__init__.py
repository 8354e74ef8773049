"""Sans-I/O codec of Couchbase's memcached-binary framing and the DCP opcodes.

No trio, no sockets, no clock: bytes in, frames out; fields in, bytes out.
``spec`` (construct) is the executable specification; ``codec`` and ``frames`` are the
struct-based code that runs, on the layouts of ``layout``. ``session.ClientSession`` is
the client side of a connection (bytes in, ``events`` out) that every client shell
drives (with ``item_frames``, runs of items come as ``events.ItemFrames``, the offsets of
their frames in the received bytes, for a consumer that decodes runs itself);
``server_session.ServerSession`` is the server side (framing of requests, noops,
flow control with ``buffer_log.BufferLog``) that the producer's connection drives.
"""

from . import codec, events, layout
from .errors import (
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    RollbackRequired,
    StatusError,
    for_status,
)
from .frames import DEFAULT_MAX_BODY_SIZE, HEADER_SIZE, Frame, FrameReader, encode_frame
from .layout import vbucket_for_key
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
from .server_session import ServerSession
from .session import ClientSession

__all__ = [
    "DEFAULT_MAX_BODY_SIZE",
    "HEADER_SIZE",
    "SEQNO_MAX",
    "ClientSession",
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
    "ServerSession",
    "SnapshotMarkerFlag",
    "Status",
    "StatusError",
    "StreamEndStatus",
    "StreamRequestFlag",
    "VBucketState",
    "codec",
    "encode_frame",
    "events",
    "for_status",
    "layout",
    "vbucket_for_key",
]
