"""dcpctl against a server with authentication and TLS on, as a user runs it (real
``dcp-server`` and ``dcpctl`` processes): ``user add``, ``--user``/``DCP_PASSWORD``,
wrong passwords, missing privileges, ``--tls-ca``."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ctl.support import DCPCTL, ServerProcess, fails, free_port, ok, ok_json
from tests.security.conftest import Pki, make_pki


def _user_add(users: Path, name: str, roles: str, password: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DCPCTL, "user", "add", name, "--role", roles, "--users-file", str(users)],
        input=password + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture
def secured(tmp_path: Path, pki: Pki) -> Iterator[tuple[ServerProcess, int, Path]]:
    users = tmp_path / "users.toml"
    assert _user_add(users, "admin", "all", "adm1n-pw").returncode == 0
    assert _user_add(users, "reader", "read,stats", "r3ader-pw").returncode == 0
    tls_port = free_port()
    srv = ServerProcess(
        tmp_path / "data",
        "--users-file",
        str(users),
        "--tls-port",
        str(tls_port),
        "--tls-cert",
        str(pki.cert_file),
        "--tls-key",
        str(pki.key_file),
    ).start()
    try:
        yield srv, tls_port, users
    finally:
        srv.kill()


def test_user_add_writes_keys_not_the_password(tmp_path: Path) -> None:
    users = tmp_path / "u.toml"
    r = _user_add(users, "alice", "read,stream", "correct horse")
    assert r.returncode == 0, r.stderr
    assert "alice" in r.stdout and "SIGHUP" in r.stdout
    text = users.read_text()
    assert "correct horse" not in text and "stored_key" in text and "scram-sha512" in text
    line = _user_add(users, "bob", "read,superuser", "pw")
    assert line.returncode == 2 and "superuser" in line.stderr
    empty = _user_add(users, "carol", "read", "")
    assert empty.returncode == 2 and "empty password" in empty.stderr
    assert "bob" not in users.read_text() and "carol" not in users.read_text()


def test_right_and_wrong_passwords(secured: tuple[ServerProcess, int, Path]) -> None:
    srv, _, _ = secured
    env = {"DCP_PASSWORD": "adm1n-pw"}
    ok("set", "k1", "v1", "--user", "admin", port=srv.port, env=env)
    assert ok_json("get", "k1", "--user", "admin", port=srv.port, env=env)["value"] == "v1"
    assert len(ok_json("vbuckets", "--user", "admin", port=srv.port, env=env)["vbuckets"]) == 8
    line = fails("vbuckets", "--user", "admin", port=srv.port, env={"DCP_PASSWORD": "nope"})
    assert "'admin'" in line and "SCRAM-SHA512" in line and "AUTH_ERROR" in line
    line = fails("get", "k1", "--user", "admin", port=srv.port, env={"DCP_PASSWORD": "nope"})
    assert "'admin'" in line and "SCRAM-SHA512" in line
    # PLAIN when asked (loopback allows it)
    ok("get", "k1", "--user", "admin", "--mechanism", "PLAIN", port=srv.port, env=env)


def test_missing_credentials_and_privileges_are_one_line(
    secured: tuple[ServerProcess, int, Path],
) -> None:
    srv, _, _ = secured
    line = fails("vbuckets", port=srv.port)
    assert "EACCESS" in line and "--user" in line
    # no terminal and no password: refused at once, not a hang
    line = fails("vbuckets", "--user", "admin", port=srv.port, code=2)
    assert "no password for user 'admin'" in line
    reader = {"DCP_PASSWORD": "r3ader-pw"}
    ok("stats", "--user", "reader", port=srv.port, env=reader)
    line = fails("set", "k", "v", "--user", "reader", port=srv.port, env=reader)
    assert "EACCESS" in line


def test_dcpctl_over_tls(secured: tuple[ServerProcess, int, Path], pki: Pki) -> None:
    srv, tls_port, _ = secured
    env = {"DCP_PASSWORD": "adm1n-pw"}
    ok("set", "t", "over-tls", "--user", "admin", "--tls-ca", pki.ca_file, port=tls_port, env=env)
    doc = ok_json(
        "get", "t", "--user", "admin", port=tls_port, env={**env, "DCP_TLS_CA": str(pki.ca_file)}
    )
    assert doc["value"] == "over-tls"
    line = fails("vbuckets", "--user", "admin", "--tls", port=tls_port, env=env)
    assert "not trusted" in line
    line = fails("vbuckets", "--user", "admin", "--tls-ca", pki.ca_file, port=srv.port, env=env)
    assert "does not speak TLS" in line
