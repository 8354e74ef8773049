"""The users file: what add_user writes (no plaintext, both mechanisms, atomic, 0600),
what load accepts, and the one-line errors of a bad file."""

from __future__ import annotations

import base64
import stat
import tomllib

import pytest

from dcp.producer.auth import Users, UsersFileError, add_user, remove_user
from dcp.producer.users import privileges_of
from dcp.protocol.opcodes import Status
from dcp.protocol.sasl import SaslClient, SaslServer

PASSWORD = "s3cret-Passw0rd"


def test_add_user_writes_salted_keys_for_both_mechanisms_and_no_password(tmp_path):
    path = tmp_path / "users.toml"
    add_user(path, "alice", ["read", "stream"], PASSWORD, iterations=1000)
    text = path.read_text()
    assert PASSWORD not in text and base64.b64encode(PASSWORD.encode()).decode() not in text
    data = tomllib.loads(text)
    alice = data["users"]["alice"]
    assert alice["roles"] == ["read", "stream"]
    assert set(alice) == {"roles", "scram-sha512", "scram-sha256"}
    for table in ("scram-sha512", "scram-sha256"):
        assert set(alice[table]) == {"salt", "iterations", "stored_key", "server_key"}
        assert alice[table]["iterations"] == 1000
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # no temporary left (the lock file beside it stays: removing it would race a locker)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".users.toml.lock", "users.toml"]


def test_written_keys_authenticate_with_the_password_only(tmp_path):
    path = tmp_path / "users.toml"
    add_user(path, "alice", ["all"], PASSWORD, iterations=1000)
    users = Users.load(path)
    user = users.get("alice")
    assert user is not None
    assert user.privileges == {"read", "write", "stream", "stats", "admin", "replicate"}
    for mech in ("SCRAM-SHA512", "SCRAM-SHA256"):
        for password, status in ((PASSWORD, Status.SUCCESS), ("wrong", Status.AUTH_ERROR)):
            srv = SaslServer(users.credentials)
            client = SaslClient(mech, "alice", password)
            first = srv.start(mech, client.start())
            assert srv.step(mech, client.step(first.value)).status == status


def test_add_again_replaces_and_keeps_the_others(tmp_path):
    path = tmp_path / "users.toml"
    add_user(path, "alice", ["read"], "one", iterations=100)
    add_user(path, "bob", ["write"], "two", iterations=100)
    before = Users.load(path).credentials("alice", "SCRAM-SHA512")
    add_user(path, "alice", ["stats", "admin"], "three", iterations=100)
    users = Users.load(path)
    assert users.names == ["alice", "bob"]
    assert users.get("alice").privileges == {"stats", "admin"}  # type: ignore[union-attr]
    assert users.credentials("alice", "SCRAM-SHA512") != before
    assert remove_user(path, "alice") is True and remove_user(path, "alice") is False
    assert Users.load(path).names == ["bob"]


def test_user_names_needing_quotes_round_trip(tmp_path):
    path = tmp_path / "users.toml"
    for name in ("a.b", 'q"uote', "sp ace", "ünï", "x=y,z"):
        add_user(path, name, ["read"], "pw", iterations=10)
    assert Users.load(path).names == sorted(["a.b", 'q"uote', "sp ace", "ünï", "x=y,z"])


@pytest.mark.parametrize(
    "name, roles, password",
    [
        ("", ["read"], "pw"),
        ("x" * 129, ["read"], "pw"),
        ("tab\there", ["read"], "pw"),
        ("ok", [], "pw"),
        ("ok", ["superuser"], "pw"),
        ("ok", ["read"], ""),
    ],
)
def test_add_user_refuses_bad_input(tmp_path, name, roles, password):
    with pytest.raises(ValueError):
        add_user(tmp_path / "u.toml", name, roles, password, iterations=10)
    assert not (tmp_path / "u.toml").exists()


def test_add_user_refuses_to_rewrite_a_broken_file(tmp_path):
    path = tmp_path / "users.toml"
    path.write_text("this is not toml = = =")
    with pytest.raises(UsersFileError):
        add_user(path, "alice", ["read"], "pw", iterations=10)
    assert path.read_text() == "this is not toml = = ="


def _valid_entry() -> str:
    salt = base64.b64encode(b"s" * 16).decode()
    key = base64.b64encode(b"k" * 64).decode()
    return (
        f'[users.alice.scram-sha512]\nsalt = "{salt}"\niterations = 10\n'
        f'stored_key = "{key}"\nserver_key = "{key}"\n'
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("x = 1\n", "unknown top-level keys ['x']"),
        ("users = 3\n", "'users' must be a table"),
        ("[users.alice]\n", "roles must be a non-empty list"),
        ('[users.alice]\nroles = ["root"]\n', "unknown role 'root'"),
        ('[users.alice]\nroles = ["read"]\n', "no credentials"),
        ('[users.alice]\nroles = ["read"]\npassword = "pw"\n', "unknown keys ['password']"),
        ('[users.alice]\nroles = ["read"]\n' + _valid_entry().replace("= 10", "= 0"), "iterations"),
        (
            '[users.alice]\nroles = ["read"]\n'
            + _valid_entry().replace('stored_key = "', 'stored_key = "!'),
            "stored_key is not base64",
        ),
        (
            '[users.alice]\nroles = ["read"]\n'
            + _valid_entry().replace("scram-sha512", "scram-sha256"),  # 64-byte keys
            "stored_key must decode to 32 bytes",
        ),
        ('[users.alice]\nroles = ["read"]\n' + _valid_entry() + "extra = 1\n", "unknown fields"),
    ],
)
def test_bad_users_files_say_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "users.toml"
    path.write_text(text)
    with pytest.raises(UsersFileError) as info:
        Users.load(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_a_valid_hand_written_file_loads(tmp_path):
    path = tmp_path / "users.toml"
    path.write_text('[users.alice]\nroles = ["read", "stats"]\n' + _valid_entry())
    users = Users.load(path)
    assert users.names == ["alice"] and users.credentials("alice", "SCRAM-SHA256") is None
    assert users.credentials("alice", "SCRAM-SHA512").iterations == 10  # type: ignore[union-attr]


def test_missing_file_is_a_users_file_error(tmp_path):
    with pytest.raises(UsersFileError, match="No such file"):
        Users.load(tmp_path / "nope.toml")


def test_roles_to_privileges():
    assert privileges_of(["read", "read"]) == {"read"}
    assert privileges_of(["all"]) == {"read", "write", "stream", "stats", "admin", "replicate"}
    with pytest.raises(ValueError):
        privileges_of(["READ"])


def test_concurrent_adds_all_land(tmp_path):
    """Two ``dcpctl user add`` at once must not lose one: each holds the file's lock
    from reading it to renaming the new one over it."""
    import threading

    path = tmp_path / "users.toml"
    names = [f"user{i}" for i in range(8)]
    start = threading.Barrier(len(names))

    def add(name: str) -> None:
        start.wait()
        for round_ in range(3):
            add_user(path, f"{name}-{round_}", ["read"], "pw", iterations=200)

    threads = [threading.Thread(target=add, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Users.load(path).names == sorted(f"{n}-{r}" for n in names for r in range(3))
