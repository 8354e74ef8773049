"""Wire vocabulary of the memcached binary protocol (MCBP) and DCP.

Rules of this module:
- Numbers only. Every value here is fixed by Couchbase's protocol (see
  ``protocol_spec/README.md``, sections 1-7); nothing in this file is our invention
  except where a comment says so.
- No behaviour beyond small lookups. Layouts live in ``spec_layouts.py`` (construct, the
  reference) and ``layout.py`` (struct, used by ``codec.py``/``item_codec.py``).
"""

from __future__ import annotations

from enum import IntEnum, IntFlag

__all__ = [
    "SEQNO_MAX",
    "Datatype",
    "DcpOpenFlag",
    "DurabilityLevel",
    "FrameInfoId",
    "HelloFeature",
    "Magic",
    "Opcode",
    "SnapshotMarkerFlag",
    "Status",
    "StreamEndStatus",
    "StreamRequestFlag",
    "VBucketState",
]

#: "Infinity" for seqnos: an endless stream asks for end = 2**64 - 1.
SEQNO_MAX = 0xFFFF_FFFF_FFFF_FFFF


class Magic(IntEnum):
    """First byte of every frame."""

    REQUEST = 0x80
    RESPONSE = 0x81
    ALT_REQUEST = 0x08  # flexible framing extras; byte 2 = framing-extras length
    ALT_RESPONSE = 0x18
    SERVER_REQUEST = 0x82
    SERVER_RESPONSE = 0x83

    @property
    def is_request(self) -> bool:
        return self in (Magic.REQUEST, Magic.ALT_REQUEST, Magic.SERVER_REQUEST)

    @property
    def is_alt(self) -> bool:
        return self in (Magic.ALT_REQUEST, Magic.ALT_RESPONSE)


class Opcode(IntEnum):
    """Opcodes we speak (KV subset plus DCP)."""

    GET = 0x00
    SET = 0x01
    ADD = 0x02
    REPLACE = 0x03
    DELETE = 0x04
    NOOP = 0x0A
    VERSION = 0x0B
    STAT = 0x10
    HELLO = 0x1F
    SASL_LIST_MECHS = 0x20
    SASL_AUTH = 0x21
    SASL_STEP = 0x22
    SET_VBUCKET_STATE = 0x3D
    GET_VBUCKET = 0x3E
    GET_ALL_VB_SEQNOS = 0x48
    DCP_OPEN = 0x50
    DCP_ADD_STREAM = 0x51
    DCP_CLOSE_STREAM = 0x52
    DCP_STREAM_REQ = 0x53
    DCP_GET_FAILOVER_LOG = 0x54
    DCP_STREAM_END = 0x55
    DCP_SNAPSHOT_MARKER = 0x56
    DCP_MUTATION = 0x57
    DCP_DELETION = 0x58
    DCP_EXPIRATION = 0x59
    DCP_FLUSH = 0x5A
    DCP_SET_VBUCKET_STATE = 0x5B
    DCP_NOOP = 0x5C
    DCP_BUFFER_ACK = 0x5D
    DCP_CONTROL = 0x5E
    DCP_SEQNO_ACKNOWLEDGED = 0x61  # replica -> active: u64 seqno held (+ u64 persisted)
    DCP_SEQNO_ADVANCED = 0x64
    GET_CLUSTER_CONFIG = 0xB5  # value: the bucket config JSON clients route with


class Status(IntEnum):
    """Response status codes of the memcached binary protocol; protocol_spec/README.md §7.1
    says which ones this server sends, and when."""

    SUCCESS = 0x00
    KEY_ENOENT = 0x01
    KEY_EEXISTS = 0x02
    E2BIG = 0x03
    EINVAL = 0x04
    NOT_STORED = 0x05
    DELTA_BADVAL = 0x06
    NOT_MY_VBUCKET = 0x07
    DCP_STREAM_NOT_FOUND = 0x0A
    OPAQUE_NO_MATCH = 0x0B
    AUTH_ERROR = 0x20
    AUTH_CONTINUE = 0x21
    ERANGE = 0x22
    ROLLBACK = 0x23
    EACCESS = 0x24
    UNKNOWN_COMMAND = 0x81
    ENOMEM = 0x82
    NOT_SUPPORTED = 0x83
    EINTERNAL = 0x84
    EBUSY = 0x85
    ETMPFAIL = 0x86
    UNKNOWN_COLLECTION = 0x88
    DURABILITY_INVALID_LEVEL = 0xA0
    DURABILITY_IMPOSSIBLE = 0xA1
    SYNC_WRITE_IN_PROGRESS = 0xA2
    SYNC_WRITE_AMBIGUOUS = 0xA3
    DCP_STREAMID_INVALID = 0x8D


class Datatype(IntFlag):
    RAW = 0x00
    JSON = 0x01
    SNAPPY = 0x02
    XATTR = 0x04


class HelloFeature(IntEnum):
    """HELLO feature codes; protocol_spec/README.md §6.1 says which ones this server acts on."""

    TLS = 0x02
    TCPNODELAY = 0x03
    MUTATION_SEQNO = 0x04
    TCPDELAY = 0x05
    XATTR = 0x06
    XERROR = 0x07
    SELECT_BUCKET = 0x08
    SNAPPY = 0x0A
    JSON = 0x0B
    DUPLEX = 0x0C
    ALT_REQUEST_SUPPORT = 0x10
    SYNC_REPLICATION = 0x11
    COLLECTIONS = 0x12


class DcpOpenFlag(IntFlag):
    """DCP_OPEN extras flags."""

    NONE = 0
    PRODUCER = 0x001
    NOTIFIER = 0x002  # invalid today; must be clear
    INCLUDE_XATTRS = 0x004
    NO_VALUE = 0x008
    INCLUDE_DELETE_TIMES = 0x020
    NO_VALUE_WITH_UNDERLYING_DATATYPE = 0x040
    INCLUDE_DELETED_USER_XATTRS = 0x100
    SKIP_DELETES_IN_INITIAL_BACKFILL = 0x200


class StreamRequestFlag(IntFlag):
    """DCP_STREAM_REQ / DCP_ADD_STREAM flags."""

    NONE = 0
    TAKEOVER = 0x001
    DISK_ONLY = 0x002
    TO_LATEST = 0x004
    NO_VALUE = 0x008  # removed in 5.0
    ACTIVE_VB_ONLY = 0x010
    STRICT_VB_UUID = 0x020
    FROM_LATEST = 0x040
    IGNORE_PURGED_TOMBSTONES = 0x080


class SnapshotMarkerFlag(IntFlag):
    NONE = 0
    MEMORY = 0x01
    DISK = 0x02
    CHECKPOINT = 0x04
    ACK = 0x08
    HISTORY = 0x10
    MAY_CONTAIN_DUPLICATES = 0x20


class StreamEndStatus(IntEnum):
    OK = 0
    CLOSED = 1
    STATE_CHANGED = 2
    DISCONNECTED = 3
    SLOW = 4
    BACKFILL_FAIL = 5
    ROLLBACK = 6
    FILTER_EMPTY = 7
    LOST_PRIVILEGES = 8


class VBucketState(IntEnum):
    ACTIVE = 1
    REPLICA = 2
    PENDING = 3
    DEAD = 4


class FrameInfoId(IntEnum):
    """Request frame-info ids of the alt (0x08) framing."""

    BARRIER = 0
    DURABILITY = 1
    DCP_STREAM_ID = 2
    PRESERVE_TTL = 5


class DurabilityLevel(IntEnum):
    NONE = 0
    MAJORITY = 1
    MAJORITY_AND_PERSIST_TO_ACTIVE = 2
    PERSIST_TO_MAJORITY = 3
    #: our extension (protocol_spec §durability): answered once persisted on the active
    #: alone, whatever the replicas hold (Couchbase defines levels 0-3 only)
    PERSIST_TO_ACTIVE = 4
