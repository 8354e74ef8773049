"""The README's example runs as written against a real server (docs stay true)."""

from __future__ import annotations

import re
from pathlib import Path

import trio

from dcp.consumer import KvClient
from dcp.producer.server import DcpServer, ServerConfig

README = Path(__file__).resolve().parent.parent / "README.md"


async def test_readme_five_line_example_runs_against_a_server(tmp_path, capsys) -> None:
    code = re.search(r"## Five lines\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert code, "README lost its example"
    src = code.group(1).replace("trio.run(main)", "")
    async with DcpServer(ServerConfig(port=0, data_dir=str(tmp_path), num_vbuckets=8)) as srv:
        async with KvClient("127.0.0.1", srv.port, num_vbuckets=8) as kv:
            await kv.set("user:1", b"Ada")
        src = src.replace("11210", str(srv.port))
        scope: dict = {}
        exec(compile(src, "README.md", "exec"), scope)
        with trio.fail_after(20):
            await scope["main"]()
    out = capsys.readouterr().out
    assert "b'user:1'" in out
