"""``dcpctl tail --stable-only`` against a real server in this process: with persistence
paused a single node's stable seqno stays put (dcp/producer/durability.py: one copy, so
stable = persisted), so the stable-only tail shows nothing of the new writes until they
are persisted, while a plain tail shows them at once.

dcpctl runs in-process (``cli.main``) in a worker thread, so the test can look at the
server's connections while the command waits.
"""

from __future__ import annotations

import json
from pathlib import Path

import trio

from dcp.consumer import KvClient
from dcp.ctl.cli import main
from dcp.producer.server import DcpServer, ServerConfig

NUM_VB = 4


async def test_stable_only_tail_waits_for_the_writes_to_be_stable(tmp_path: Path, capsys) -> None:
    cfg = ServerConfig(
        host="127.0.0.1",
        port=0,
        data_dir=str(tmp_path / "d"),
        num_vbuckets=NUM_VB,
        log_level="WARNING",
    )
    async with DcpServer(cfg) as server:
        server.pause_persistence()
        async with KvClient("127.0.0.1", server.port, num_vbuckets=NUM_VB) as kv:
            vb = kv.vbucket_for("a")
            keys = [k for k in (f"k{i}" for i in range(40)) if kv.vbucket_for(k) == vb][:3]
            for k in keys:
                await kv.set(k, b"v")
        argv = ["--port", str(server.port), "--timeout", "20", "tail", "--vb", str(vb)]
        argv += ["--from", "beginning", "--to-latest", "--json"]

        # a plain tail sees the writes while nothing is persisted
        code = await trio.to_thread.run_sync(main, argv)
        assert code == 0
        plain = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert sorted(e["key"] for e in plain if e["type"] == "mutation") == sorted(keys)

        async with trio.open_nursery() as nursery:
            result: list[int] = []

            async def tail() -> None:
                result.append(await trio.to_thread.run_sync(main, [*argv, "--stable-only"]))

            nursery.start_soon(tail)
            try:
                with trio.fail_after(15):
                    while not any(c.options.stable_only for c in server.connections):
                        await trio.sleep(0.05)
                await trio.sleep(0.5)  # time to show something, were it not held back
                held = capsys.readouterr().out
                assert '"mutation"' not in held, held
                assert not result
            finally:  # also when failing: the tail thread can only end once it is stable
                server.resume_persistence()
        assert result == [0]
        events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert sorted(e["key"] for e in events if e["type"] == "mutation") == sorted(keys)
        assert events[-1] == {"type": "stream_end", "vbucket": vb, "reason": "ok"}
