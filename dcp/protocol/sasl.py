"""SASL as the memcached binary protocol carries it: SCRAM-SHA512, SCRAM-SHA256 and PLAIN.

Rules of this module:
- Sans-I/O: messages in, messages out. The server side (``SaslServer``) is a state
  machine a connection feeds with the SASL_AUTH / SASL_STEP values it receives; the
  client side (``SaslClient``) makes the values a client sends. Neither touches a socket.
- SCRAM follows RFC 5802 (and RFC 7677 for SHA-256) the way Couchbase's memcached speaks
  it (protocol_spec/README.md, "SASL"): no SASLprep, no channel binding (the GS2 header
  must be ``n,``), ``=2C``/``=3D`` escapes in user names, and the mechanism names without
  a dash before the bit count. The hash and key-derivation primitives are the standard
  library's (``hashlib.pbkdf2_hmac``, ``hmac``); only the message formats are ours.
- The server answers with a ``SaslResult`` whose status is SUCCESS, AUTH_CONTINUE,
  AUTH_ERROR or EINVAL, and nothing else: malformed input is EINVAL, a wrong proof,
  password, nonce or mechanism is AUTH_ERROR. It never raises for what a peer sends.
- An unknown user is not revealed: the exchange continues with a dummy user whose salt
  is derived from the name with a per-process secret (the same name gets the same salt
  every time) and fails at the proof, as a wrong password does.
- Each exchange is used once: a result other than AUTH_CONTINUE ends it, so a replayed
  or a second SASL_STEP finds none (EINVAL), and a replayed first message starts a new
  exchange with a fresh server nonce that the old final message cannot match.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from .errors import AuthenticationError
from .opcodes import Status

__all__ = [
    "DEFAULT_ITERATIONS",
    "MAX_CLIENT_FIRST",
    "MAX_CLIENT_ITERATIONS",
    "MECHANISMS",
    "SCRAM_MECHANISMS",
    "SaslClient",
    "SaslResult",
    "SaslServer",
    "ScramCredentials",
    "is_loopback_host",
    "make_credentials",
]

#: What SASL_LIST_MECHS offers, strongest first (Couchbase's spelling).
MECHANISMS = ("SCRAM-SHA512", "SCRAM-SHA256", "PLAIN")
#: SCRAM mechanism -> hashlib name.
SCRAM_MECHANISMS = {"SCRAM-SHA512": "sha512", "SCRAM-SHA256": "sha256"}
#: PBKDF2 rounds of new credentials: the cost of one guess for whoever steals the users
#: file (and of each PLAIN authentication, which derives the key again).
DEFAULT_ITERATIONS = 15_000
#: A client-first message (or a PLAIN message) longer than this is malformed: a user name
#: and a nonce never need more, and the server should not parse megabytes before a login.
MAX_CLIENT_FIRST = 1024
#: The client-final message: channel binding, the nonces and a base64 proof.
_MAX_CLIENT_FINAL = 2048
#: A client refuses a server asking for more rounds than this (a hostile server could
#: otherwise make it spin for seconds per login: a million SHA-512 rounds is about one).
MAX_CLIENT_ITERATIONS = 1_000_000
_SERVER_NONCE_BYTES = 16
_GS2_HEADER = b"n,,"
_DUMMY_SECRET = secrets.token_bytes(32)


@dataclass(frozen=True, slots=True)
class ScramCredentials:
    """What the server stores for one user and one SCRAM mechanism (RFC 5802 §3): the
    password cannot be recovered from it, only tested at ``iterations`` rounds a guess."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes


@dataclass(frozen=True, slots=True)
class SaslResult:
    """The server's answer to one SASL_AUTH / SASL_STEP: the response status, its value
    (a challenge, the server-final message, or an error text) and, on SUCCESS, the user."""

    status: Status
    value: bytes = b""
    username: str | None = None


def _hash_name(mechanism: str) -> str:
    try:
        return SCRAM_MECHANISMS[mechanism]
    except KeyError:
        raise ValueError(f"not a SCRAM mechanism: {mechanism!r}") from None


def _keys(hash_name: str, salted: bytes) -> tuple[bytes, bytes, bytes]:
    """(client key, stored key, server key) of a salted password (RFC 5802 §3)."""
    client_key = hmac.digest(salted, b"Client Key", hash_name)
    server_key = hmac.digest(salted, b"Server Key", hash_name)
    return client_key, hashlib.new(hash_name, client_key).digest(), server_key


def make_credentials(
    mechanism: str,
    password: str,
    *,
    salt: bytes | None = None,
    iterations: int = DEFAULT_ITERATIONS,
) -> ScramCredentials:
    """The stored form of ``password`` for a SCRAM mechanism (a random salt unless given)."""
    hash_name = _hash_name(mechanism)
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, not {iterations}")
    salt = secrets.token_bytes(hashlib.new(hash_name).digest_size) if salt is None else salt
    salted = hashlib.pbkdf2_hmac(hash_name, password.encode(), salt, iterations)
    _client_key, stored_key, server_key = _keys(hash_name, salted)
    return ScramCredentials(salt, iterations, stored_key, server_key)


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")


def _b64(data: bytes) -> bytes:
    return base64.b64encode(data)


def _unb64(data: bytes) -> bytes:
    """Strict base64 (``ValueError`` on anything else)."""
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"bad base64: {exc}") from None


def _escape_name(name: str) -> bytes:
    return name.replace("=", "=3D").replace(",", "=2C").encode()


def _unescape_name(raw: bytes) -> str:
    """A SCRAM ``saslname``: ``=2C`` is a comma, ``=3D`` an equals sign; any other ``=``
    is malformed (``ValueError``), as is invalid UTF-8."""
    text = raw.decode("utf-8")
    out = text.replace("=2C", ",").replace("=3D", "=")
    if text.count("=") != text.count("=2C") + text.count("=3D"):
        raise ValueError("bad '=' escape in the user name")
    return out


def _attributes(message: bytes, allowed: tuple[bytes, ...]) -> dict[bytes, bytes]:
    """``a=value,b=value`` -> {a: value}; only the ``allowed`` one-letter names, each
    once (``ValueError`` otherwise)."""
    attrs: dict[bytes, bytes] = {}
    for part in message.split(b","):
        name, sep, value = part.partition(b"=")
        if not sep or name not in allowed or name in attrs:
            raise ValueError(f"unexpected attribute {part[:20]!r}")
        attrs[name] = value
    return attrs


def _printable_nonce(nonce: bytes) -> bool:
    return bool(nonce) and all(0x21 <= c <= 0x7E and c != 0x2C for c in nonce)


def _dummy_credentials(username: str, mechanism: str) -> ScramCredentials:
    """Stand-in credentials for an unknown user: stable per name in this process (so a
    repeated probe sees the same salt), matching no password (random keys)."""
    hash_name = _hash_name(mechanism)
    size = hashlib.new(hash_name).digest_size
    salt = hmac.digest(_DUMMY_SECRET, mechanism.encode() + b"\0" + username.encode(), hash_name)
    return ScramCredentials(
        salt[:size], DEFAULT_ITERATIONS, secrets.token_bytes(size), secrets.token_bytes(size)
    )


class _Exchange:
    """A SCRAM exchange waiting for the client-final message."""

    __slots__ = (
        "credentials",
        "first_bare",
        "gs2_header",
        "known",
        "mechanism",
        "nonce",
        "server_first",
        "username",
    )

    def __init__(
        self,
        mechanism: str,
        username: str,
        known: bool,
        credentials: ScramCredentials,
        gs2_header: bytes,
        first_bare: bytes,
        nonce: bytes,
        server_first: bytes,
    ) -> None:
        self.mechanism = mechanism
        self.username = username
        self.known = known
        self.credentials = credentials
        self.gs2_header = gs2_header
        self.first_bare = first_bare
        self.nonce = nonce
        self.server_first = server_first


Lookup = Callable[[str, str], "ScramCredentials | None"]


class SaslServer:
    """The server side of one connection's SASL exchanges (see the module rules).

    ``lookup(username, mechanism)`` returns that user's stored credentials for a SCRAM
    mechanism, or None when there is no such user. PLAIN passwords are checked against
    the SCRAM-SHA512 credentials (SCRAM-SHA256 when those are missing) by deriving the
    key again with their salt and iterations: no plaintext is ever stored.
    ``allow_plain`` is False unless the connection is TLS or loopback: PLAIN sends the
    password itself.
    """

    def __init__(
        self,
        lookup: Lookup,
        *,
        nonce_source: Callable[[int], bytes] = secrets.token_bytes,
        allow_plain: bool = False,
    ) -> None:
        self._lookup = lookup
        self._nonce_source = nonce_source
        self.allow_plain = allow_plain
        self._pending: _Exchange | None = None

    @property
    def mechanisms(self) -> tuple[str, ...]:
        """What this connection may use (SASL_LIST_MECHS)."""
        return MECHANISMS if self.allow_plain else tuple(SCRAM_MECHANISMS)

    def start(self, mechanism: str, data: bytes) -> SaslResult:
        """SASL_AUTH: a new exchange (any exchange in progress is dropped)."""
        self._pending = None
        try:
            if mechanism == "PLAIN":
                if not self.allow_plain:
                    return _error("PLAIN is only allowed over TLS or loopback")
                return self._plain(bytes(data))
            if mechanism in SCRAM_MECHANISMS:
                return self._client_first(mechanism, bytes(data))
        except ValueError as exc:  # UnicodeDecodeError included
            return _invalid(str(exc))
        return _error(f"unknown mechanism {mechanism[:40]!r}")

    def step(self, mechanism: str, data: bytes) -> SaslResult:
        """SASL_STEP: the client-final message of the exchange in progress."""
        pending, self._pending = self._pending, None  # one attempt per exchange
        if pending is None:
            return _invalid("no SASL exchange in progress (send SASL_AUTH first)")
        if mechanism != pending.mechanism:
            return _invalid(f"SASL_STEP for {mechanism[:40]!r} during {pending.mechanism}")
        try:
            return self._client_final(pending, bytes(data))
        except ValueError as exc:
            return _invalid(str(exc))

    # ------------------------------------------------------------------ PLAIN

    def _plain(self, data: bytes) -> SaslResult:
        if len(data) > MAX_CLIENT_FIRST:
            return _invalid(f"PLAIN message over {MAX_CLIENT_FIRST} bytes")
        if data.endswith(b"\0"):
            data = data[:-1]  # tolerated, as memcached does
        parts = data.split(b"\0")
        if len(parts) != 3 or not parts[1]:
            return _invalid("PLAIN message must be [authzid] NUL user NUL password")
        username, password = parts[1].decode("utf-8"), parts[2]
        mechanism, creds = "SCRAM-SHA512", self._lookup(username, "SCRAM-SHA512")
        if creds is None:
            mechanism, creds = "SCRAM-SHA256", self._lookup(username, "SCRAM-SHA256")
        known = creds is not None
        if creds is None:
            mechanism, creds = "SCRAM-SHA512", _dummy_credentials(username, "SCRAM-SHA512")
        hash_name = SCRAM_MECHANISMS[mechanism]
        salted = hashlib.pbkdf2_hmac(hash_name, password, creds.salt, creds.iterations)
        _client_key, stored_key, _server_key = _keys(hash_name, salted)
        if hmac.compare_digest(stored_key, creds.stored_key) and known:
            return SaslResult(Status.SUCCESS, b"", username)
        return _error("authentication failed")

    # ------------------------------------------------------------------ SCRAM

    def _client_first(self, mechanism: str, data: bytes) -> SaslResult:
        if len(data) > MAX_CLIENT_FIRST:
            return _invalid(f"client-first message over {MAX_CLIENT_FIRST} bytes")
        if not data.startswith(b"n,"):
            return _invalid("client-first message must start with 'n,' (no channel binding)")
        authzid_end = data.find(b",", 2)
        if authzid_end < 0:
            return _invalid("client-first message has no GS2 header")
        authzid = data[2:authzid_end]
        if authzid and not authzid.startswith(b"a="):
            return _invalid("bad authzid in the GS2 header")
        gs2_header, bare = data[: authzid_end + 1], data[authzid_end + 1 :]
        attrs = _attributes(bare, (b"n", b"r"))
        if b"n" not in attrs or b"r" not in attrs or not bare.startswith(b"n="):
            return _invalid("client-first message needs n=<user>,r=<nonce>")
        username = _unescape_name(attrs[b"n"])
        if not username or not _printable_nonce(attrs[b"r"]):
            return _invalid("empty user name or bad client nonce")
        creds = self._lookup(username, mechanism)
        known = creds is not None
        if creds is None:
            creds = _dummy_credentials(username, mechanism)
        nonce = attrs[b"r"] + self._nonce_source(_SERVER_NONCE_BYTES).hex().encode()
        server_first = b"r=%s,s=%s,i=%d" % (nonce, _b64(creds.salt), creds.iterations)
        self._pending = _Exchange(
            mechanism, username, known, creds, gs2_header, bare, nonce, server_first
        )
        return SaslResult(Status.AUTH_CONTINUE, server_first)

    def _client_final(self, ex: _Exchange, data: bytes) -> SaslResult:
        if len(data) > _MAX_CLIENT_FINAL:
            return _invalid(f"client-final message over {_MAX_CLIENT_FINAL} bytes")
        without_proof, sep, proof_part = data.rpartition(b",p=")
        if not sep:
            return _invalid("client-final message needs c=, r= and p=")
        attrs = _attributes(without_proof, (b"c", b"r"))
        if set(attrs) != {b"c", b"r"}:
            return _invalid("client-final message needs c=, r= and p=")
        proof = _unb64(proof_part)
        if _unb64(attrs[b"c"]) != ex.gs2_header or attrs[b"r"] != ex.nonce:
            return _error("channel binding or nonce does not match this exchange")
        hash_name = SCRAM_MECHANISMS[ex.mechanism]
        auth_message = b",".join((ex.first_bare, ex.server_first, without_proof))
        signature = hmac.digest(ex.credentials.stored_key, auth_message, hash_name)
        if len(proof) != len(signature):
            return _error("authentication failed")
        client_key = _xor(proof, signature)
        good = hmac.compare_digest(
            hashlib.new(hash_name, client_key).digest(), ex.credentials.stored_key
        )
        if not (good and ex.known):
            return _error("authentication failed")
        server_signature = hmac.digest(ex.credentials.server_key, auth_message, hash_name)
        return SaslResult(Status.SUCCESS, b"v=" + _b64(server_signature), ex.username)


def _error(text: str) -> SaslResult:
    return SaslResult(Status.AUTH_ERROR, text.encode())


def _invalid(text: str) -> SaslResult:
    return SaslResult(Status.EINVAL, text.encode())


class SaslClient:
    """The client side of one authentication: ``start()`` is the SASL_AUTH value; for
    SCRAM, ``step(challenge)`` (the AUTH_CONTINUE value; it derives the key, up to
    ``MAX_CLIENT_ITERATIONS`` PBKDF2 rounds: async callers run it in a worker thread) is
    the SASL_STEP value and
    ``finish(server_final)`` (the SUCCESS value) checks the server's signature, so the
    client knows the server holds the user's keys. PLAIN is one message and no check.
    Anything wrong raises ``AuthenticationError``."""

    def __init__(
        self,
        mechanism: str,
        username: str,
        password: str,
        nonce_source: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        if mechanism != "PLAIN" and mechanism not in SCRAM_MECHANISMS:
            raise ValueError(f"unsupported SASL mechanism {mechanism!r}; one of {MECHANISMS}")
        self.mechanism = mechanism
        self.username = username
        self._password = password
        self._nonce = _b64(nonce_source(18))
        self._first_bare = b""
        self._server_signature: bytes | None = None

    def start(self) -> bytes:
        if self.mechanism == "PLAIN":
            return b"\0" + self.username.encode() + b"\0" + self._password.encode()
        self._first_bare = b"n=" + _escape_name(self.username) + b",r=" + self._nonce
        return _GS2_HEADER + self._first_bare

    def step(self, challenge: bytes) -> bytes:
        if self.mechanism == "PLAIN" or not self._first_bare:
            raise AuthenticationError(Status.AUTH_ERROR, "no SCRAM exchange to continue")
        challenge = bytes(challenge)
        try:
            attrs = _attributes(challenge, (b"r", b"s", b"i"))
            nonce, salt, iterations = attrs[b"r"], _unb64(attrs[b"s"]), int(attrs[b"i"])
        except (KeyError, ValueError) as exc:
            raise AuthenticationError(Status.AUTH_ERROR, f"bad server challenge: {exc}") from None
        if not nonce.startswith(self._nonce) or nonce == self._nonce:
            raise AuthenticationError(Status.AUTH_ERROR, "server nonce does not extend ours")
        if not 1 <= iterations <= MAX_CLIENT_ITERATIONS:
            raise AuthenticationError(Status.AUTH_ERROR, f"server asks {iterations} iterations")
        hash_name = SCRAM_MECHANISMS[self.mechanism]
        salted = hashlib.pbkdf2_hmac(hash_name, self._password.encode(), salt, iterations)
        client_key, stored_key, server_key = _keys(hash_name, salted)
        without_proof = b"c=" + _b64(_GS2_HEADER) + b",r=" + nonce
        auth_message = b",".join((self._first_bare, challenge, without_proof))
        proof = _xor(client_key, hmac.digest(stored_key, auth_message, hash_name))
        self._server_signature = hmac.digest(server_key, auth_message, hash_name)
        return without_proof + b",p=" + _b64(proof)

    def finish(self, server_final: bytes) -> None:
        if self.mechanism == "PLAIN":
            return
        expected = self._server_signature
        self._server_signature = None
        final = bytes(server_final)
        if expected is None or not final.startswith(b"v="):
            raise AuthenticationError(Status.AUTH_ERROR, "no server signature to verify")
        try:
            got = _unb64(final[2:])
        except ValueError as exc:
            raise AuthenticationError(Status.AUTH_ERROR, f"bad server signature: {exc}") from None
        if not hmac.compare_digest(got, expected):
            raise AuthenticationError(
                Status.AUTH_ERROR, "the server's signature is wrong: it does not hold our keys"
            )


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` names this machine: "localhost", 127.0.0.0/8 or ::1 (brackets
    allowed). PLAIN sends the password in clear, so clients and the server allow it
    without TLS only there. A host name or "" (every interface) is not provably local."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
