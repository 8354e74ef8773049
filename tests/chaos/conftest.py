"""Reliability tests: the harness in ``tools/chaos*.py`` is importable from here."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parents[2] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))
if "chaos_cli" not in sys.modules:  # tools/chaos.py; "chaos" is this test package's name
    _spec = importlib.util.spec_from_file_location("chaos_cli", TOOLS / "chaos.py")
    assert _spec is not None and _spec.loader is not None
    sys.modules["chaos_cli"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["chaos_cli"])

from dcp.producer.server import DcpServer, ServerConfig  # noqa: E402


@contextlib.asynccontextmanager
async def running_server(data_dir: Path, **overrides: Any) -> AsyncIterator[DcpServer]:
    """An in-process server on a free loopback port."""
    cfg = ServerConfig(host="127.0.0.1", port=0, data_dir=str(data_dir),
                       num_vbuckets=overrides.pop("num_vbuckets", 4), **overrides)
    async with DcpServer(cfg) as server:
        yield server
