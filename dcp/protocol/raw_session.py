"""A client session that only frames: for test and tool clients that drive the protocol
themselves.

Rules of this module:
- ``RawSession`` is a ``session.ClientSession`` with no streams and no flow control whose
  ``on_frame`` hands every frame out as its ``frames.Frame``: the decoder
  (``decode.py``) builds a ``Frame`` for every frame of a stream the session does not
  track, so with none tracked every frame reaches ``on_frame``, in wire order. Nothing
  is acted on: noops are not answered, nothing is acked, no opaque is matched; the shell
  does all of that (server tests must see the server's bytes unmodified).
- Framing is the session's, held to ``FrameReader`` by a property test
  (tests/protocol/test_raw_session.py): a broken byte stream raises
  ``RemoteProtocolError`` and the session stays broken.
"""

from __future__ import annotations

from .errors import LocalProtocolError
from .frames import DEFAULT_MAX_BODY_SIZE, Frame
from .session import ClientSession

__all__ = ["RawSession"]


class RawSession(ClientSession):
    """See the module rules: ``receive_data(bytes)`` returns the complete ``Frame``s."""

    def __init__(self, *, max_body_size: int = DEFAULT_MAX_BODY_SIZE) -> None:
        super().__init__(max_body_size=max_body_size)

    def on_frame(self, f: Frame, size: int, out: list) -> int:
        out.append(f)
        return 0

    def stream_request(self, vbucket: int, **_fields: int | bytes) -> tuple[int, bytes]:
        raise LocalProtocolError(
            "a RawSession tracks no streams: build the request with "
            "codec.stream_request and read its frames"
        )
