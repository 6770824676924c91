"""A discrete-event model of fleet cold start, fed with the costs `cold_start.py` measured.

Predicts the median time to verified weights for N = 1 ... 1024 workers starting
together, for three designs:

* ``chain``: receivers form cohorts of at most :data:`CHAIN_COHORT` (relay chains, the
  library's fan-out before the trees; unless ``--cohort-max``). A cohort starts when a holder is free; member i holds step k at
  ``T(i, k) = max(T(i-1, k), T(i, k-1)) + step`` (each member forwards step k while
  k+1 arrives; every worker sends at most ``link`` bytes/s); members become holders
  once verified, so later cohorts start from more holders.
* ``tree``: whole 2-rank copies, one send per holder at a time, receivers serve once
  verified: a binomial tree of ⌈log2(N+1)⌉ rounds.
* ``storage``: every worker downloads behind one storage limit shared by the fleet.

and ``single_flight``: one worker downloads and streams each shard to the waiting
cohorts as it arrives (at most ``STREAM_SENDS`` cohort heads at once, sharing the
downloader's link; later cohorts start from holders); ``single_flight_tree``: one
download, then whole copies; ``cooperative``: each worker with its own storage link
reads ``1/N`` of the checkpoint, the elected worker gathers the parts and streams the
whole as single flight does (a second run's JSON, ``--own-links``, gives its points).

Costs, all from one `cold_start.py` run (its JSON): the fixed per-load cost outside the
transfer (skeleton, discovery, verification: warm N=1 minus its transfer), the
per-link set-up (handshake + communicator), the per-step cost (transfer N=1 / steps),
the storage download of one worker at N=1. Its N ≤ 16 predictions are printed next to
the measured medians, and the plot shows both (points measured, lines simulated).
Without that JSON (``benchmarks/out/`` is not in a fresh clone) it uses run 7's costs
as results-log.md writes them (:data:`RUN7`), says so, and prints no comparison or plot.

Fan-out designs, built from ``nccl_back/transport/relay/topology.py`` and
run by a discrete-event model of capped links (:func:`fanout`), for N = 1 ... 4096,
warm with 1 and with 4 holders, and brand-new (the single flight's stream feeding the
fan-out), next to ``chain``:

* ``dtree``: two interior-disjoint pipelined binary trees per holder, even steps down
  one, odd down the other; every worker sends at most one model's worth.
* ``btree``: one pipelined binary tree per holder; interior workers send two models'
  worth through the same capped link.
* ``collective``: the cohort as one k-rank communicator per holder with a pipelined
  broadcast at its optimum (S − 1 + ⌈log2 k⌉ rounds); a member's death stalls it,
  and every member rebuilds it and restarts.

and the cost of one member (a tree's root) killed halfway through the transfer.

    .venv/bin/python benchmarks/simulate.py --measured benchmarks/out/cold_start.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from nccl_back.config import Settings
from nccl_back.model.checkpoint import HEADER_PROBE_BYTES
from nccl_back.transport.relay import topology as tp

#: Most receivers in one chain, as the retired chain fan-out capped them.
CHAIN_COHORT = 32

SIM_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: Cohort heads a streamed download serves at once (``nccl_back.transport.relay.STREAM_SENDS``).
STREAM_SENDS = 4


@dataclass(frozen=True)
class Costs:
    """The model's inputs, in seconds (measured)."""

    fixed: float
    """Per load, outside the transfer: skeleton, discovery, verification, publication."""
    setup: float
    """Per link: handshake and communicator."""
    step: float
    """One step (bucket) over one link at the capped rate, per-call overhead included."""
    steps: int
    """Steps in the model (model bytes / bucket)."""
    download: float
    """One worker's storage download when it has the storage limit to itself."""
    cohort_max: int = CHAIN_COHORT
    """Most receivers in one relay chain (``cohort_max_size``)."""
    shards: int = 1
    """Checkpoint shards: a streamed download forwards a shard once it is in (CRC32C)."""
    probe: float = 0.0
    """One worker's reads of every file's header probe, at one download's rate: what each
    member of a cooperative download reads besides its share."""

    @property
    def transfer(self) -> float:
        return self.setup + self.steps * self.step


def _members(size: int, c: Costs, start: float, head: list[float]) -> list[float]:
    """Finish times of a chain's ``size`` members, given when member 0 holds each step."""
    prev, finishes = head, [head[-1]]
    for _ in range(1, size):
        row: list[float] = []
        for k in range(c.steps):
            row.append(max(prev[k], row[-1] if row else start) + c.step)
        prev = row
        finishes.append(row[-1])
    return finishes


def chain(n: int, c: Costs, holders_at: float | list[float] = 0.0) -> list[float]:
    """Finish times of ``n`` receivers in relay chains of at most ``c.cohort_max``."""
    # A heap of times at which a holder can start a new chain.
    holders = sorted(holders_at) if isinstance(holders_at, list) else [holders_at]
    done: list[float] = []
    left = n
    while left:
        size = min(left, c.cohort_max)
        left -= size
        start = heapq.heappop(holders) + c.setup
        finishes = _members(size, c, start, [start + (k + 1) * c.step for k in range(c.steps)])
        # The chain's holder is free once member 0 has everything; members serve once
        # they hold (and verified) everything.
        heapq.heappush(holders, finishes[0])
        for f in finishes:
            heapq.heappush(holders, f + c.fixed)
        done += finishes
    return [f + c.fixed for f in done]


def tree(n: int, c: Costs, holders_at: float = 0.0) -> list[float]:
    """Finish times with whole copies, one send per holder at a time."""
    holders = [holders_at]
    done: list[float] = []
    for _ in range(n):
        t = heapq.heappop(holders)
        f = t + c.transfer
        heapq.heappush(holders, f)
        heapq.heappush(holders, f + c.fixed)
        done.append(f + c.fixed)
    return done


def storage(n: int, c: Costs) -> list[float]:
    return [n * c.download + c.fixed] * n


def single_flight(n: int, c: Costs, relay: bool = True) -> list[float]:
    first = c.download + c.fixed  # the downloader, holding and verified
    if not relay:
        return [first, *(tree(n - 1, c, holders_at=first) if n > 1 else [])]
    waiters, done = n - 1, [first]
    streamed = min(-(-waiters // c.cohort_max), STREAM_SENDS)
    # Step k can leave the downloader once its shard is in; the stream's heads share
    # the downloader's link.
    ready = [(k * c.shards // c.steps + 1) * c.download / c.shards for k in range(c.steps)]
    holders = [first]
    for _ in range(streamed):
        size = min(waiters, c.cohort_max)
        waiters -= size
        start = c.setup
        head: list[float] = []
        for k in range(c.steps):
            head.append(max(ready[k], head[-1] if head else start) + c.step * streamed)
        # Members verify against the truth the downloader publishes at ``first``.
        finishes = [max(f, first) + c.fixed for f in _members(size, c, start, head)]
        holders += finishes
        done += finishes
    if waiters:
        done += chain(waiters, c, holders_at=holders)
    return done


def _gathered(n: int, c: Costs) -> Costs:
    """``c`` with the download replaced by a cooperative download's gather: each of ``n``
    workers reads ``1/n`` on its own storage link and sends it as its steps land, and
    the elected worker takes the others' ``(n - 1)/n`` of the model in through its own
    link (at the capped rate: the gather's bound once storage is ``n`` times slower)."""
    share_steps = -(-c.steps // n)
    inbound = (n - 1) * c.steps * c.step / n
    gather = c.setup + max(c.probe + c.download / n, share_steps * c.step, inbound) + c.step
    return replace(c, download=gather, shards=1)


def cooperative(n: int, c: Costs, trees: bool = False) -> list[float]:
    """The cooperative first download (:func:`_gathered`); the elected worker proves every
    file and only then streams the whole as :func:`single_flight` does, or down the two
    trees (``trees``). One worker alone: a download."""
    if n == 1:
        return single_flight(1, c)
    g = _gathered(n, c)
    return tree_design(n, g, fresh=True, make=tp.grown) if trees else single_flight(n, g)


def predict(c: Costs, sizes: tuple[int, ...] = SIM_SIZES) -> dict[str, dict[int, float]]:
    """Median seconds per design and N (the live trees: :func:`tree_design`, grown)."""
    out: dict[str, dict[int, float]] = {k: {} for k in
                                        ("warm", "warm_tree", "storage", "single_flight",
                                         "single_flight_tree", "warm_trees", "single_flight_trees",
                                         "cooperative", "cooperative_trees")}
    for n in sizes:
        out["warm_trees"][n] = statistics.median(tree_design(n, c, make=tp.grown))
        out["single_flight_trees"][n] = statistics.median(tree_design(n, c, fresh=True, make=tp.grown))
        out["warm"][n] = statistics.median(chain(n, c))
        out["warm_tree"][n] = statistics.median(tree(n, c))
        out["storage"][n] = statistics.median(storage(n, c))
        out["single_flight"][n] = statistics.median(single_flight(n, c))
        out["single_flight_tree"][n] = statistics.median(single_flight(n, c, relay=False))
        out["cooperative"][n] = statistics.median(cooperative(n, c))
        out["cooperative_trees"][n] = statistics.median(cooperative(n, c, trees=True))
    return out


# Fan-out designs, each built from nccl_back.transport.relay.topology.

#: Fleet sizes of the fan-out tables.
FANOUT_SIZES = (1, 64, 256, 1024, 4096)
#: ``stall_timeout``: the most a member waits for its next step.
STALL = Settings.stall_timeout
#: Run 7's N=1 costs as benchmarks/results-log.md ("Simulation") gives them: used when no
#: measured JSON is at hand (``benchmarks/out/`` is not in a fresh clone).
RUN7 = Costs(fixed=0.21, setup=0.039, step=3.38 / 65, steps=65, download=14.7, cohort_max=16,
             shards=8)


@dataclass(frozen=True)
class Kill:
    """Receiver ``member`` dies at ``at``; those it fed notice ``detect`` seconds later."""

    member: int
    at: float
    detect: float = STALL


def _ready(c: Costs, fresh: bool) -> list[float]:
    """When the holder has each step: warm, at once; brand-new, once its shard is in."""
    if not fresh:
        return [0.0] * c.steps
    return [(k * c.shards // c.steps + 1) * c.download / c.shards for k in range(c.steps)]


def fanout(topo: tp.Topology, c: Costs, ready: list[float],
           kill: Kill | None = None) -> dict[int, float]:
    """When each surviving receiver holds its last step, by discrete events.

    Every worker has one outgoing link at the capped rate (``c.step`` per step), set up
    once per child (``c.setup``, all at the start); it serves its children round-robin,
    each child's steps in order, as soon as it holds them. With ``kill``, the member's
    sends that had not ended by ``kill.at`` are lost; at ``kill.at + kill.detect``
    :func:`topology.remove` re-attaches its children, whose new parents (over a new
    link) send the steps they lack, round-robin with their other children.
    """
    inf = float("inf")
    have: dict[int, list[float]] = {n: [inf] * c.steps for n in topo.receivers}
    for h in range(topo.holders):
        have[tp.holder(h)] = [inf] * c.steps
    queue: dict[int, dict[int, list[int]]] = {n: {} for n in have}
    opened: dict[tuple[int, int], float] = {}
    served: dict[tuple[int, int], float] = {}
    busy: set[int] = set()
    events: list[tuple[float, int, int, int, int]] = []  # (t, seq, node, child, step)
    seq = 0
    dead = kill.member if kill else tp.holder(0) - 1  # no node has that id

    def gone(node: int, t: float) -> bool:
        return kill is not None and node == dead and t > kill.at

    def push(t: float, node: int, child: int, step: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, node, child, step))

    def kick(node: int, t: float) -> None:
        if node in busy or gone(node, t):
            return
        waiting = [ch for ch, q in queue[node].items() if q and not gone(ch, t)]
        if not waiting:
            return
        ch = min(waiting, key=lambda x: (served.get((node, x), -1.0), x))
        k = heapq.heappop(queue[node][ch])
        busy.add(node)
        push(max(t, opened.get((node, ch), c.setup)) + c.step, node, ch, k)

    def holds(node: int, k: int, t: float) -> None:
        if have[node][k] < inf:
            raise AssertionError(f"{node} got step {k} twice (at {have[node][k]:.3f} and {t:.3f})")
        have[node][k] = t
        for ch in topo.children(node, topo.tree_of(k)):
            if have[ch][k] == inf:  # an adopted orphan may hold it already
                heapq.heappush(queue[node].setdefault(ch, []), k)
        kick(node, t)

    for h in range(topo.holders):
        for k, t in enumerate(ready):
            push(t, tp.holder(h), tp.holder(h), k)  # node == child: the holder holds k
    if kill is not None:
        push(kill.at + kill.detect, dead, dead, -1)  # the detection
    while events:
        t, _, node, child, k = heapq.heappop(events)
        if k < 0:  # the dead member's children re-attach
            old, topo = topo, tp.remove(topo, node)
            for tree in range(tp.TREES):
                for orphan in old.children(node, tree):
                    up = topo.parents[tree][orphan]
                    opened[up, orphan] = t + c.setup
                    for s in topo.steps_in(tree):
                        if have[orphan][s] == inf and have[up][s] < inf:
                            heapq.heappush(queue[up].setdefault(orphan, []), s)
                    kick(up, t)
        elif node == child:
            holds(node, k, t)
        else:
            busy.discard(node)
            if gone(node, t):
                continue  # lost with its sender
            served[node, child] = t
            if not gone(child, t):
                holds(child, k, t)
            kick(node, t)
    return {r: max(have[r]) for r in topo.receivers}


def _finish(last: dict[int, float], c: Costs, fresh: bool) -> list[float]:
    """Verified-weights times: brand-new receivers verify against what the downloader
    publishes once its own load is in (as :func:`single_flight`)."""
    if not fresh:
        return [t + c.fixed for t in last.values()]
    first = c.download + c.fixed
    return [first] + [max(t, first) + c.fixed for t in last.values()]


def tree_design(n: int, c: Costs, holders: int = 1, fresh: bool = False,
                make: Callable[[int, int, int], tp.Topology] = tp.build,
                kill: Kill | None = None) -> list[float]:
    """``n`` workers behind the fan-out ``make`` builds: ``dtree`` (two
    interior-disjoint trees, :func:`topology.build`), ``grown`` (the same grown one
    arrival at a time, :func:`topology.grown`; all arrived before data moves) or
    ``btree`` (one tree, :func:`topology.single_tree`).

    Brand-new (``fresh``): one of the ``n`` is the downloader, the holder of the rest.
    """
    topo = make(n - 1 if fresh else n, c.steps, 1 if fresh else holders)
    return _finish(fanout(topo, c, _ready(c, fresh), kill), c, fresh)


def collective(n: int, c: Costs, holders: int = 1, fresh: bool = False,
               kill_at: float | None = None, detect: float = STALL) -> list[float]:
    """A cohort as one k-rank communicator per holder with a pipelined broadcast, at
    its optimum (Bar-Noy & Kipnis: S - 1 + ceil(log2 k) rounds), set-up in
    ceil(log2 k) rounds of a 2-rank set-up. A member's death stalls the whole
    communicator: after ``detect`` every member rebuilds it and restarts at step 0.
    """
    k = (n if fresh else -(-n // holders) + 1)  # ranks: the holder and its receivers
    rounds = max(1, math.ceil(math.log2(k))) if k > 1 else 0
    ready = _ready(c, fresh)

    def last(start: float) -> float:
        out = start
        for s in range(c.steps):
            out = max(ready[s], out) + c.step
        return out + (rounds - 1) * c.step

    end = last(rounds * c.setup)
    if kill_at is not None and kill_at < end:
        end = last(kill_at + detect + rounds * c.setup)
    times = {r: end for r in range((n - 1) if fresh else n)}
    return _finish(times, c, fresh) if k > 1 else _finish({}, c, fresh)


FANOUT_DESIGNS = ("chain", "dtree", "grown", "btree", "collective")
#: The tree designs' constructions (topology.py).
MAKERS: dict[str, Callable[[int, int, int], tp.Topology]] = {
    "dtree": tp.build, "grown": tp.grown, "btree": tp.single_tree}


def fanout_predict(c: Costs, sizes: tuple[int, ...] = FANOUT_SIZES
                   ) -> dict[str, dict[str, dict[int, tuple[float, float]]]]:
    """(median, slowest) seconds per scenario, design and N."""
    out: dict[str, dict[str, dict[int, tuple[float, float]]]] = {}
    for scenario, holders, fresh in (("warm, 1 holder", 1, False),
                                     ("warm, 4 holders", 4, False),
                                     ("brand-new (single flight)", 1, True)):
        rows: dict[str, dict[int, tuple[float, float]]] = {d: {} for d in FANOUT_DESIGNS}
        for n in sizes:
            runs = {
                "chain": (single_flight(n, c) if fresh
                          else chain(n, c, holders_at=[0.0] * holders)),
                **{d: tree_design(n, c, holders, fresh, make=MAKERS[d]) for d in MAKERS},
                "collective": collective(n, c, holders, fresh),
            }
            for d, times in runs.items():
                rows[d][n] = (statistics.median(times), max(times))
        out[scenario] = rows
    return out


def kill_predict(c: Costs, detect: float, sizes: tuple[int, ...] = (64, 1024, 4096)
                 ) -> list[dict[str, Any]]:
    """Receiver 1 (``dtree``: the first child of a tree's root, half the fleet below it
    in that tree; ``grown``: tree B's root, all of it) killed halfway through N=1's transfer: its descendants' slowest finish
    against N=1 + the time to notice (the stall bound, by default), and everyone
    else's slowest against N=1. A collective's death reaches every member."""
    one = tree_design(1, c)[0]
    at = c.setup + c.steps // 2 * c.step
    rows = []
    for n in sizes:
        for design in ("dtree", "grown", "btree", "collective"):
            if design == "collective":
                times = collective(n, c, kill_at=at, detect=detect)
                hit, rest = times[1:], []  # every survivor restarts
            else:
                topo = MAKERS[design](n, c.steps, 1)
                below = set().union(*(topo.subtree(1, t) for t in range(tp.TREES))) - {1}
                last = fanout(topo, c, _ready(c, False), Kill(1, at, detect))
                hit = [last[r] + c.fixed for r in below] or [one]
                rest = [last[r] + c.fixed for r in last if r not in below]
            rows.append({"design": design, "n": n, "descendants": len(hit),
                         "slowest": max(hit), "vs_bound": max(hit) / (one + detect),
                         "others_slowest": max(rest) / one if rest else None})
    return rows


def print_fanout(c: Costs, pred: dict[str, dict[str, dict[int, tuple[float, float]]]],
                 kills: list[dict[str, Any]], detect: float) -> None:
    print(f"\nfan-out designs (topology.py), median x N=1 (slowest x N=1); steps {c.steps}, "
          f"step {c.step * 1000:.1f} ms, set-up {c.setup * 1000:.0f} ms, fixed {c.fixed:.2f} s")
    for scenario, rows in pred.items():
        print(f"{scenario}: N=1 = " + ", ".join(f"{d} {rows[d][1][0]:.2f} s" for d in rows))
        print(f"{'N':>6}" + "".join(f"{d:>18}" for d in rows))
        for n in sorted(rows["chain"]):
            cells = [f"{rows[d][n][0] / rows[d][1][0]:.2f} ({rows[d][n][1] / rows[d][1][0]:.2f})"
                     for d in rows]
            print(f"{n:>6}" + "".join(f"{x:>18}" for x in cells))
    print(f"\nreceiver 1 killed halfway through N=1's transfer, noticed after {detect:g} s:")
    print(f"{'design':<12}{'N':>6}{'affected':>10}{'slowest (s)':>13}"
          f"{'/ (N=1 + detect)':>18}{'others / N=1':>14}")
    for r in kills:
        print(f"{r['design']:<12}{r['n']:>6}{r['descendants']:>10}{r['slowest']:>13.2f}"
              f"{r['vs_bound']:>18.2f}"
              + (f"{r['others_slowest']:>14.2f}" if r["others_slowest"] else f"{'none':>14}"))


def calibrate(measured: dict[str, Any], bucket: int, cohort_max: int) -> Costs:
    """Costs from the N=1 rows of a `cold_start.py` JSON."""
    rows = {(s["scenario"], s["n"]): s for s in measured["summary"]}
    warm = rows["warm", 1]
    steps = max(1, -(-int(measured["meta"]["model_bytes"]) // bucket))
    setup = warm["median_handshake_s"]
    transfer = warm["median_transfer_s"]
    fixed = max(0.0, warm["median_s"] - transfer - setup)
    store = rows.get(("storage", 1)) or rows.get(("single_flight", 1))
    download = store["median_download_s"] if store else 10 * transfer
    shards = int(measured["meta"].get("shards", 1))
    model = int(measured["meta"]["model_bytes"])
    return Costs(fixed=fixed, setup=setup, step=transfer / steps, steps=steps,
                 download=download, cohort_max=cohort_max, shards=shards,
                 probe=download * min(model, shards * HEADER_PROBE_BYTES) / model)


LABELS = {"storage": "storage only", "warm": "warm peer, relay chain",
          "warm_tree": "warm peer, binomial tree (old)", "single_flight": "single flight, streamed relay chain",
          "single_flight_tree": "single flight, binomial tree (old)",
          "warm_trees": "warm peer, two trees", "single_flight_trees": "single flight, two trees",
          "cooperative": "cooperative, own links: chain",
          "cooperative_trees": "cooperative, own links: two trees"}
#: What the plot shows (the binomial trees of whole copies, relay off, only in the tables).
PLOTTED = ("storage", "single_flight", "single_flight_trees", "cooperative", "cooperative_trees", "warm",
           "warm_trees")


def plot(pred: dict[str, dict[int, float]], measured: dict[str, Any], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4), dpi=120)
    for scenario in PLOTTED:
        series = pred[scenario]
        ns = sorted(series)
        (line,) = ax.plot(ns, [series[n] for n in ns], "--" if scenario.endswith("_trees") else "-",
                          label=f"{LABELS[scenario]} (simulated)")
        pts = [s for s in measured["summary"] if s["scenario"] == scenario]
        if pts:
            # Error bars: the fastest and the slowest worker of the measured rounds.
            ax.errorbar([s["n"] for s in pts], [s["median_s"] for s in pts],
                        yerr=[[s["median_s"] - s["min_s"] for s in pts],
                              [s["max_s"] - s["median_s"] for s in pts]],
                        fmt="o", capsize=3, color=line.get_color(),
                        label=f"{LABELS[scenario]} (measured)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(SIM_SIZES), [str(n) for n in SIM_SIZES])
    ax.set_xlabel("workers starting together (N)")
    ax.set_ylabel("median cold start to verified weights (s)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6.5, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--measured", nargs="+", default=["benchmarks/out/cold_start.json"],
                   help="cold_start.py JSONs: costs from the first; the others add their "
                        "scenarios' points (the cooperative download's run with --own-links)")
    p.add_argument("--bucket-bytes", type=int, default=1 << 20, help="the run's bucket (gloo: 1 MiB)")
    p.add_argument("--cohort-max", type=int, default=CHAIN_COHORT,
                   help="most receivers in one relay chain (default: the retired chain's 32)")
    p.add_argument("--png", default="benchmarks/fleet_scale.png")
    p.add_argument("--out", default="benchmarks/out/simulate.json")
    p.add_argument("--detect", type=float, default=STALL,
                   help="seconds until a dead member's children notice (default: the stall bound)")
    args = p.parse_args()
    pred: dict[str, dict[int, float]] = {}
    if all(os.path.exists(m) for m in args.measured):
        measured = _merged(args.measured)
        c = calibrate(measured, args.bucket_bytes, args.cohort_max)
        pred = predict(c)
        print(f"costs: {c}")
        compare(pred, measured, args.png, c)
    else:
        c = RUN7
        print(f"{args.measured} not found: using run 7's costs written in benchmarks/results-log.md "
              f"('Simulation'), no measured comparison and no plot.\ncosts: {c}")
    fan = fanout_predict(c)
    kills = kill_predict(c, args.detect)
    print_fanout(c, fan, kills, args.detect)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"costs": c.__dict__,
                   "predicted": {k: {str(n): v for n, v in s.items()} for k, s in pred.items()},
                   "fanout": {sc: {d: {str(n): v for n, v in r.items()} for d, r in rows.items()}
                              for sc, rows in fan.items()},
                   "killed": kills}, f, indent=1)
    print(f"wrote {args.out}")


def _merged(paths: list[str]) -> dict[str, Any]:
    """The first run, with the rows of scenarios it lacks from the others."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    first = runs[0]
    have = {s["scenario"] for s in first["summary"]}
    for run in runs[1:]:
        first["summary"] += [s for s in run["summary"] if s["scenario"] not in have]
    return first


def compare(pred: dict[str, dict[int, float]], measured: dict[str, Any], png: str, c: Costs) -> None:
    """The model against a measured run, and the plot."""
    med = {(s["scenario"], s["n"]): s["median_s"] for s in measured["summary"]}
    # The model has no CPU: on a small machine N workers building skeletons at once
    # (allocation, header reads) slow each other down. "net" removes that growth of
    # the measured skeleton part, to compare what the model does model.
    skel = {(s["scenario"], s["n"]): s["median_skeleton_s"] for s in measured["summary"]}
    print(f"{'scenario':<20}{'N':>6}{'simulated':>11}{'measured':>10}{'error':>8}{'net':>8}{'error':>8}")
    for scenario, series in pred.items():
        for n, v in sorted(series.items()):
            m = med.get((scenario, n))
            if not m:
                print(f"{scenario:<20}{n:>6}{v:>11.2f}{'-':>10}")
                continue
            net = m - max(0.0, skel[scenario, n] - skel.get((scenario, 1), skel[scenario, n]))
            print(f"{scenario:<20}{n:>6}{v:>11.2f}{m:>10.2f}{(v - m) / m:>+8.0%}{net:>8.2f}"
                  f"{(v - net) / net:>+8.0%}")
    for scenario in ("warm", "warm_trees", "warm_tree", "storage", "single_flight"):
        s = pred[scenario]
        print(f"{scenario}: N=1024 / N=1 = {s[1024] / s[1]:.2f}")
    for scenario in ("cooperative", "cooperative_trees"):
        coop = pred[scenario]
        print(f"{scenario} / one download: "
              + ", ".join(f"N={n} {coop[n] / coop[1]:.2f}" for n in (4, 8, 16, 32, 64, 256, 1024)))
    meta = measured["meta"]
    plot(pred, measured, png,
         f"{meta['model_bytes'] / 2**20:.0f} MiB, link {meta.get('link_gbps', 0):g} GB/s per worker, "
         f"storage {meta['storage_gbps']:g} GB/s shared (cooperative: each worker its own), "
         f"chains of up to {c.cohort_max}\n"
         "points: cold_start.py on 2 CPUs, lines: simulate.py; bars: fastest-slowest worker")
    print(f"wrote {png}")

if __name__ == "__main__":
    main()
