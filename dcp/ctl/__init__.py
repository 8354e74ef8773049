"""``dcpctl``, the inspection CLI: live views over the server's port, offline views of
its data directory. It composes public APIs (the SDK, ``dcp.protocol``, the engine's
record decoders) and defines nothing other packages should import; see docs/dcpctl.md.
"""

from .cli import main

__all__ = ["main"]
