"""Fan-out topology: who sends which step to whom, for H holders and N receivers.

Pure: no torch, no Redis. The live relay seats every cohort in :func:`grown`'s trees
(:func:`seat_upstreams`); :mod:`benchmarks.simulate` weighs them against other designs.

Two interior-disjoint pipelined binary trees, as NCCL's double tree. Receiver ``i`` goes
to holder ``i % H``; within a group ``g`` of ``n`` receivers tree A is the binary heap
over ``g`` (``g[0]``'s parent the holder) and tree B the same heap over ``g`` reversed.
A heap's interior is its first ``n//2`` positions, so the two interiors are disjoint.
Step ``k`` travels down tree ``k % 2`` (the data plane splits into two runs balanced by
bytes instead, :mod:`.parts`). :func:`build` needs the final size; :func:`grown` gives
the same bounds one arrival at a time.

Bounds (``S`` steps, ``n = ceil(N/H)`` receivers in the largest group):

* every receiver has exactly one parent per tree, rooted at a holder: it gets every
  step exactly once;
* depth (hops from the holder) <= ``D = floor(log2 n) + 1``;
* sends (steps x children) per receiver <= ``2*ceil(S/2)`` <= ``S + 1`` (one model's
  worth, :func:`budget`); per holder ``S``.

After a death (:func:`remove`) each child re-attaches with its subtree (:func:`_adopter`);
then every survivor still gets every step once, depth <= ``2D - 1``, sends <=
``budget(S) + ceil(S/2)``. A late arrival (:func:`join`) is a leaf in both trees: the
first keeps depth <= ``D + 1`` and sends <= ``budget(S)``; each further one adds at most
one hop. :func:`single_tree` is the comparison design (an interior node sends ``2S``).

Node ids: receivers are ``0, 1, ...``; holder ``h`` is ``-1 - h`` (:func:`holder`).
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

TREES = 2


def holder(h: int) -> int:
    """The node id of holder ``h``."""
    return -1 - h


def is_holder(node: int) -> bool:
    return node < 0


def budget(steps: int) -> int:
    """Most step-sends a node may make in one load: one model's worth, split evenly."""
    return 2 * math.ceil(steps / 2)


def depth_bound(receivers: int, holders: int = 1) -> int:
    """``D``: the deepest receiver's hops from its holder in a fresh :func:`build`."""
    n = max(1, math.ceil(receivers / holders))
    return n.bit_length()  # floor(log2 n) + 1


@dataclass(frozen=True)
class Topology:
    """The fan-out of one load: each receiver's parent in each tree."""

    steps: int
    holders: int
    parents: tuple[dict[int, int], dict[int, int]] = field(repr=False)
    """Per tree: receiver -> its parent (a receiver or a holder)."""

    @property
    def receivers(self) -> list[int]:
        return sorted(self.parents[0])

    def tree_of(self, step: int) -> int:
        """The tree that carries ``step``."""
        return step % TREES

    def steps_in(self, tree: int) -> range:
        """The steps tree ``tree`` carries."""
        return range(tree, self.steps, TREES)

    def parent(self, node: int, step: int) -> int:
        """Where ``node`` receives ``step`` from."""
        return self.parents[self.tree_of(step)][node]

    @cached_property
    def _children(self) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        out: tuple[dict[int, list[int]], dict[int, list[int]]] = ({}, {})
        for tree in range(TREES):
            for node, up in sorted(self.parents[tree].items()):
                out[tree].setdefault(up, []).append(node)
        return out

    def children(self, node: int, tree: int) -> list[int]:
        """The nodes ``node`` forwards tree ``tree``'s steps to."""
        return self._children[tree].get(node, [])

    def ancestors(self, node: int, step: int) -> list[int]:
        """``node``'s ancestors in ``step``'s tree, nearest first, ending at a holder."""
        return self._up(node, self.tree_of(step))

    def _up(self, node: int, tree: int) -> list[int]:
        out: list[int] = []
        while not is_holder(node):
            node = self.parents[tree][node]
            out.append(node)
            if len(out) > len(self.parents[tree]) + 1:
                raise ValueError("cycle in the fan-out")
        return out

    def hops(self, node: int, tree: int) -> int:
        """``node``'s distance from its holder in tree ``tree`` (a holder: 0)."""
        return len(self._up(node, tree))

    def depth(self, node: int) -> int:
        """``node``'s hops from its holder, over the trees that carry steps."""
        return max(self.hops(node, t) for t in range(min(TREES, self.steps)))

    def sends(self, node: int) -> int:
        """Step-sends ``node`` makes in one load (steps x children)."""
        return sum(len(self.children(node, t)) * len(self.steps_in(t)) for t in range(TREES))

    def subtree(self, node: int, tree: int) -> set[int]:
        """``node`` and everything below it in tree ``tree``."""
        out, todo = set(), [node]
        while todo:
            n = todo.pop()
            out.add(n)
            todo += self.children(n, tree)
        return out


def _heap(group: list[int], top: int) -> dict[int, int]:
    return {g: (group[(j - 1) // 2] if j else top) for j, g in enumerate(group)}


def _per_holder(receivers: int, steps: int, holders: int,
                tree: Callable[[list[int], int, int], dict[int, int]]) -> Topology:
    """``tree(group, t, top)`` for each tree over each holder's group of receivers."""
    if receivers < 0 or steps < 1 or holders < 1:
        raise ValueError("need receivers >= 0, steps >= 1, holders >= 1")
    parents: tuple[dict[int, int], dict[int, int]] = ({}, {})
    for h in range(holders):
        group = list(range(h, receivers, holders))  # receiver i goes to holder i % H
        for t in range(TREES):
            parents[t].update(tree(group, t, holder(h)))
    return Topology(steps, holders, parents)


def build(receivers: int, steps: int, holders: int = 1) -> Topology:
    """Two interior-disjoint trees per holder over its share of the receivers."""
    return _per_holder(receivers, steps, holders,
                       lambda g, t, top: _heap(g[::-1] if t else g, top))


def _grown(group: list[int], tree: int, top: int) -> dict[int, int]:
    """Tree ``tree`` over ``group`` as it grew, one arrival at a time (see :func:`grown`).

    Slots are heap indices (slot 0's parent is ``top``). Interior node ``k`` sits at slot
    ``k``; a leaf takes the smallest free slot whose parent is present, and moves to the
    next free one when interior node ``k`` arrives at its slot."""
    interior: list[int] = []
    at: dict[int, int] = {}  # slot -> receiver
    free = [0]  # slots whose parent is present, lazily cleaned (heapq)

    def take() -> int:
        while free[0] in at or free[0] < len(interior):
            heapq.heappop(free)
        return heapq.heappop(free)

    for j, r in enumerate(group):
        if j % TREES == tree:
            k = len(interior)
            interior.append(r)
            for c in (2 * k + 1, 2 * k + 2):
                heapq.heappush(free, c)
            if k in at:
                at[take()] = at[k]
            at[k] = r
        else:
            at[take()] = r
    return {r: (top if c == 0 else interior[(c - 1) // 2]) for c, r in at.items()}


def grown(receivers: int, steps: int, holders: int = 1) -> Topology:
    """Two interior-disjoint trees per holder that grow with the cohort: :func:`build`'s
    bounds, but each arrival changes few parents (rebuilding :func:`build`'s reversed
    tree B would change almost every B-parent).

    Parity decides the role: in tree ``t`` the arrivals at positions of parity ``t`` are
    interior, a heap in arrival order; the others are leaves on free child slots. An
    interior node's parent never changes; a leaf moves at most ``floor(log2 n) + 1``
    times over a cohort of ``n`` (property-tested). ``grown(n + 1)`` is ``grown(n)``
    with arrival ``n``.
    """
    return _per_holder(receivers, steps, holders, _grown)


#: What :func:`seat_upstreams` names the cohort's source by (a holder, or a stream).
SOURCE = -1


def seat_upstreams(position: int, size: int, tree: int) -> list[int]:
    """Where the seat at ``position`` of a cohort of ``size`` receives tree ``tree``'s part
    from, nearest first: its ancestors in :func:`grown`, ending at :data:`SOURCE`. Only
    interior seats have children and their parents never change, so members that read
    the cohort at different sizes still form no cycle."""
    if not 0 <= position < size:
        raise ValueError(f"position {position} is not in a cohort of {size}")
    return [SOURCE if is_holder(n) else n for n in grown(size, TREES)._up(position, tree)]


def single_tree(receivers: int, steps: int, holders: int = 1) -> Topology:
    """One pipelined binary tree per holder carrying every step (for comparison)."""
    a = build(receivers, steps, holders).parents[0]
    return Topology(steps, holders, (a, dict(a)))


def _adopter(topo: Topology, tree: int, near: list[int]) -> int:
    """Where a detached node re-attaches in ``tree``: ``near`` (nearest first), then the
    shallowest node, with budget to spare; else the least-loaded receiver (a holder's
    link feeds everyone: it stays within budget). Never below a detached node (no cycles)."""
    extra, cap = len(topo.steps_in(tree)), budget(topo.steps)
    hops: dict[int, int] = {}
    for n in [holder(h) for h in range(topo.holders)] + topo.receivers:
        with contextlib.suppress(KeyError):  # below an orphan still detached, or itself
            hops[n] = topo.hops(n, tree)
    ok = [n for n in near if n in hops]
    ok += sorted((n for n in hops if n not in near), key=lambda n: (hops[n], n))
    for n in ok:
        if topo.sends(n) + extra <= cap:
            return n
    return min(ok, key=lambda n: (is_holder(n), topo.sends(n), hops[n]))


def remove(topo: Topology, dead: int) -> Topology:
    """``topo`` without receiver ``dead``; its children re-attach with their subtrees."""
    if dead not in topo.parents[0]:
        raise KeyError(dead)
    parents = (dict(topo.parents[0]), dict(topo.parents[1]))
    for p in parents:
        del p[dead]
    for tree in range(TREES):
        near = topo._up(dead, tree)
        for orphan in topo.children(dead, tree):
            # A fresh Topology per orphan: children and sends as the earlier ones landed.
            up = _adopter(Topology(topo.steps, topo.holders, parents), tree, near)
            parents = (dict(parents[0]), dict(parents[1]))
            parents[tree][orphan] = up
    return Topology(topo.steps, topo.holders, parents)


def join(topo: Topology, new: int) -> Topology:
    """``topo`` with receiver ``new`` (a fresh id) arriving late, a leaf in both trees."""
    if new < 0 or new in topo.parents[0]:
        raise ValueError(f"receiver id {new} is taken or negative")
    parents = (dict(topo.parents[0]), dict(topo.parents[1]))
    for tree in range(TREES):
        up = _adopter(Topology(topo.steps, topo.holders, parents), tree, [])
        parents = (dict(parents[0]), dict(parents[1]))
        parents[tree][new] = up
    return Topology(topo.steps, topo.holders, parents)
