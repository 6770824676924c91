"""A discrete-event model of fleet cold start, fed with the costs `cold_start.py` measured.

Predicts the median time to verified weights for N = 1 ... 1024 workers starting
together, for three designs:

* ``chain``: receivers form cohorts of at most ``cohort_max_size`` (relay chains, issue
  11). A cohort starts when a holder is free; member i holds step k at
  ``T(i, k) = max(T(i-1, k), T(i, k-1)) + step`` (each member forwards step k while
  k+1 arrives; every worker sends at most ``link`` bytes/s); members become holders
  once verified, so later cohorts start from more holders.
* ``tree``: whole 2-rank copies, one send per holder at a time, receivers serve once
  verified: a binomial tree of ⌈log2(N+1)⌉ rounds.
* ``storage``: every worker downloads behind one storage limit shared by the fleet.

and ``single_flight``: one worker downloads and streams each shard to the waiting
cohorts as it arrives (at most ``STREAM_SENDS`` cohort heads at once, sharing the
downloader's link; later cohorts start from holders); ``single_flight_tree``: one
download, then whole copies.

Costs, all from one `cold_start.py` run (its JSON): the fixed per-load cost outside the
transfer (skeleton, discovery, verification: warm N=1 minus its transfer), the
per-link set-up (handshake + communicator), the per-step cost (transfer N=1 / steps),
the storage download of one worker at N=1. Its N ≤ 16 predictions are printed next to
the measured medians, and the plot shows both (points measured, lines simulated).

    .venv/bin/python benchmarks/simulate.py --measured benchmarks/out/cold_start.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
from dataclasses import dataclass
from typing import Any

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
    cohort_max: int = 16
    shards: int = 1
    """Checkpoint shards: a streamed download forwards a shard once it is in (CRC32C)."""

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


def predict(c: Costs, sizes: tuple[int, ...] = SIM_SIZES) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {k: {} for k in
                                        ("warm", "warm_tree", "storage", "single_flight",
                                         "single_flight_tree")}
    for n in sizes:
        out["warm"][n] = statistics.median(chain(n, c))
        out["warm_tree"][n] = statistics.median(tree(n, c))
        out["storage"][n] = statistics.median(storage(n, c))
        out["single_flight"][n] = statistics.median(single_flight(n, c))
        out["single_flight_tree"][n] = statistics.median(single_flight(n, c, relay=False))
    return out


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
    return Costs(fixed=fixed, setup=setup, step=transfer / steps, steps=steps,
                 download=download, cohort_max=cohort_max,
                 shards=int(measured["meta"].get("shards", 1)))


LABELS = {"storage": "storage only", "warm": "warm peer, relay chain",
          "warm_tree": "warm peer, binomial tree (old)", "single_flight": "single flight, streamed relay chain",
          "single_flight_tree": "single flight, binomial tree (old)"}


def plot(pred: dict[str, dict[int, float]], measured: dict[str, Any], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4), dpi=120)
    for scenario, series in pred.items():
        ns = sorted(series)
        (line,) = ax.plot(ns, [series[n] for n in ns], label=f"{LABELS[scenario]} (simulated)")
        pts = [s for s in measured["summary"] if s["scenario"] == scenario]
        if pts:
            ax.plot([s["n"] for s in pts], [s["median_s"] for s in pts], "o",
                    color=line.get_color(), label=f"{LABELS[scenario]} (measured)")
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
    p.add_argument("--measured", default="benchmarks/out/cold_start.json")
    p.add_argument("--bucket-bytes", type=int, default=1 << 20, help="the run's bucket (gloo: 1 MiB)")
    p.add_argument("--cohort-max", type=int, default=16)
    p.add_argument("--png", default="benchmarks/fleet_scale.png")
    p.add_argument("--out", default="benchmarks/out/simulate.json")
    args = p.parse_args()
    with open(args.measured) as f:
        measured = json.load(f)
    c = calibrate(measured, args.bucket_bytes, args.cohort_max)
    pred = predict(c)
    print(f"costs: {c}")
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
    for scenario in ("warm", "warm_tree", "storage", "single_flight"):
        s = pred[scenario]
        print(f"{scenario}: N=1024 / N=1 = {s[1024] / s[1]:.2f}")
    meta = measured["meta"]
    plot(pred, measured, args.png,
         f"{meta['model_bytes'] / 2**20:.0f} MiB, link {meta.get('link_gbps', 0):g} GB/s per worker, "
         f"storage {meta['storage_gbps']:g} GB/s shared; points: cold_start.py on 2 CPUs, "
         "lines: simulate.py")
    with open(args.out, "w") as f:
        json.dump({"costs": c.__dict__, "predicted": {k: {str(n): v for n, v in s.items()}
                                                      for k, s in pred.items()}}, f, indent=1)
    print(f"wrote {args.png}, {args.out}")


if __name__ == "__main__":
    main()
