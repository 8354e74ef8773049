"""dcpctl and durability: ``set``/``delete --durability LEVEL`` (the level byte on the
wire, bad levels, the answers a durable write can get) and the ``stable`` column of
``vbuckets``.

The node is ``FakeNode`` taught to take writes: it records each SET/DELETE and answers
with the status the test sets, so the bytes dcpctl sends are checked exactly and the
refusals are played without a cluster. dcpctl runs in-process (``cli.main``) for speed;
its output is what ``capsys`` captured.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from dcp.consumer.kv_requests import LEVEL_NAMES
from dcp.ctl.args import DURABILITY_LEVELS
from dcp.ctl.cli import main
from dcp.protocol import Opcode, Status, codec

from .fake_node import FakeNode
from .support import table_header, table_rows


class KvNode(FakeNode):
    """A ``FakeNode`` that answers HELLO (no features) and takes writes."""

    def __init__(self, num_vbuckets: int) -> None:
        self.writes: list[Any] = []
        self.write_status = Status.SUCCESS
        self.stable: dict[int, int] = {}  # vb -> the vb_N:stable_seqno it reports
        super().__init__(num_vbuckets)

    def _answer(self, f: Any) -> bytes:
        if f.opcode == Opcode.HELLO:
            return codec.response(f.opcode, opaque=f.opaque)
        if f.opcode in (Opcode.SET, Opcode.DELETE):
            self.writes.append(f)
            return codec.response(f.opcode, self.write_status, opaque=f.opaque, cas=9)
        return super()._answer(f)

    def _pairs(self, group: str) -> list[tuple[str, Any]] | None:
        pairs = super()._pairs(group)
        if group == "vbucket-seqno" and pairs is not None:
            pairs += [(f"vb_{vb}:stable_seqno", s) for vb, s in sorted(self.stable.items())]
        return pairs


@pytest.fixture
def node() -> Iterator[KvNode]:
    n = KvNode(8)
    try:
        yield n
    finally:
        n.close()


def run(node: KvNode, *argv: str) -> int:
    return main(["--port", str(node.port), "--timeout", "5", *argv])


def _level(f: Any) -> int | None:
    """The durability level of a request, parsed from its frame infos (None: none sent)."""
    if not f.framing_extras:
        return None
    ((fid, data),) = codec.parse_frame_infos(f.framing_extras)
    assert fid == 1 and len(data) == 3  # durability: level + u16 timeout
    return data[0]


def test_the_choices_are_the_sdk_level_names() -> None:
    assert list(DURABILITY_LEVELS) == list(LEVEL_NAMES)


def test_set_and_delete_send_the_level_asked_for(node: KvNode, capsys) -> None:
    asked = [
        ("set", "k", "v", "--durability", "majority"),
        ("set", "k", "v", "--durability", "MajorityAndPersistActive"),
        ("delete", "k", "--durability", "PERSISTTOMAJORITY"),
        ("set", "k", "v", "--durability", "persistActive"),
        ("delete", "k", "--durable"),
        ("set", "k", "v", "--durability", "none"),
        ("delete", "k"),
    ]
    for argv in asked:
        assert run(node, *argv) == 0, argv
    assert [(f.opcode, _level(f)) for f in node.writes] == [
        (Opcode.SET, 1),
        (Opcode.SET, 2),
        (Opcode.DELETE, 3),
        (Opcode.SET, 4),
        (Opcode.DELETE, 4),
        (Opcode.SET, None),
        (Opcode.DELETE, None),
    ]
    assert all(f.magic == (0x08 if _level(f) else 0x80) for f in node.writes)
    # the durability timeout is what --timeout leaves (5 s, less the answer's margin)
    assert 4000 <= int.from_bytes(node.writes[0].framing_extras[2:4], "big") <= 4750
    out = capsys.readouterr().out
    assert "cas" in out and "9" in out


@pytest.mark.parametrize(
    "argv",
    [
        ("set", "k", "v", "--durability", "quorum"),
        ("delete", "k", "--durability", "persist_to_majority"),
        ("set", "k", "v", "--durable", "--durability", "majority"),
    ],
)
def test_a_bad_level_is_a_usage_error_and_nothing_is_written(node: KvNode, capsys, argv) -> None:
    with pytest.raises(SystemExit) as info:
        run(node, *argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    if "--durable" in argv:
        assert "not allowed with argument" in err
    else:
        assert "invalid choice" in err
        assert all(name in err for name in DURABILITY_LEVELS)
    assert node.writes == []


def test_durability_impossible_and_ambiguous_are_one_line_each(node: KvNode, capsys) -> None:
    node.write_status = Status.DURABILITY_IMPOSSIBLE
    assert run(node, "set", "k", "v", "--durability", "majority") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refused" in err[0] and "nothing was written" in err[0]
    assert "majority" in err[0]
    node.write_status = Status.SYNC_WRITE_AMBIGUOUS
    assert run(node, "delete", "k", "--durability", "persistToMajority") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ambiguous" in err[0] and "persistToMajority" in err[0]
    assert len(node.writes) == 2  # neither retried


def test_vbuckets_shows_the_stable_seqno_or_a_dash(node: KvNode, capsys) -> None:
    node.high.update({0: 10, 1: 7, 2: 5})
    node.stable.update({0: 8, 1: 7})  # vb 2 (and the rest) not reported
    assert run(node, "vbuckets", "--vb", "0-2") == 0
    text = capsys.readouterr().out
    header = table_header(text)
    assert header[:6] == ["vb", "state", "uuid", "high", "persisted", "stable"]
    col = header.index("stable")
    rows = table_rows(text)
    assert [r[col] for r in rows[:3]] == ["8", "7", "-"]
    assert run(node, "vbuckets", "--vb", "0-2", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert [v["stable_seqno"] for v in doc["vbuckets"]] == [8, 7, None]
