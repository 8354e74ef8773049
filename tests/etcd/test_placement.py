"""compute_map's properties, by hypothesis: balanced from any start, distinct copies, as
many replicas as nodes allow, stable when nothing changed, and adding or removing a
node moves about that node's share of the copies and no more."""

from __future__ import annotations

import math

import pytest
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


# --- a returning node's former vbuckets (compute_map's ``prefer``) ---------------------


def failed_over(m: VBucketMap, gone: str) -> VBucketMap:
    """``m`` after a hard failover of ``gone``: its actives are replaced by their first
    replica (promoted), its other slots are emptied, it leaves the server list."""
    chains = [
        [n for n in m.names(vb) if n is not None and n != gone] for vb in range(m.num_vbuckets)
    ]
    return VBucketMap.from_names(
        m.num_replicas, chains, servers=[s for s in m.servers if s != gone]
    )


def preferred_share(m: VBucketMap, node: str, held: set[int]) -> float:
    reps = [vb for vb in range(m.num_vbuckets) if node in m.replicas(vb)]
    assert reps, f"{node} holds no replica"
    return sum(vb in held for vb in reps) / len(reps)


def scratch_built(current: VBucketMap, new: VBucketMap, node: str, held: set[int]) -> int:
    """Copies ``new`` builds that are neither in ``current`` nor data ``node`` still has."""
    return sum(
        1 for mv in moves(current, new) for c in mv.new_copies if not (c == node and mv.vb in held)
    )


@pytest.mark.parametrize("num_vbuckets", [64, 1024])
@pytest.mark.parametrize("between", ["nothing", "rebalance"])
def test_returning_node_gets_its_former_vbuckets_as_replicas(
    num_vbuckets: int, between: str
) -> None:
    """3 nodes, 1 replica; n2 is failed over and comes back with the data of its former
    copies. Straight after the failover the only free replica slots are its former
    vbuckets, so it gets them either way; once the survivors have rebuilt their replicas
    (a rebalance in between), without the preference it gets about the 2/3 that chance
    gives (measured 0.62 with 64 vbuckets, 0.66 with 1024), with it all of them (measured 1.0)."""
    nodes = ["n0", "n1", "n2"]
    start = compute_map(nodes, num_vbuckets, 1)
    held = {vb for vb in range(num_vbuckets) if "n2" in start.names(vb)}
    current = failed_over(start, "n2")
    if between == "rebalance":
        current = compute_map(nodes[:2], num_vbuckets, 1, current)
    plain = compute_map(nodes, num_vbuckets, 1, current)
    back = compute_map(nodes, num_vbuckets, 1, current, prefer={"n2": held})
    assert_balanced(back, nodes)
    with_share = preferred_share(back, "n2", held)
    without_share = preferred_share(plain, "n2", held)
    assert with_share >= 0.9, (with_share, without_share)
    if between == "rebalance":
        assert without_share <= 0.8, without_share  # what the preference is for
    else:
        assert without_share >= 0.9, without_share
    # the preference chose replicas only: the actives are the same
    assert [back.active(vb) for vb in range(num_vbuckets)] == [
        plain.active(vb) for vb in range(num_vbuckets)
    ]
    # copies built from nothing (neither in the map nor n2's former data): about half as
    # many after a rebalance (measured 7 vs 15, 113 vs 228); right after the failover
    # the greedy order changes and may cost one or two (measured 15 vs 14, 227 vs 227)
    fresh_back = scratch_built(current, back, "n2", held)
    fresh_plain = scratch_built(current, plain, "n2", held)
    if between == "rebalance":
        assert fresh_back <= fresh_plain * 0.6, (fresh_back, fresh_plain)
    else:
        assert fresh_back <= fresh_plain * 1.05 + 2, (fresh_back, fresh_plain)


@settings(max_examples=100, deadline=None)
@given(sizes.filter(lambda s: s[0] >= 2), st.data())
def test_prefer_keeps_balance_and_actives(s: tuple[int, int, int], data: st.DataObject) -> None:
    """Any preference, even naming unknown nodes and vbuckets out of range: the map is
    balanced, the actives are those without it, and the out-of-range and unknown parts
    are ignored (the same map as with them filtered out)."""
    n, v, r = s
    v = min(v, 256)
    nodes = NAMES[:n]
    gone = data.draw(st.sampled_from(nodes))
    current = failed_over(compute_map(nodes, v, r), gone)
    if data.draw(st.booleans()):
        current = compute_map([x for x in nodes if x != gone], v, r, current)
    vbs = st.sets(st.integers(-3, v + 3), max_size=v)
    prefer = data.draw(st.dictionaries(st.sampled_from([*nodes, "stranger"]), vbs))
    m = compute_map(nodes, v, r, current, prefer=prefer)
    assert_balanced(m, nodes)
    plain = compute_map(nodes, v, r, current)
    assert [m.active(vb) for vb in range(v)] == [plain.active(vb) for vb in range(v)]
    clean = {k: {vb for vb in x if 0 <= vb < v} for k, x in prefer.items() if k in nodes}
    assert compute_map(nodes, v, r, current, prefer=clean) == m


@settings(max_examples=60, deadline=None)
@given(sizes, st.data())
def test_no_preference_is_the_map_without_one(s: tuple[int, int, int], data: st.DataObject) -> None:
    """prefer=None, empty, or naming nothing usable: exactly the map of a call without
    the argument, so an orchestrator with no record computes what it did before."""
    n, v, r = s
    v = min(v, 256)
    nodes = NAMES[:n]
    current = None
    if data.draw(st.booleans()):
        current = compute_map(NAMES[: n + 1], v, r)
    m = compute_map(nodes, v, r, current)
    for prefer in (None, {}, {nodes[0]: []}, {"stranger": [0, 1]}, {nodes[0]: [-1, v]}):
        assert compute_map(nodes, v, r, current, prefer=prefer) == m, prefer
