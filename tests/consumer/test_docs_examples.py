"""Every Python example in docs/sdk.md runs against the real server."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import trio

from dcp.producer import server as server_mod

DOC = Path(__file__).resolve().parents[2] / "docs" / "sdk.md"
EXAMPLES = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "DCP_PORT" in b]


def test_the_doc_has_runnable_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
async def test_doc_example_runs(index, tmp_path):
    cfg = server_mod.ServerConfig(
        host="127.0.0.1", port=0, data_dir=str(tmp_path / "d"), log_level="WARNING"
    )
    async with server_mod.DcpServer(cfg) as server:
        env = dict(
            os.environ,
            DCP_PORT=str(server.port),
            DCP_EXAMPLE_ONCE="1",
            DCP_OFFSETS=str(tmp_path / "offsets.json"),
            PYTHONPATH=str(DOC.parents[1]),
        )
        script = tmp_path / "example.py"
        script.write_text(EXAMPLES[index])
        with trio.fail_after(30):
            proc = await trio.run_process(
                [sys.executable, str(script)],
                env=env,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
