"""The Spark connector's credentials and TLS, without a JVM: the driver's planning calls
and an executor's stream read (``WireClient`` underneath) against a real server with a
users file and a TLS port (a trustme certificate), and the options that set them up."""

from __future__ import annotations

import base64
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from dcp.consumer import BlockingKvClient
from dcp.producer.users import add_user
from dcp.protocol import FrameReader, Opcode, Status, codec
from dcp.protocol.errors import AccessDenied, AuthenticationError
from dcp.spark.batch_plan import VbRange
from dcp.spark.driver import Planner
from dcp.spark.errors import OptionError, RangeUnavailableError, TlsError
from dcp.spark.executor import read_ranges
from dcp.spark.options import SourceConfig, parse_options
from dcp.spark.wire import WireClient
from tests.security.conftest import Pki, make_pki

from .helpers import ThreadServer

PASSWORD = "s3cret-Pw"
N = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(tmp: Path, pki: Pki, **kw: object) -> ThreadServer:
    users = tmp / "users.toml"
    if not users.exists():
        add_user(users, "spark", ["read", "write", "stream"], PASSWORD, iterations=500)
        add_user(users, "kvonly", ["read"], "kv-pw", iterations=500)
    return ThreadServer(
        tmp / "data",
        num_vbuckets=4,
        users_file=str(users),
        tls_port=_free_port(),
        tls_cert=str(pki.cert_file),
        tls_key=str(pki.key_file),
        **kw,
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[ThreadServer]:
    s = _start(tmp_path_factory.mktemp("srv"), pki)
    try:
        kv = BlockingKvClient(
            "127.0.0.1", s.port, num_vbuckets=4, username="spark", password=PASSWORD
        )
        with kv:
            kv.set_many({f"k{i}": f"v{i}".encode() for i in range(N)})
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DCP_USERNAME", "DCP_PASSWORD", "DCP_TLS_CA", "DCP_TLS_CERT", "DCP_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)


def _cfg(port: int, **opts: str) -> SourceConfig:
    return parse_options({"port": str(port), "retryTimeout": "30", **opts}, streaming=False)


def _plan_and_read(cfg: SourceConfig) -> dict[bytes, bytes]:
    """What a batch query does on the wire: plan on the driver, read on an executor."""
    planner = Planner(cfg)
    try:
        highs, logs = planner.refresh(force=True)
    finally:
        planner.close()
    ranges = [VbRange(vb, logs[vb][0][0], 0, h) for vb, h in highs.items() if h]
    got: dict[bytes, bytes] = {}
    for chunk in read_ranges(cfg, ranges, "sec-test"):
        got.update(zip(map(bytes, chunk.key), map(bytes, chunk.value), strict=True))
    return got


EXPECTED = {f"k{i}".encode(): f"v{i}".encode() for i in range(N)}


@pytest.mark.parametrize("mechanism", [None, "SCRAM-SHA256"])
def test_scram_over_plain_tcp_plans_and_streams(
    server: ThreadServer, mechanism: str | None
) -> None:
    opts = {"username": "spark", "password": PASSWORD}
    if mechanism:
        opts["mechanism"] = mechanism
    assert _plan_and_read(_cfg(server.port, **opts)) == EXPECTED


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "PLAIN"])
def test_tls_with_credentials_plans_and_streams(
    server: ThreadServer, pki: Pki, mechanism: str
) -> None:
    cfg = _cfg(
        server.server.tls_port,
        username="spark",
        password=PASSWORD,
        mechanism=mechanism,
        tlsCaFile=str(pki.ca_file),
    )
    assert cfg.tls is not None
    assert _plan_and_read(cfg) == EXPECTED


def test_tls_socket_is_really_tls(server: ThreadServer, pki: Pki) -> None:
    cfg = _cfg(
        server.server.tls_port,
        username="spark",
        password=PASSWORD,
        tls="true",
        tlsCaFile=str(pki.ca_file),
    )
    with WireClient.for_config(cfg) as client:
        assert client._sock is not None and client._sock.version() in ("TLSv1.2", "TLSv1.3")
        assert client.get_all_vb_seqnos()


def test_wrong_password_fails_at_once_naming_user_and_mechanism(
    server: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    connects: list[int] = []
    real = WireClient.connect

    def counting(self: WireClient) -> WireClient:
        connects.append(1)
        return real(self)

    monkeypatch.setattr(WireClient, "connect", counting)
    cfg = _cfg(server.port, username="spark", password="not-it")  # retryTimeout 30 s
    began = time.monotonic()
    with pytest.raises(AuthenticationError) as err:
        Planner(cfg).refresh(force=True)
    assert "user 'spark' with SCRAM-SHA512" in str(err.value)
    assert "not-it" not in str(err.value)
    vb_range = VbRange(0, 0, 0, 5)
    with pytest.raises(AuthenticationError, match="user 'spark' with PLAIN"):
        list(
            read_ranges(
                _cfg(server.port, username="spark", password="x", mechanism="PLAIN"),
                [vb_range],
                "t",
            )
        )
    assert connects == [1, 1], "an authentication failure was retried"
    assert time.monotonic() - began < 10


def test_no_credentials_or_privilege_is_access_denied(server: ThreadServer) -> None:
    with pytest.raises(AccessDenied):
        Planner(_cfg(server.port)).refresh(force=True)
    cfg = _cfg(server.port, username="kvonly", password="kv-pw")  # no stream privilege
    with pytest.raises(AccessDenied):
        Planner(cfg).refresh(force=True)


def test_plain_to_another_host_in_clear_is_refused_before_any_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opts = {"host": "db1.example.com", "username": "spark", "password": PASSWORD}
    with pytest.raises(OptionError, match=r"PLAIN password in clear to db1\.example\.com"):
        parse_options({**opts, "mechanism": "PLAIN"}, streaming=None)
    parse_options({**opts, "mechanism": "PLAIN", "tls": "true"}, streaming=None)  # TLS: fine
    parse_options(opts, streaming=None)  # SCRAM in clear: fine

    def no_socket(*a: object, **k: object) -> None:
        raise AssertionError("a socket was opened")

    monkeypatch.setattr(socket, "create_connection", no_socket)
    client = WireClient(
        "10.1.2.3", 11210, credentials=parse_options(opts, streaming=None).credentials
    )
    client.credentials = type(client.credentials)("spark", PASSWORD, "PLAIN")  # type: ignore[misc]
    with pytest.raises(OptionError, match="PLAIN"):
        client.connect()


def test_untrusted_certificate_fails_without_retrying(server: ThreadServer, tmp_path: Path) -> None:
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    began = time.monotonic()
    for opts in ({"tlsCaFile": str(other)}, {"tls": "true"}):  # another CA; the system's
        cfg = _cfg(server.server.tls_port, username="spark", password=PASSWORD, **opts)
        with pytest.raises(TlsError, match="certificate is not trusted"):
            Planner(cfg).refresh(force=True)
        with pytest.raises(TlsError, match="certificate is not trusted"):
            list(read_ranges(cfg, [VbRange(0, 0, 0, 5)], "t"))
    assert time.monotonic() - began < 10  # retryTimeout is 30 s


def test_tls_to_the_plaintext_port_says_so(server: ThreadServer, pki: Pki) -> None:
    cfg = _cfg(server.port, tlsCaFile=str(pki.ca_file))
    with pytest.raises(TlsError, match="does not speak TLS"):
        Planner(cfg).refresh(force=True)


def test_mutual_tls_needs_the_client_certificate(tmp_path: Path, pki: Pki) -> None:
    leaf = pki.ca.issue_cert("spark-client")
    cert = tmp_path / "client.pem"
    key = tmp_path / "client.key"
    leaf.private_key_pem.write_to_path(str(key))
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    srv = _start(tmp_path, pki, tls_ca=str(pki.ca_file))
    try:
        base = {"username": "spark", "password": PASSWORD, "tlsCaFile": str(pki.ca_file)}
        port = srv.server.tls_port
        # TLS 1.3: the server may just close after the handshake (a lost connection, retried
        # like one, whose message points at the option); TLS 1.2 refuses in the handshake
        with pytest.raises((TlsError, RangeUnavailableError), match="client certificate"):
            Planner(_cfg(port, retryTimeout="0", **base)).refresh(force=True)
        cfg = _cfg(port, tlsCertFile=str(cert), tlsKeyFile=str(key), **base)
        assert _plan_and_read(cfg) == {}  # an empty bucket, read through mutual TLS
    finally:
        srv.stop()


# ---------------------------------------------------------------------- options


def test_option_names_are_checked_with_suggestions() -> None:
    for wrong, near in (
        ("tlsCaFiles", "tlsCaFile"),
        ("user", "username"),
        ("passwd", "password"),
        ("mechansim", "mechanism"),
    ):
        with pytest.raises(OptionError, match=f"did you mean '{near}'"):
            parse_options({wrong: "x"}, streaming=None)
    cfg = parse_options({"USERNAME": "u", "Password": "p", "TLSCAFILE": ""}, streaming=None)
    assert cfg.credentials is not None and cfg.credentials.username == "u"


def test_option_combinations_are_refused_at_load(pki: Pki, tmp_path: Path) -> None:
    ca = str(pki.ca_file)
    cases = [
        ({"tls": "false", "tlsCaFile": ca}, "tlsCaFile needs TLS"),
        ({"tls": "false", "tlsCertFile": ca}, "tlsCertFile needs TLS"),
        ({"tlsKeyFile": str(pki.key_file)}, "tlsKeyFile needs tlsCertFile"),
        ({"tls": "yes"}, "expected true or false"),
        ({"password": PASSWORD}, "password given without a username"),
        ({"mechanism": "PLAIN"}, "mechanism given without a username"),
        ({"username": "u"}, "no password for user 'u'"),
        ({"username": "u", "password": PASSWORD, "mechanism": "MD5"}, "one of SCRAM-SHA512"),
        ({"tlsCaFile": str(tmp_path / "missing.pem")}, "cannot load the TLS files"),
        ({"tlsCaFile": ca, "tlsCertFile": ca}, "cannot load the TLS files"),  # no key in it
    ]
    for opts, message in cases:
        with pytest.raises(OptionError, match=message) as err:
            parse_options(opts, streaming=None)
        assert PASSWORD not in str(err.value)


def test_environment_fallbacks_and_options_win(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCP_USERNAME", "envuser")
    monkeypatch.setenv("DCP_PASSWORD", PASSWORD)
    monkeypatch.setenv("DCP_TLS_CA", str(pki.ca_file))
    cfg = parse_options({}, streaming=None)
    assert cfg.credentials is not None and cfg.credentials.username == "envuser"
    assert cfg.credentials.password == PASSWORD and cfg.credentials.mechanism == "SCRAM-SHA512"
    assert cfg.tls is not None and cfg.tls.ca == str(pki.ca_file)
    cfg = parse_options({"username": "opt", "password": "o", "tls": "false"}, streaming=None)
    assert cfg.credentials is not None and cfg.credentials.username == "opt"
    assert cfg.tls is None  # tls=false wins over DCP_TLS_CA
    assert PASSWORD not in repr(cfg) and "'o'" not in repr(cfg)
    assert PASSWORD not in repr(parse_options({}, streaming=None))


def test_a_server_without_the_users_keys_is_not_believed() -> None:
    """An impostor that answers SUCCESS to any proof fails the client's check of the
    server's SCRAM signature: no planning call goes to it."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen: list[int] = []

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            reader = FrameReader()
            while data := conn.recv(65536):
                reader.feed(data)
                for f in reader.read_frames():
                    seen.append(f.opcode)
                    status, value = Status.SUCCESS, b""
                    if f.opcode == Opcode.SASL_AUTH:
                        nonce = bytes(f.value).split(b"r=")[1]
                        status = Status.AUTH_CONTINUE
                        value = b"r=" + nonce + b"xyz,s=" + base64.b64encode(b"salt") + b",i=10"
                    elif f.opcode == Opcode.SASL_STEP:
                        value = b"v=" + base64.b64encode(bytes(64))
                    conn.sendall(codec.response(f.opcode, status, opaque=f.opaque, value=value))

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    try:
        cfg = _cfg(port, username="spark", password=PASSWORD)
        with pytest.raises(AuthenticationError, match="signature is wrong"):
            Planner(cfg).refresh(force=True)
    finally:
        listener.close()
        t.join(10)
    assert Opcode.SASL_STEP in seen and Opcode.GET_ALL_VB_SEQNOS not in seen


@pytest.mark.spark
def test_spark_read_with_credentials_over_tls(
    spark: object, server: ThreadServer, pki: Pki
) -> None:
    """The one JVM test: the options reach Spark's planner and its Python workers."""
    df = (
        spark.read.format("dcp")  # type: ignore[attr-defined]
        .option("port", server.server.tls_port)
        .option("username", "spark")
        .option("password", PASSWORD)
        .option("tlsCaFile", str(pki.ca_file))
        .option("numPartitions", 2)
        .load()
    )
    rows = df.select("key", "value").collect()
    assert {r["key"]: bytes(r["value"]) for r in rows} == {
        k.decode(): v for k, v in EXPECTED.items()
    }
