"""Property tests of the fan-out topology (nccl_back/transport/relay/topology.py) and
of the plan's split into the parts its trees carry: no processes, only the
construction, its bounds, a member's removal and late arrivals."""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nccl_back.coord.records import MAX_PARTS
from nccl_back.model.skeleton import Manifest, TensorEntry
from nccl_back.transport import parts, plan
from nccl_back.transport.relay import topology as tp
from nccl_back.transport.relay.topology import Topology

FLEETS = st.integers(1, 4096)
STEPS = st.integers(1, 256)
HOLDERS = st.integers(1, 8)
FAST = settings(max_examples=25, deadline=None)
#: Both constructions of the two trees: for a fixed size, and grown arrival by arrival.
Make = Callable[..., Topology]
MAKERS = pytest.mark.parametrize("make", [tp.build, tp.grown], ids=["build", "grown"])


def deliveries(topo: Topology) -> dict[int, Counter[int]]:
    """How many times each receiver gets each step, walking from the holders down the
    children of each step's tree. Every step of one tree takes the same walk, so each
    tree is walked once and its count applies to each of its steps."""
    reached: list[Counter[int]] = []
    for tree in range(tp.TREES):
        seen: Counter[int] = Counter()
        todo = [tp.holder(h) for h in range(topo.holders)]
        while todo:
            node = todo.pop()
            for child in topo.children(node, tree):
                seen[child] += 1
                assert seen[child] == 1, "a node reached twice: a cycle or a second parent"
                todo.append(child)
        reached.append(seen)
    return {r: Counter({s: reached[topo.tree_of(s)][r] for s in range(topo.steps)})
            for r in topo.receivers}


def assert_exactly_once(topo: Topology, receivers: set[int]) -> None:
    got = deliveries(topo)
    assert set(got) == receivers
    for r in receivers:
        assert got[r] == Counter(dict.fromkeys(range(topo.steps), 1)), r


def max_depth(topo: Topology) -> int:
    return max((topo.depth(r) for r in topo.receivers), default=0)


def max_sends(topo: Topology) -> int:
    return max((topo.sends(r) for r in topo.receivers), default=0)


@MAKERS
@FAST
@given(FLEETS, STEPS, HOLDERS)
def test_every_receiver_gets_every_step_exactly_once(make: Make, n: int, s: int, h: int) -> None:
    """Each receiver gets each of the S steps exactly once, from holders down the trees."""
    assert_exactly_once(make(n, s, h), set(range(n)))


@MAKERS
@FAST
@given(FLEETS, STEPS, HOLDERS)
def test_depth_grows_with_log_n(make: Make, n: int, s: int, h: int) -> None:
    """No receiver is more than D = floor(log2 ceil(N/H)) + 1 hops from its holder."""
    topo = make(n, s, h)
    assert max_depth(topo) <= tp.depth_bound(n, h) <= 2 * math.ceil(math.log2(n)) + 1


@MAKERS
@FAST
@given(FLEETS, STEPS, HOLDERS)
def test_each_node_sends_at_most_one_model(make: Make, n: int, s: int, h: int) -> None:
    """A receiver sends at most S + 1 step-copies, a holder exactly S (when it serves any)."""
    topo = make(n, s, h)
    assert max_sends(topo) <= tp.budget(s) <= s + 1
    for k in range(h):
        assert topo.sends(tp.holder(k)) == (s if k < n else 0)


@MAKERS
@FAST
@given(FLEETS, HOLDERS)
def test_trees_are_interior_disjoint(make: Make, n: int, h: int) -> None:
    """A receiver forwards in at most one of the two trees."""
    topo = make(n, 8, h)
    assert not any(topo.children(r, 0) and topo.children(r, 1) for r in range(n))


@MAKERS
@FAST
@given(FLEETS, HOLDERS)
def test_receivers_are_spread_over_all_holders(make: Make, n: int, h: int) -> None:
    """Each holder serves ceil or floor of N/H receivers, in both trees."""
    topo = make(n, 4, h)
    for tree in range(tp.TREES):
        sizes = [len(topo.subtree(tp.holder(k), tree)) - 1 for k in range(h)]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n


@MAKERS
@FAST
@given(FLEETS, STEPS, HOLDERS, st.data())
def test_parent_and_ancestors_agree(make: Make, n: int, s: int, h: int, data: st.DataObject) -> None:
    """A step's parent is its first ancestor; the ancestors end at the receiver's holder."""
    topo = make(n, s, h)
    r = data.draw(st.integers(0, n - 1))
    k = data.draw(st.integers(0, s - 1))
    up = topo.ancestors(r, k)
    assert up[0] == topo.parent(r, k) and up[-1] == tp.holder(r % h)
    assert r in topo.children(up[0], topo.tree_of(k))


@MAKERS
@FAST
@given(st.integers(2, 4096), STEPS, HOLDERS, st.data())
def test_a_members_removal_keeps_every_step_once_within_slack(
        make: Make, n: int, s: int, h: int, data: st.DataObject) -> None:
    """Without any one member, every survivor still gets every step exactly once, depth
    stays <= 2D - 1 and sends <= budget + ceil(S/2)."""
    topo = make(n, s, h)
    dead = data.draw(st.integers(0, n - 1))
    after = tp.remove(topo, dead)
    assert_exactly_once(after, set(range(n)) - {dead})
    assert max_depth(after) <= 2 * tp.depth_bound(n, h) - 1
    assert max_sends(after) <= tp.budget(s) + math.ceil(s / 2)
    for k in range(h):
        assert after.sends(tp.holder(k)) <= tp.budget(s)


@MAKERS
@FAST
@given(st.integers(2, 4096), STEPS, HOLDERS, st.data())
def test_a_removed_members_children_try_their_ancestors_first(
        make: Make, n: int, s: int, h: int, data: st.DataObject) -> None:
    """The first orphan of a dead member lands on the dead member's own parent."""
    topo = make(n, s, h)
    dead = data.draw(st.integers(0, n - 1))
    after = tp.remove(topo, dead)
    for tree in range(tp.TREES):
        kids = topo.children(dead, tree)
        if kids:
            assert after.parents[tree][kids[0]] == topo.parents[tree][dead]


@MAKERS
@FAST
@given(st.integers(0, 4096), STEPS, HOLDERS)
def test_a_late_arrival_gets_every_step_within_the_bounds(make: Make, n: int, s: int, h: int) -> None:
    """One receiver joining a fan-out in flight gets every step once, as a leaf, with
    depth <= D + 1 and nobody's sends over budget."""
    topo = tp.join(make(n, s, h), new := n)
    assert_exactly_once(topo, set(range(n + 1)))
    assert topo.sends(new) == 0
    assert max_depth(topo) <= tp.depth_bound(max(n, 1), h) + 1
    assert max_sends(topo) <= tp.budget(s)


@MAKERS
@FAST
@given(st.integers(0, 512), STEPS, HOLDERS, st.integers(2, 6))
def test_late_arrivals_in_turn_each_add_at_most_one_hop(make: Make, n: int, s: int, h: int, k: int) -> None:
    """k late arrivals in turn: every one gets every step once, sends stay in budget,
    depth <= D + k."""
    topo = make(n, s, h)
    for new in range(n, n + k):
        topo = tp.join(topo, new)
    assert_exactly_once(topo, set(range(n + k)))
    assert max_sends(topo) <= tp.budget(s)
    assert max_depth(topo) <= tp.depth_bound(max(n, 1), h) + k


@MAKERS
@FAST
@given(st.integers(3, 1024), STEPS, st.integers(1, 4), st.data())
def test_removal_then_arrival_still_delivers_everything(
        make: Make, n: int, s: int, h: int, data: st.DataObject) -> None:
    """A death, then a late arrival, then a second death: every survivor gets every step
    exactly once (bounds are only promised for one event)."""
    topo = make(n, s, h)
    first = data.draw(st.integers(0, n - 1))
    topo = tp.join(tp.remove(topo, first), n)
    second = data.draw(st.sampled_from(sorted(set(range(n + 1)) - {first})))
    topo = tp.remove(topo, second)
    assert_exactly_once(topo, set(range(n + 1)) - {first, second})


@FAST
@given(FLEETS, STEPS, HOLDERS)
def test_the_single_tree_delivers_everything_but_sends_twice(n: int, s: int, h: int) -> None:
    """The comparison design delivers every step once; its interior nodes send 2S."""
    topo = tp.single_tree(n, s, h)
    assert_exactly_once(topo, set(range(n)))
    biggest = math.ceil(n / h)
    assert max_sends(topo) == (2 * s if biggest >= 3 else s if biggest == 2 else 0)


def test_bad_arguments_and_unknown_members_are_refused() -> None:
    """build and grown refuse a negative fleet, no steps or no holder; remove an unknown
    id; join an id in use."""
    for args in ((-1, 4, 1), (4, 0, 1), (4, 4, 0)):
        for make in (tp.build, tp.grown):
            with pytest.raises(ValueError, match="need receivers >= 0, steps >= 1, holders >= 1"):
                make(*args)
    with pytest.raises(KeyError):
        tp.remove(tp.build(4, 4), 9)
    with pytest.raises(ValueError):
        tp.join(tp.build(4, 4), 3)


@functools.cache
def _simulate() -> ModuleType:
    """benchmarks/simulate.py, loaded once from its file (benchmarks is not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "simulate.py"
    spec = importlib.util.spec_from_file_location("simulate", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["simulate"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@MAKERS
@settings(max_examples=20, deadline=None)
@given(st.integers(2, 300), st.integers(1, 64), st.integers(1, 4), st.data())
def test_a_member_killed_at_a_random_step_costs_its_subtree_one_resume(
        make: Make, n: int, s: int, h: int, data: st.DataObject) -> None:
    """In the simulated fan-out, a member killed at any moment leaves every survivor with
    every step exactly once, the slowest within detect + set-up + one transfer + 4D steps
    of the undisturbed slowest (or of the death)."""
    sim = _simulate()
    c = replace(sim.RUN7, steps=s)
    topo = make(n, s, h)
    dead = data.draw(st.integers(0, n - 1))
    at = data.draw(st.floats(0.0, c.setup + (s + 2) * c.step))
    calm = max(sim.fanout(topo, c, [0.0] * s).values())
    kill = sim.Kill(dead, at, detect=data.draw(st.sampled_from([0.3, 10.0])))
    last = sim.fanout(topo, c, [0.0] * s, kill)  # raises on a step received twice
    assert set(last) == set(range(n)) - {dead}
    slack = kill.detect + c.setup + (s + 4 * tp.depth_bound(n, h)) * c.step
    assert max(last.values()) <= max(calm, at) + slack + 1e-9


TENSORS = st.dictionaries(st.from_regex(r"[a-e]\.[a-z]{1,3}", fullmatch=True),
                          st.tuples(st.integers(0, 3000), st.sampled_from(["float32", "uint8", "bfloat16"])),
                          min_size=1, max_size=12)


@FAST
@given(TENSORS, st.integers(16, 4096), st.integers(1, MAX_PARTS))
def test_the_parts_of_a_plan_deliver_every_step_once_in_balance(
        tensors: dict[str, tuple[int, str]], bucket: int, n: int) -> None:
    """parts(): n runs of consecutive steps that together hold every step once, in
    order; each part within one step of an even share of the bytes (a tensor's chunks
    may be cut between two parts)."""
    manifest = Manifest(tuple(TensorEntry(k, (numel,), dt) for k, (numel, dt) in sorted(tensors.items())))
    steps = plan(manifest, bucket)
    split = parts(steps, n)
    assert len(split) == n
    assert [k for p in split for k in p] == list(range(len(steps)))
    assert all(p == list(range(p[0], p[0] + len(p))) for p in split if p)
    total = sum(s.nbytes for s in steps)
    biggest = max((s.nbytes for s in steps), default=0)
    for p in split:
        assert abs(sum(steps[k].nbytes for k in p) * n - total) <= biggest * n


@FAST
@given(st.integers(1, 300), HOLDERS)
def test_a_grown_tree_changes_few_parents_as_the_cohort_grows(n: int, h: int) -> None:
    """Grown arrival by arrival, each tree of size n is the last one's plus the
    newcomer; an interior node's parent never changes, and a leaf's changes at most
    floor(log2 n) + 1 times (its slot doubles each time)."""
    before = tp.grown(0, 4, h)
    moves: Counter[tuple[int, int]] = Counter()
    for size in range(1, n + 1):
        now = tp.grown(size, 4, h)
        for tree in range(tp.TREES):
            assert set(now.parents[tree]) == set(before.parents[tree]) | {size - 1}
            for r, up in before.parents[tree].items():
                if now.parents[tree][r] != up:
                    assert not now.children(r, tree), "an interior node moved"
                    moves[r, tree] += 1
        before = now
    assert max(moves.values(), default=0) <= math.ceil(n / h).bit_length()


@pytest.mark.parametrize("n", [16, 64, 1024, 4096])
def test_a_grown_tree_is_as_shallow_as_a_built_one(n: int) -> None:
    """At the sizes the benchmarks use, growing costs no depth over building."""
    assert max_depth(tp.grown(n, 128)) == max_depth(tp.build(n, 128))


@FAST
@given(size=st.integers(1, 300), data=st.data())
def test_seats_reading_the_cohort_at_different_sizes_still_form_trees(size: int, data: st.DataObject) -> None:
    """Each seat's upstreams end at the cohort's source, and when every seat reads the
    cohort at its own size (any size since it arrived), each tree's nearest upstreams
    still reach the source from every seat without a cycle, within the depth bound of
    the largest size plus one."""
    for tree in range(tp.TREES):
        parent = {}
        for p in range(size):
            ups = tp.seat_upstreams(p, data.draw(st.integers(p + 1, size)), tree)
            assert ups and ups[-1] == tp.SOURCE and p not in ups
            parent[p] = ups[0]
        for p in parent:
            seen, node = set(), p
            while node != tp.SOURCE:
                assert node not in seen, "a cycle"
                seen.add(node)
                node = parent[node]
            assert len(seen) <= tp.depth_bound(size) + 1


def test_each_seat_and_the_source_send_at_most_one_model_once_the_cohort_formed() -> None:
    """Once a cohort of up to 1,024 formed, each seat (and the source) is the nearest
    upstream of at most two (seat, tree) pairs: half a model each, one model's worth;
    seat p is interior in tree p % 2 (its parent there an earlier seat or the source)."""
    for size in (1, 2, 3, 17, 64, 1024):
        nearest = {(p, t): tp.seat_upstreams(p, size, t)[0] for p in range(size) for t in range(tp.TREES)}
        sends = Counter(nearest.values())
        assert max(sends.values()) <= 2, (size, sends.most_common(3))
        assert all(nearest[p, p % tp.TREES] < p for p in range(size))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 1024), st.floats(4.0, 60.0))
def test_the_modelled_cooperative_download_is_one_download_alone_and_no_slower_than_single_flight(
        n: int, slower: float) -> None:
    """In the model, one worker's cooperative download is its single flight, and on the
    two trees a group of N with their own links, storage at least 4 transfers' time, never
    finishes later than the single flight of the same N: 1/N read, two transfers."""
    sim = _simulate()
    c = replace(sim.RUN7, download=slower * sim.RUN7.steps * sim.RUN7.step)
    coop = sim.cooperative(n, c, trees=True)
    assert len(coop) == n
    if n == 1:
        assert coop == sim.single_flight(1, c)
    assert max(coop) <= max(sim.tree_design(n, c, fresh=True, make=tp.grown)) + 1e-9
