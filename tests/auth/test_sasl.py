"""dcp.protocol.sasl: SCRAM and PLAIN, both sides, against RFC 7677's exchange and an
independent SCRAM implementation (scramp), and the server's answers to bad input."""

from __future__ import annotations

import base64

import pytest
import scramp

from dcp.protocol.errors import AuthenticationError
from dcp.protocol.opcodes import Status
from dcp.protocol.sasl import (
    MAX_CLIENT_FIRST,
    MECHANISMS,
    SCRAM_MECHANISMS,
    SaslClient,
    SaslServer,
    ScramCredentials,
    make_credentials,
)

ITER = 4096
SCRAMP_NAME = {"SCRAM-SHA256": "SCRAM-SHA-256", "SCRAM-SHA512": "SCRAM-SHA-512"}
CREDS = {m: make_credentials(m, "pencil", iterations=ITER) for m in SCRAM_MECHANISMS}


def lookup(name: str, mechanism: str) -> ScramCredentials | None:
    return CREDS.get(mechanism) if name == "user" else None


def server(allow_plain: bool = False) -> SaslServer:
    return SaslServer(lookup, allow_plain=allow_plain)


def scram(mechanism: str, name: str, password: str, srv: SaslServer | None = None):
    """A whole exchange with our client; (first result, final result, client)."""
    srv = srv or server()
    client = SaslClient(mechanism, name, password)
    first = srv.start(mechanism, client.start())
    assert first.status == Status.AUTH_CONTINUE, first
    final = srv.step(mechanism, client.step(first.value))
    return first, final, client


def test_mechanism_names_are_couchbase_spelling():
    assert MECHANISMS == ("SCRAM-SHA512", "SCRAM-SHA256", "PLAIN")
    assert server().mechanisms == ("SCRAM-SHA512", "SCRAM-SHA256")
    assert server(allow_plain=True).mechanisms == MECHANISMS


def test_client_reproduces_rfc7677_exchange_byte_for_byte():
    # RFC 7677 section 3: user "user", password "pencil".
    cnonce = "rOprNGfwEbeRWgbNEkqO"
    client = SaslClient(
        "SCRAM-SHA256", "user", "pencil", nonce_source=lambda _n: base64.b64decode(cnonce)
    )
    assert client.start() == b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
    server_first = (
        b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
    )
    assert client.step(server_first) == (
        b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
        b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
    )
    client.finish(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")


def test_client_rejects_a_wrong_server_signature():
    _first, final, client = scram("SCRAM-SHA512", "user", "pencil")
    assert final.status == Status.SUCCESS
    forged = b"v=" + base64.b64encode(b"\0" * 64)
    with pytest.raises(AuthenticationError):
        client.finish(forged)


@pytest.mark.parametrize("mechanism", list(SCRAM_MECHANISMS))
def test_our_server_authenticates_scramp_client(mechanism):
    srv = server()
    client = scramp.ScramClient([SCRAMP_NAME[mechanism]], "user", "pencil")
    first = srv.start(mechanism, client.get_client_first().encode())
    assert first.status == Status.AUTH_CONTINUE
    client.set_server_first(first.value.decode())
    final = srv.step(mechanism, client.get_client_final().encode())
    assert final == final.__class__(Status.SUCCESS, final.value, "user")
    client.set_server_final(final.value.decode())  # scramp checks our signature


@pytest.mark.parametrize("mechanism", list(SCRAM_MECHANISMS))
def test_our_client_authenticates_to_scramp_server(mechanism):
    m = scramp.ScramMechanism(SCRAMP_NAME[mechanism])
    info = m.make_auth_info("pencil", iteration_count=ITER)
    srv = m.make_server(lambda _name: info)
    client = SaslClient(mechanism, "user", "pencil")
    srv.set_client_first(client.start().decode())
    final = client.step(srv.get_server_first().encode())
    srv.set_client_final(final.decode())  # scramp checks our proof
    client.finish(srv.get_server_final().encode())


@pytest.mark.parametrize("mechanism", list(SCRAM_MECHANISMS))
def test_stored_keys_match_scramp_derivation(mechanism):
    salt = b"0123456789abcdef"
    ours = make_credentials(mechanism, "pencil", salt=salt, iterations=ITER)
    theirs = scramp.ScramMechanism(SCRAMP_NAME[mechanism]).make_auth_info(
        "pencil", iteration_count=ITER, salt=salt
    )
    assert (ours.salt, ours.stored_key, ours.server_key, ours.iterations) == theirs


@pytest.mark.parametrize("mechanism", list(SCRAM_MECHANISMS))
def test_scram_success_and_server_signature(mechanism):
    first, final, client = scram(mechanism, "user", "pencil")
    salt = base64.b64encode(CREDS[mechanism].salt)
    assert first.value.split(b",")[1:] == [b"s=" + salt, b"i=4096"]
    assert final.status == Status.SUCCESS and final.username == "user"
    client.finish(final.value)


@pytest.mark.parametrize("mechanism", list(SCRAM_MECHANISMS))
def test_wrong_password_and_unknown_user_look_the_same(mechanism):
    _f, wrong, _c = scram(mechanism, "user", "pencil2")
    first_a, unknown, _c = scram(mechanism, "nobody", "pencil")
    assert wrong.status == unknown.status == Status.AUTH_ERROR
    assert wrong.value == unknown.value and unknown.username is None
    # the dummy user's challenge is stable: a second probe cannot tell it from a real one
    first_b, _u, _c = scram(mechanism, "nobody", "pencil")
    assert first_a.value.split(b",")[1:] == first_b.value.split(b",")[1:]


def test_unknown_mechanism_is_auth_error():
    assert server().start("SCRAM-SHA1", b"n,,n=user,r=abc").status == Status.AUTH_ERROR
    assert server().start("CRAM-MD5", b"").status == Status.AUTH_ERROR


def test_plain_over_trusted_connection():
    srv = server(allow_plain=True)
    ok = srv.start("PLAIN", SaslClient("PLAIN", "user", "pencil").start())
    assert (ok.status, ok.username) == (Status.SUCCESS, "user")
    assert srv.start("PLAIN", b"authz\0user\0pencil\0").status == Status.SUCCESS  # authzid, NUL
    assert srv.start("PLAIN", b"\0user\0pencil!").status == Status.AUTH_ERROR
    assert srv.start("PLAIN", b"\0nobody\0pencil").status == Status.AUTH_ERROR
    for bad in (b"user\0pencil", b"\0\0pencil", b"\0user", b"\0\xff\0x", b"a\0" * 600):
        assert srv.start("PLAIN", bad).status == Status.EINVAL, bad


def test_plain_refused_when_not_allowed():
    r = server(allow_plain=False).start("PLAIN", b"\0user\0pencil")
    assert r.status == Status.AUTH_ERROR and r.username is None


def test_plain_checks_against_sha256_keys_when_sha512_missing():
    creds = make_credentials("SCRAM-SHA256", "pw", iterations=ITER)
    srv = SaslServer(lambda n, m: creds if m == "SCRAM-SHA256" else None, allow_plain=True)
    assert srv.start("PLAIN", b"\0u\0pw").status == Status.SUCCESS
    assert srv.start("PLAIN", b"\0u\0px").status == Status.AUTH_ERROR


@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"y,,n=user,r=abc",  # channel-binding flag other than n
        b"p=tls-unique,,n=user,r=abc",
        b"n,",
        b"n,x,n=user,r=abc",  # authzid without a=
        b"n,,r=abc,n=user",  # n must come first
        b"n,,n=user",  # no nonce
        b"n,,n=user,r=",  # empty nonce
        b"n,,n=user,r=a b",  # nonce with a space
        b"n,,n=,r=abc",
        b"n,,n=us=er,r=abc",  # a bad escape
        b"n,,n=user,r=abc,m=ext",  # extension attribute
        b"n,,n=user,r=abc,r=def",
        b"n,,n=\xff\xfe,r=abc",
        b"n,,n=user,r=" + b"a" * MAX_CLIENT_FIRST,  # over 1 KiB
    ],
)
def test_malformed_client_first_is_einval(message):
    srv = server()
    assert srv.start("SCRAM-SHA512", message).status == Status.EINVAL
    # and no exchange was started
    assert srv.step("SCRAM-SHA512", b"c=biws,r=abc,p=AAAA").status == Status.EINVAL


def test_escaped_user_names():
    creds = make_credentials("SCRAM-SHA256", "pw", iterations=ITER)
    srv = SaslServer(lambda n, m: creds if n == "a,b=c" else None)
    client = SaslClient("SCRAM-SHA256", "a,b=c", "pw")
    assert client.start().startswith(b"n,,n=a=2Cb=3Dc,r=")
    first = srv.start("SCRAM-SHA256", client.start())
    final = srv.step("SCRAM-SHA256", client.step(first.value))
    assert (final.status, final.username) == (Status.SUCCESS, "a,b=c")


def _final_parts(mechanism: str = "SCRAM-SHA512"):
    srv = server()
    client = SaslClient(mechanism, "user", "pencil")
    first = srv.start(mechanism, client.start())
    return srv, client.step(first.value)


@pytest.mark.parametrize(
    "mutate, status",
    [
        (lambda m: m.split(b",p=")[0], Status.EINVAL),  # no proof
        (lambda m: m[: len(m) // 2], Status.EINVAL),  # truncated
        (lambda m: m[:-1], Status.EINVAL),  # proof no longer base64
        (lambda m: m.replace(b"c=biws,", b""), Status.EINVAL),
        (lambda m: m.replace(b"c=biws", b"c=!!"), Status.EINVAL),
        (lambda m: m + b",x=1", Status.EINVAL),
        (lambda m: m.replace(b"c=biws", b"c=eSws"), Status.AUTH_ERROR),  # other gs2 header
        (lambda m: m.replace(b",r=", b",r=X"), Status.AUTH_ERROR),  # other nonce
        (
            lambda m: m.split(b",p=")[0] + b",p=" + base64.b64encode(b"\0" * 64),
            Status.AUTH_ERROR,
        ),
        (lambda m: m.split(b",p=")[0] + b",p=AAAA", Status.AUTH_ERROR),  # short proof
    ],
)
def test_bad_client_final(mutate, status):
    srv, final = _final_parts()
    r = srv.step("SCRAM-SHA512", mutate(final))
    assert r.status == status and r.username is None


def test_step_without_exchange_or_for_another_mechanism():
    assert server().step("SCRAM-SHA512", b"c=biws,r=x,p=AAAA").status == Status.EINVAL
    srv, final = _final_parts("SCRAM-SHA512")
    assert srv.step("SCRAM-SHA256", final).status == Status.EINVAL
    assert srv.step("SCRAM-SHA512", final).status == Status.EINVAL  # that exchange is over


def test_replayed_messages_never_authenticate():
    srv = server()
    client = SaslClient("SCRAM-SHA256", "user", "pencil")
    client_first = client.start()
    first = srv.start("SCRAM-SHA256", client_first)
    final = client.step(first.value)
    assert srv.step("SCRAM-SHA256", final).status == Status.SUCCESS
    # the same final message again: no exchange
    assert srv.step("SCRAM-SHA256", final).status == Status.EINVAL
    # the whole conversation replayed: a fresh server nonce, so the old proof fails
    again = srv.start("SCRAM-SHA256", client_first)
    assert again.status == Status.AUTH_CONTINUE and again.value != first.value
    assert srv.step("SCRAM-SHA256", final).status == Status.AUTH_ERROR
    # and replayed on another connection
    other = server()
    other.start("SCRAM-SHA256", client_first)
    assert other.step("SCRAM-SHA256", final).status == Status.AUTH_ERROR


def test_a_new_auth_drops_the_exchange_in_progress():
    srv = server()
    client = SaslClient("SCRAM-SHA512", "user", "pencil")
    first = srv.start("SCRAM-SHA512", client.start())
    final = client.step(first.value)
    srv.start("SCRAM-SHA512", SaslClient("SCRAM-SHA512", "user", "x").start())
    assert srv.step("SCRAM-SHA512", final).status == Status.AUTH_ERROR


def test_client_refuses_bad_challenges():
    for challenge in (
        b"garbage",
        b"r=zzz,s=AAAA,i=4096",  # a nonce that does not extend ours
        b"s=AAAA,i=4096",
    ):
        client = SaslClient("SCRAM-SHA256", "user", "pencil")
        client.start()
        with pytest.raises(AuthenticationError):
            client.step(challenge)
    client = SaslClient("SCRAM-SHA256", "user", "pencil", nonce_source=lambda n: b"\1" * n)
    nonce = client.start().split(b"r=")[1]
    for bad_i in (b"0", b"99999999999", b"x"):
        with pytest.raises(AuthenticationError):
            client.step(b"r=" + nonce + b"srv,s=AAAA,i=" + bad_i)
    with pytest.raises(AuthenticationError):
        SaslClient("SCRAM-SHA256", "u", "p").step(b"r=a,s=AAAA,i=1")  # step before start
    with pytest.raises(AuthenticationError):
        SaslClient("SCRAM-SHA256", "u", "p").finish(b"v=AAAA")  # no exchange to check
    with pytest.raises(ValueError):
        SaslClient("SCRAM-SHA1", "u", "p")


def test_make_credentials_is_salted_and_validates():
    a = make_credentials("SCRAM-SHA512", "pw", iterations=ITER)
    b = make_credentials("SCRAM-SHA512", "pw", iterations=ITER)
    assert a.salt != b.salt and a.stored_key != b.stored_key
    assert len(a.stored_key) == len(a.server_key) == 64
    with pytest.raises(ValueError):
        make_credentials("PLAIN", "pw")
    with pytest.raises(ValueError):
        make_credentials("SCRAM-SHA256", "pw", iterations=0)
