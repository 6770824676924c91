"""Fan-out topology: who sends which step to whom, for H holders and N receivers.

Pure and dependency-free: no torch, no Redis. The live relay seats every cohort in
:func:`grown`'s trees (:func:`seat_upstreams`); :mod:`benchmarks.simulate` weighs them
against other designs.

Construction (two interior-disjoint pipelined binary trees, as NCCL's double tree).
Receivers ``0 .. N-1`` are dealt round-robin to the holders (receiver ``i`` to holder
``i % H``), so a fleet behind several holders never queues behind one. Within a
group of ``n`` receivers, in order ``g[0] .. g[n-1]``:

* tree A is the binary heap over ``g``: ``g[j]``'s parent is ``g[(j-1)//2]``, and
  ``g[0]``'s is the holder;
* tree B is the same heap over ``g`` reversed.

A heap of ``n`` nodes has its interior nodes at the first ``n//2`` positions, so A's
interior is ``g[0 .. n//2-1]`` and B's is ``g[n-n//2 .. n-1]``: disjoint. Every
receiver is interior in at most one tree and a leaf in the other. Step ``k`` travels
down tree ``k % 2`` (even steps A, odd steps B). The data plane's split
(:func:`nccl_back.transport.parts.parts`) is two consecutive runs balanced by bytes
instead: the same number of steps per tree for equal-sized steps, and the same
times behind a warm holder, but behind a streamed download a run's steps are ready
only as the download reaches them, which this model does not show. A member
forwards a step as soon as it holds it.

:func:`build` needs the cohort's final size (tree B is over it reversed);
:func:`grown` builds the same bounds one arrival at a time, changing few parents
per arrival, for a cohort that is still forming.

Bounds (``S`` steps, ``n = ceil(N/H)`` receivers in the largest group):

* every receiver has exactly one parent per tree, rooted at a holder: it gets every
  step exactly once;
* depth (hops from the holder) <= ``D = floor(log2 n) + 1``;
* sends (steps x children) per receiver <= ``2*ceil(S/2)`` <= ``S + 1`` (one model's
  worth, :func:`budget`); per holder ``S``.

After a member's death (:func:`remove`), each of its children re-attaches, with its
subtree, to the nearest ancestor with budget to spare, else to the shallowest member
with budget to spare, else (slack) to the least-loaded receiver (a holder's link
feeds everyone: it stays within its budget); never into its own subtree. After one
removal: every survivor still gets every step exactly once; depth <= ``2D - 1`` (the orphan's subtree hangs below a node of depth <= D); sends <=
``budget(S) + ceil(S/2)`` (at most one extra child on one node, only when no node
has budget to spare). A late arrival (:func:`join`) is a leaf in both trees,
attached in each to the shallowest node with budget to spare: the first one keeps
depth <= ``D + 1`` and sends <= ``budget(S)``; each further one adds at most one hop.

:func:`single_tree` is the comparison design: one heap carries every step (both
``parents`` maps are the same), so an interior node sends ``2S``.

Node ids: receivers are ``0, 1, ...``; holder ``h`` is ``-1 - h`` (:func:`holder`).
"""

from __future__ import annotations

import contextlib
import heapq
import math
from dataclasses import dataclass, field
from functools import cached_property

TREES = 2


def holder(h: int) -> int:
    """The node id of holder ``h``."""
    return -1 - h


def is_holder(node: int) -> bool:
    return node < 0


def budget(steps: int) -> int:
    """Most step-sends a node may make in one load: one model's worth, rounded up to
    an even split between the trees."""
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
        """Re-attach candidates for ``step``: ``node``'s ancestors in the step's tree,
        nearest first, ending at a holder."""
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


def _groups(receivers: int, holders: int) -> list[list[int]]:
    return [list(range(h, receivers, holders)) for h in range(holders)]


def build(receivers: int, steps: int, holders: int = 1) -> Topology:
    """Two interior-disjoint trees per holder over its share of the receivers."""
    if receivers < 0 or steps < 1 or holders < 1:
        raise ValueError("need receivers >= 0, steps >= 1, holders >= 1")
    a: dict[int, int] = {}
    b: dict[int, int] = {}
    for h, group in enumerate(_groups(receivers, holders)):
        a |= _heap(group, holder(h))
        b |= _heap(group[::-1], holder(h))
    return Topology(steps, holders, (a, b))


def _grown(group: list[int], tree: int, top: int) -> dict[int, int]:
    """Tree ``tree`` over ``group`` as it grew, one arrival at a time (see :func:`grown`).

    Slots are heap indices: slot 0's parent is ``top``, slot ``c``'s is the interior
    node at index ``(c-1)//2``. Interior node ``k`` sits at slot ``k``; a leaf sits at
    the smallest free slot whose parent is present, and moves to the smallest one
    then free (a later slot) when interior node ``k`` arrives at its slot."""
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
    """Two interior-disjoint trees per holder that grow with the cohort: what
    :func:`build` gives for a fixed size, but each arrival changes few parents.

    :func:`build`'s tree B is a heap over the cohort *reversed*: it needs the final
    size, and rebuilt as receivers arrive it changes almost every B-parent each time.
    Here parity decides the role instead: in tree ``t`` the receivers at even
    (``t = 0``) or odd (``t = 1``) arrival positions are interior, a heap in arrival
    order, and the others are leaves on the free child slots. So an interior node's
    parent never changes, and a leaf moves only when the interior node whose heap
    index is its slot arrives: at most ``floor(log2 n) + 1`` moves over a cohort of
    ``n`` (property-tested), at the depth :func:`build` gives. Every receiver is interior in one tree and a leaf in
    the other, has at most two children in each (one model's worth of sends), and a
    holder has one child per tree. ``grown(n + 1)`` is ``grown(n)`` with arrival ``n``.
    """
    if receivers < 0 or steps < 1 or holders < 1:
        raise ValueError("need receivers >= 0, steps >= 1, holders >= 1")
    a: dict[int, int] = {}
    b: dict[int, int] = {}
    for h, group in enumerate(_groups(receivers, holders)):
        a |= _grown(group, 0, holder(h))
        b |= _grown(group, 1, holder(h))
    return Topology(steps, holders, (a, b))


#: What :func:`seat_upstreams` names the cohort's source by (a holder, or a stream).
SOURCE = -1


def seat_upstreams(position: int, size: int, tree: int) -> list[int]:
    """Where the cohort member at ``position`` of a cohort of ``size`` receives tree
    ``tree``'s part from, nearest first: its ancestors in :func:`grown` over the seats
    (arrival order), ending at :data:`SOURCE` (the holder or stream that feeds the
    cohort: it sends one part to each tree's root, one model's worth). An interior
    seat's parent is an earlier interior seat and never changes, and only interior seats
    have children, so members that read the cohort at different sizes still form no
    cycle; a leaf's parent may change as the cohort grows (at most ``floor(log2 n) + 1``
    times, :func:`grown`). Seat ``p`` is interior in tree ``p % TREES``."""
    if not 0 <= position < size:
        raise ValueError(f"position {position} is not in a cohort of {size}")
    return [SOURCE if is_holder(n) else n for n in grown(size, TREES)._up(position, tree)]


def single_tree(receivers: int, steps: int, holders: int = 1) -> Topology:
    """One pipelined binary tree per holder carrying every step (for comparison)."""
    a = build(receivers, steps, holders).parents[0]
    return Topology(steps, holders, (a, dict(a)))


def _adopter(topo: Topology, tree: int, orphan: int, near: list[int]) -> int:
    """Where ``orphan`` re-attaches in ``tree``: ``near`` (nearest first), then the
    shallowest node, with budget to spare; else the least-loaded receiver (slack: a
    holder's link feeds everyone, so it stays within budget). Never below itself, nor
    below another orphan not yet re-attached (no cycles)."""
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
            up = _adopter(Topology(topo.steps, topo.holders, parents), tree, orphan, near)
            parents = (dict(parents[0]), dict(parents[1]))
            parents[tree][orphan] = up
    return Topology(topo.steps, topo.holders, parents)


def join(topo: Topology, new: int) -> Topology:
    """``topo`` with receiver ``new`` arriving late, a leaf in both trees. Its id must be
    new (an arrival position: the dead's are not reused)."""
    if new < 0 or new in topo.parents[0]:
        raise ValueError(f"receiver id {new} is taken or negative")
    parents = (dict(topo.parents[0]), dict(topo.parents[1]))
    for tree in range(TREES):
        cur = Topology(topo.steps, topo.holders, parents)
        up = _adopter(cur, tree, new, [])
        parents = (dict(parents[0]), dict(parents[1]))
        parents[tree][new] = up
    return Topology(topo.steps, topo.holders, parents)
