"""Flow control lives in ``dcp.protocol.flow_control`` (the session owns it); this name stays."""

from dcp.protocol.flow_control import FlowControl

__all__ = ["FlowControl"]
