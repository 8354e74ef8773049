"""The SASL golden vectors (protocol_spec/vectors/sasl_*, get_response_eaccess) are what
our client sends and what our server answers, byte for byte (the vectors are checked
against both codecs by tests/protocol/test_vectors.py)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from dcp.protocol import Opcode, codec
from dcp.protocol.sasl import SaslClient

from .conftest import connect

VECTORS = Path(__file__).resolve().parents[2] / "protocol_spec" / "vectors"


def vector(name: str) -> bytes:
    return bytes.fromhex(json.loads((VECTORS / f"{name}.json").read_text())["hex"])


def test_client_frames_are_the_vectors():
    client = SaslClient(
        "SCRAM-SHA256",
        "user",
        "pencil",
        nonce_source=lambda _n: base64.b64decode("rOprNGfwEbeRWgbNEkqO"),
    )
    assert codec.sasl_auth("SCRAM-SHA256", client.start(), 32) == vector("sasl_auth_request_scram")
    challenge = vector("sasl_auth_response_continue")[24:]
    final = client.step(challenge)
    assert codec.sasl_step("SCRAM-SHA256", final, 33) == vector("sasl_step_request")
    client.finish(vector("sasl_step_response")[24:])
    plain = SaslClient("PLAIN", "alice", "secret").start()
    assert codec.sasl_auth("PLAIN", plain, 31) == vector("sasl_auth_request_plain")
    assert codec.sasl_list_mechs(30) == vector("sasl_list_mechs_request")


async def _answer(c, request: bytes) -> bytes:
    await c.send(request)
    data = b""
    while len(data) < 24 or len(data) < 24 + codec.U32.unpack_from(data, 8)[0]:
        data += await c.stream.receive_some(4096)
    return data


async def test_server_answers_are_the_vectors(server):
    async with connect(server) as c:
        assert await _answer(c, vector("sasl_list_mechs_request")) == vector(
            "sasl_list_mechs_response"
        )
        get = codec.request(Opcode.GET, opaque=34, key=b"k")
        assert await _answer(c, get) == vector("get_response_eaccess")
        client = SaslClient("SCRAM-SHA256", "u_read", "wrong")
        challenge = await _answer(c, codec.sasl_auth("SCRAM-SHA256", client.start(), 33))
        step = codec.sasl_step("SCRAM-SHA256", client.step(challenge[24:]), 33)
        assert await _answer(c, step) == vector("sasl_step_response_auth_error")
        plain = codec.sasl_auth("PLAIN", b"\0u_read\0pw-u_read", 31)
        assert await _answer(c, plain) == vector("sasl_auth_response_plain")
