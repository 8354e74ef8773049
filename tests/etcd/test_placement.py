"""compute_map's properties, by hypothesis: balanced from any start, distinct copies, as
many replicas as nodes allow, stable when nothing changed, and adding or removing a
node moves about that node's share of the copies and no more."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from dcp.producer.cluster.placement import Move, compute_map, moves
from dcp.producer.cluster.vbmap import VBucketMap

NAMES = [f"n{i}" for i in range(9)]

sizes = st.tuples(
    st.integers(1, 8),  # nodes
    st.integers(4, 1024),  # vbuckets
    st.integers(0, 2),  # replicas
)


def assert_balanced(m: VBucketMap, nodes: list[str]) -> None:
    width = min(m.num_replicas, len(nodes) - 1)
    counts = m.counts()
    act = [counts.get(n, (0, 0))[0] for n in nodes]
    rep = [counts.get(n, (0, 0))[1] for n in nodes]
    assert max(act) - min(act) <= 1, f"actives {act}"
    assert max(rep) - min(rep) <= 1, f"replicas {rep}"
    assert set(m.servers) <= set(nodes)
    for vb in range(m.num_vbuckets):
        chain = [n for n in m.names(vb) if n is not None]
        assert m.active(vb) is not None, f"vb {vb} has no active"
        assert len(chain) == len(set(chain)) == width + 1, f"vb {vb}: {m.names(vb)}"


def copies_built(old: VBucketMap, new: VBucketMap) -> int:
    return sum(len(mv.new_copies) for mv in moves(old, new))


@settings(max_examples=120, deadline=None)
@given(sizes)
def test_fresh_map_is_balanced_and_stable(s: tuple[int, int, int]) -> None:
    n, v, r = s
    nodes = NAMES[:n]
    m = compute_map(nodes, v, r)
    assert_balanced(m, nodes)
    assert compute_map(nodes, v, r, m) == m  # nothing changed: nothing moves
    assert VBucketMap.from_json(m.to_json(), known=nodes) == m


@settings(max_examples=120, deadline=None)
@given(sizes, st.data())
def test_any_current_map_becomes_balanced(s: tuple[int, int, int], data: st.DataObject) -> None:
    """From an arbitrary (unbalanced, holed, naming departed nodes) map: still balanced."""
    n, v, r = s
    v = min(v, 64)
    pool = NAMES[: n + 2]
    chains = []
    for _ in range(v):
        chain = data.draw(st.lists(st.sampled_from(pool), max_size=r + 1, unique=True))
        if chain and data.draw(st.booleans()):
            chain[0] = None  # an unavailable vbucket after a failover without replica
        chains.append(chain)
    current = VBucketMap.from_names(r, chains, servers=pool)
    nodes = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=n, unique=True))
    m = compute_map(nodes, v, r, current)
    assert_balanced(m, sorted(nodes))


@settings(max_examples=100, deadline=None)
@given(sizes)
def test_adding_a_node_moves_about_its_share(s: tuple[int, int, int]) -> None:
    n, v, r = s
    nodes = NAMES[:n]
    old = compute_map(nodes, v, r)
    new = compute_map([*nodes, "new"], v, r, old)
    assert_balanced(new, [*nodes, "new"])
    width_old, width_new = min(r, n - 1), min(r, n)
    added_copies = v * (width_new - width_old)  # more nodes allow more replicas
    share = math.ceil(v * (1 + width_new) / (n + 1))
    built = copies_built(old, new)
    assert built <= share + added_copies + n, (built, share, added_copies)
    # and the moves chiefly land on the new node
    elsewhere = sum(1 for mv in moves(old, new) for c in mv.new_copies if c != "new")
    assert elsewhere <= added_copies + n


@settings(max_examples=100, deadline=None)
@given(sizes.filter(lambda s: s[0] >= 2), st.data())
def test_removing_a_node_rebuilds_about_its_share(
    s: tuple[int, int, int], data: st.DataObject
) -> None:
    n, v, r = s
    nodes = NAMES[:n]
    old = compute_map(nodes, v, r)
    gone = data.draw(st.sampled_from(nodes))
    rest = [x for x in nodes if x != gone]
    new = compute_map(rest, v, r, old)
    assert_balanced(new, rest)
    lost = sum(a + b for a, b in [old.counts()[gone]])
    built = copies_built(old, new)
    # balance can force a few more (measured: at worst 9 % more, 5 -> 4 nodes with 2
    # replicas, where each vbucket is on 3 of the 4 nodes); typically none or one
    assert built <= lost * 1.1 + n, (built, lost)


def test_moves_lists_changed_chains_only() -> None:
    a = VBucketMap.from_names(1, [["x", "y"], ["y", "x"], ["x", "y"]])
    b = VBucketMap.from_names(1, [["x", "y"], ["x", "y"], ["z", "x"]])
    got = moves(a, b)
    assert got == [Move(1, ("y", "x"), ("x", "y")), Move(2, ("x", "y"), ("z", "x"))]
    assert [m.new_copies for m in got] == [[], ["z"]]
    assert [m.changes_active for m in got] == [True, True]


def test_promotion_preferred_over_a_data_move() -> None:
    """A vbucket whose active left goes to the node that holds its replica when that
    node has room: a promotion, no data to stream."""
    current = VBucketMap.from_names(1, [["a", "b"], ["b", "a"], ["c", "a"], ["a", "c"]])
    m = compute_map(["a", "b"], 4, 1, current)
    assert m.active(2) == "a"  # c left; a held the replica of vb 2
    assert all(len(mv.new_copies) <= 1 for mv in moves(current, m))


def test_more_replicas_than_nodes_allow() -> None:
    m = compute_map(["a", "b"], 8, 2)
    assert all(len(m.replicas(vb)) == 1 for vb in range(8))
    assert all(len(c) == 3 and c[2] == -1 for c in m.chains)
    one = compute_map(["a"], 4, 2)
    assert one.chains == ((0, -1, -1),) * 4
