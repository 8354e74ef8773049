"""``dcp-server`` as an operator runs it: settings from flags/TOML/env, signals, exit codes."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcp.producer.config import ConfigError, ServerConfig, add_arguments, load_config
from dcp.protocol import Opcode, codec

SERVER = [sys.executable, "-m", "dcp.producer"]


def test_settings_precedence_is_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    import argparse

    (tmp_path / "s.toml").write_text(
        '[server]\nport = 1111\nnum_vbuckets = 64\nlog_level = "DEBUG"\n'
    )
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--config", str(tmp_path / "s.toml"), "--port", "3333"])
    cfg = load_config(args, environ={"DCP_PORT": "2222", "DCP_NUM_VBUCKETS": "128"})
    assert (cfg.port, cfg.num_vbuckets, cfg.log_level) == (3333, 128, "DEBUG")
    assert cfg.data_dir == ServerConfig().data_dir


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"DCP_NUM_VBUCKETS": "1000"}, "power of two"),
        ({"DCP_PORT": "70000"}, "port"),
        ({"DCP_CHECKPOINT_MEMORY_QUOTA": "abc"}, "checkpoint_memory_quota"),
        ({"DCP_LOG_LEVEL": "LOUD"}, "log_level"),
        ({"DCP_GIL_SWITCH_INTERVAL": "0"}, "gil_switch_interval"),
    ],
)
def test_bad_settings_are_refused_with_a_message_naming_them(bad, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, environ=bad)


def test_unknown_key_in_config_file_is_refused(tmp_path: Path) -> None:
    import argparse

    (tmp_path / "s.toml").write_text("colour = 'blue'\n")
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ConfigError, match="colour"):
        load_config(p.parse_args(["--config", str(tmp_path / "s.toml")]), environ={})


def _start(data: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen(
        [*SERVER, "--port", "0", "--data-dir", str(data), "--num-vbuckets", "4", *extra],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    assert p.stderr is not None
    for line in p.stderr:
        m = re.search(r"listening host=\S+ port=(\d+)", line)
        if m:
            return p, int(m.group(1))
        assert time.monotonic() < deadline, "server did not start"
    raise AssertionError(f"server exited early with {p.wait()}")


def _roundtrip(port: int, frame: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(frame)
        data = b""
        while len(data) < 24 or len(data) < 24 + codec.U32.unpack_from(data, 8)[0]:
            chunk = s.recv(65536)
            assert chunk
            data += chunk
        return data


def test_bad_flag_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    r = subprocess.run(
        [*SERVER, "--num-vbuckets", "3", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "num_vbuckets" in r.stderr and "Traceback" not in r.stderr


def test_sigterm_stops_cleanly_and_a_restart_adds_no_failover_entry(tmp_path: Path) -> None:
    data = tmp_path / "d"
    key = next(k for k in (b"k%d" % i for i in range(100)) if codec.vbucket_for_key(k, 4) == 1)
    p, port = _start(data)
    try:
        r = _roundtrip(
            port,
            codec.request(
                Opcode.SET, vbucket=1, opaque=1, key=key, value=b"v", extras=codec.store_extras()
            ),
        )
        assert r[6:8] == b"\x00\x00"
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        assert p.stderr is not None
        assert "stopped clean=True" in p.stderr.read()
    finally:
        p.kill()
    p, port = _start(data)
    try:
        r = _roundtrip(port, codec.request(Opcode.STAT, opaque=2, key=b"failovers 1"))
        assert b"vb_1:num_entries" in r
        full = b""
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(codec.request(Opcode.GET, vbucket=1, opaque=3, key=key))
            full = s.recv(65536)
        assert full[6:8] == bytes(2) and full.endswith(b"v")
        r = _roundtrip(port, codec.request(Opcode.DCP_GET_FAILOVER_LOG, vbucket=1, opaque=4))
        assert len(r) == 24 + 16, "a clean restart must not add a failover entry"
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0


def test_kill_9_then_restart_adds_a_failover_entry(tmp_path: Path) -> None:
    data = tmp_path / "d"
    p, port = _start(data)
    _roundtrip(port, codec.request(Opcode.NOOP, opaque=1))
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    p, port = _start(data)
    try:
        r = _roundtrip(port, codec.request(Opcode.DCP_GET_FAILOVER_LOG, vbucket=0, opaque=4))
        assert r[6:8] == bytes(2)
        assert len(r) == 24 + 32, "an unclean restart must add a failover entry"
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0


def test_unusable_data_dir_is_a_one_line_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("not a directory")
    r = subprocess.run(
        [*SERVER, "--port", "0", "--data-dir", str(f)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and str(f) in r.stderr
