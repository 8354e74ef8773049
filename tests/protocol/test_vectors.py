"""The golden vectors in protocol_spec/vectors/ hold both ways, in both codecs, and are fresh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcp.protocol import spec
from tools import vectors as gen_vectors

from . import fastcodec

ROOT = Path(__file__).resolve().parents[2]
VECTORS = sorted((ROOT / "protocol_spec" / "vectors").glob("*.json"))


def _load(path: Path) -> tuple[bytes, dict]:
    vector = json.loads(path.read_text())
    assert vector["name"] == path.stem
    assert vector["description"] and vector["direction"] in ("client->server", "server->client")
    return bytes.fromhex(vector["hex"]), gen_vectors.from_json(vector["fields"])


def test_there_is_a_vector_for_every_frame_kind_we_speak():
    names = {p.stem for p in VECTORS}
    assert len(names) >= 40
    for must in (
        "dcp_mutation_request",
        "dcp_deletion_v2_request",
        "dcp_stream_req_request",
        "dcp_stream_req_response_ok",
        "dcp_stream_req_response_rollback",
        "dcp_snapshot_marker_v2_0_request",
        "set_request_durable",
        "get_all_vb_seqnos_response",
        "hello_request",
        "set_vbucket_state_request_json",
        "get_vbucket_response",
        "dcp_set_vbucket_state_request",
        "dcp_set_vbucket_state_response",
        "dcp_seqno_acknowledged_request",
        "dcp_seqno_acknowledged_request_persisted",
        "dcp_control_request_stable_only",
        "dcp_control_request_consumer_name",
        "set_request_persist_to_active",
        "set_request_persist_to_active_timeout",
    ):
        assert must in names


@pytest.mark.parametrize("path", VECTORS, ids=[p.stem for p in VECTORS])
def test_vector_bytes_decode_to_its_fields_in_both_codecs(path):
    data, fields = _load(path)
    assert spec.to_plain(spec.parse_frame(data)) == fields
    assert fastcodec.decode(data) == fields


@pytest.mark.parametrize("path", VECTORS, ids=[p.stem for p in VECTORS])
def test_vector_fields_encode_to_its_exact_bytes_in_both_codecs(path):
    data, fields = _load(path)
    assert spec.build_frame(fields) == data
    assert fastcodec.encode(fields) == data


def test_checked_in_vectors_are_what_the_generator_writes_now():
    generated = gen_vectors.render_all()
    on_disk = {p.name: p.read_text() for p in VECTORS}
    assert sorted(on_disk) == sorted(generated), "run: python -m tools.vectors"
    for name, text in generated.items():
        assert on_disk[name] == text, f"{name} drifted; run: python -m tools.vectors"


def test_generator_output_is_deterministic():
    assert gen_vectors.render_all() == gen_vectors.render_all()
