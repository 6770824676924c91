"""What each check of the Verifier costs on CPU, against a memcpy of the same bytes.

Run: ``.venv/bin/python benchmarks/verify_cost.py [--mib 256] [--repeat 3]``

A transformer-shaped checkpoint (bfloat16; q/k/v/o, gate/up/down per layer) held whole
(what a TP=1 storage loader publishes) and as one TP=2 rank of fused, sharded layers
(what a resharding receiver checks). Best-of-N seconds and GB/s of:

- layer hashes, ``sampled`` and ``full`` (keyed), over the whole model;
- position MACs (``sampled`` reshards), published whole and checked by a TP=2 rank;
- marginal sums (``full`` reshards), published whole (every dim of every tensor) and
  checked by a TP=2 rank (its pieces' cut dims only);

each as a ratio to a memcpy of the bytes it reads (the bound on reading them at all).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from nccl_back.load.verifier import Verifier
from nccl_back.model import integrity, marginals, position_truth
from nccl_back.model import layout as L
from nccl_back.model import reshard_plan as P
from nccl_back.model.skeleton import Manifest, TensorEntry

KEY = b"k" * 32


def shapes(mib: int) -> dict[str, tuple[int, ...]]:
    """Layers of d=1024, ffn=2816 until about ``mib`` MiB of bfloat16."""
    d, f = 1024, 2816
    per_layer = 2 * (4 * d * d + 3 * d * f)
    out: dict[str, tuple[int, ...]] = {}
    for i in range(max(1, (mib << 20) // per_layer)):
        p = f"layers.{i}."
        out |= {p + "q": (d, d), p + "k": (d, d), p + "v": (d, d), p + "o": (d, d),
                p + "gate": (f, d), p + "up": (f, d), p + "down": (d, f)}
    return out


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    ck = shapes(args.mib)
    g = torch.Generator().manual_seed(0)
    whole = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in ck.items()}
    man = Manifest(tuple(TensorEntry(n, s, "bfloat16") for n, s in sorted(ck.items())))
    full_layout = L.layout_of(man, {}, ck)
    # TP=2 rank 0: q/k/v/gate/up column-parallel (rows), o/down row-parallel (columns).
    described = {n: (L.row(n, 0, 2, s[1]) if n.endswith(("o", "down")) else L.column(n, 0, 2, s[0]))
                 for n, s in ck.items()}
    tp_shapes = {n: (s[0], s[1] // 2) if n.endswith(("o", "down")) else (s[0] // 2, s[1])
                 for n, s in ck.items()}
    tp_man = Manifest(tuple(TensorEntry(n, s, "bfloat16") for n, s in sorted(tp_shapes.items())))
    tp_layout = L.layout_of(tp_man, described, ck)
    tp = {e.name: torch.empty(e.shape, dtype=torch.bfloat16) for e in tp_man.entries}
    moves = P.plan(tp_layout, [full_layout]).moves
    P.apply_local(moves, whole, tp)
    nbytes = sum(t.numel() * t.element_size() for t in whole.values())
    tp_bytes = nbytes // 2
    model = torch.nn.ParameterDict({n.replace(".", "_"): torch.nn.Parameter(t, requires_grad=False)
                                    for n, t in whole.items()})
    scratch = {n: torch.empty_like(t) for n, t in whole.items()}

    def memcpy() -> None:
        for n, t in whole.items():
            scratch[n].copy_(t)

    copy = best(memcpy, args.repeat)
    v = Verifier("full", KEY)
    truth = v.position_truth(full_layout, whole)
    merged = marginals.Truth()
    merged.add(truth.marginals, "h")
    rows: list[tuple[str, float, int]] = [
        ("layer hashes, sampled (whole)", best(lambda: integrity.layer_hashes(model, "sampled", key=KEY), args.repeat), nbytes),
        ("layer hashes, full (whole)", best(lambda: integrity.layer_hashes(model, "full", key=KEY), args.repeat), nbytes),
        ("position MACs, published (whole)", best(lambda: position_truth.held_macs(full_layout, whole, KEY), args.repeat), nbytes),
        ("position MACs, checked (TP=2 rank)", best(lambda: position_truth.compare(
            position_truth.held_macs(tp_layout, tp, KEY), truth.macs), args.repeat), tp_bytes),
        ("marginal sums, published (whole, every dim)", best(lambda: marginals.held(full_layout, whole, KEY), args.repeat), nbytes),
        ("marginal sums, checked (TP=2 rank)", best(lambda: marginals.check(tp_layout, tp, merged, KEY), args.repeat), tp_bytes),
    ]
    print(f"{nbytes / 2**20:.0f} MiB bfloat16 in {len(whole)} tensors; memcpy {nbytes / copy / 1e9:.2f} GB/s"
          f" (best of {args.repeat})")
    print("| check | seconds | GB/s | x memcpy of its bytes |")
    print("|---|---|---|---|")
    for name, secs, read in rows:
        print(f"| {name} | {secs:.3f} | {read / secs / 1e9:.2f} | {secs / (copy * read / nbytes):.1f} |")


if __name__ == "__main__":
    main()
