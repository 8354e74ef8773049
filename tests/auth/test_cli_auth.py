"""``dcp-server`` and auth: the safe default (no users -> loopback only, a public address
refused with one line saying how to add a user), a bad users file refused at start, and
SIGHUP re-reading the users file in a real process."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcp.producer.cli import auth_refusal, is_loopback_host, main
from dcp.producer.config import ServerConfig
from dcp.protocol import Opcode, Status, codec
from dcp.protocol.sasl import SaslClient

from .conftest import password_of, write_users


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "example.com"])
def test_public_address_without_users_refuses_to_start(tmp_path, capsys, host):
    data = tmp_path / "data"
    code = main(["--host", host, "--port", "0", "--data-dir", str(data)])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dcp-server: refusing to listen on {host}")
    assert "dcpctl user add NAME --role all --users-file" in lines[0]
    assert not data.exists()  # nothing was opened


def test_loopback_hosts_need_no_users():
    for host in ("127.0.0.1", "127.8.9.1", "::1", "localhost"):
        assert is_loopback_host(host) and auth_refusal(ServerConfig(host=host)) == ""
    for host in ("", "0.0.0.0", "10.0.0.1", "myhost"):
        assert not is_loopback_host(host)


def test_public_address_with_users_is_allowed(tmp_path):
    users = write_users(tmp_path / "users.toml", {"a": ["read"]})
    assert auth_refusal(ServerConfig(host="0.0.0.0", users_file=str(users))) == ""


def test_bad_users_file_refuses_to_start(tmp_path, capsys):
    bad = tmp_path / "users.toml"
    bad.write_text('[users.x]\nroles = ["god"]\n')
    code = main(["--port", "0", "--data-dir", str(tmp_path / "d"), "--users-file", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and "unknown role 'god'" in err and str(bad) in err
    code = main(["--port", "0", "--data-dir", str(tmp_path / "d"), "--users-file", "/nonexistent"])
    assert code == 2 and "/nonexistent" in capsys.readouterr().err


def _call(sock: socket.socket, frame: bytes) -> tuple[int, bytes]:
    sock.sendall(frame)
    data = b""
    while len(data) < 24 or len(data) < 24 + codec.U32.unpack_from(data, 8)[0]:
        chunk = sock.recv(65536)
        assert chunk, "server closed"
        data += chunk
    status = int.from_bytes(data[6:8], "big")
    key_len, extras_len = int.from_bytes(data[2:4], "big"), data[4]
    return status, data[24 + key_len + extras_len :]


def _wait_for(log: Path, pattern: str, timeout: float = 30.0) -> re.Match[str]:
    """The first match of ``pattern`` in the server's log file, polled until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, log.read_text())
        if m:
            return m
        assert time.monotonic() < deadline, f"no {pattern!r} in the log:\n{log.read_text()}"
        time.sleep(0.05)


def test_sighup_rereads_the_users_file_in_a_real_process(tmp_path):
    users = write_users(tmp_path / "users.toml", {"ops": ["read"]})
    log = tmp_path / "server.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "dcp.producer"),
                *("--port", "0", "--num-vbuckets", "4", "--data-dir", str(tmp_path / "data")),
                *("--users-file", str(users)),
            ],
            stderr=err,
        )
    try:
        port = int(_wait_for(log, r"listening host=\S+ port=(\d+)").group(1))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            client = SaslClient("SCRAM-SHA512", "ops", password_of("ops"))
            status, challenge = _call(s, codec.sasl_auth("SCRAM-SHA512", client.start()))
            assert status == Status.AUTH_CONTINUE
            status, final = _call(s, codec.sasl_step("SCRAM-SHA512", client.step(challenge)))
            assert status == Status.SUCCESS
            client.finish(final)
            key = b"k"
            store = codec.request(
                Opcode.SET,
                vbucket=codec.vbucket_for_key(key, 4),
                extras=codec.store_extras(0, 0),
                key=key,
                value=b"v",
            )
            assert _call(s, store)[0] == Status.EACCESS
            write_users(users, {"ops": ["read", "write"]})
            proc.send_signal(signal.SIGHUP)
            _wait_for(log, r"users file \S+ reloaded")
            assert _call(s, store)[0] == Status.SUCCESS
        users.write_text("not = = toml")
        proc.send_signal(signal.SIGHUP)
        _wait_for(log, "users file not reloaded, keeping the previous users")
        assert proc.poll() is None  # a bad file is no reason to stop
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            status, _ = _call(s, codec.sasl_auth("PLAIN", b"\0ops\0" + password_of("ops").encode()))
            assert status == Status.SUCCESS
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
