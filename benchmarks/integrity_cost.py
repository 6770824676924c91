"""Cost of integrity hashing on CPU: ~1 GiB of float16 weights in ~300 tensors.

Run: ``.venv/bin/python benchmarks/integrity_cost.py [--gib 1.0] [--tensors 300] [--repeat 5]``

Prints the best-of-N time of ``layer_hashes`` in each mode, unkeyed and keyed (as
with ``Settings.secret``), and, for scale, the time of a plain memcpy of the same
bytes (a lower bound on loading them from anywhere).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from nccl_back.model.integrity import layer_hashes
from nccl_back.model.skeleton import consolidate


def _model(total_bytes: int, n_tensors: int, consolidated: bool = False) -> nn.Module:
    """``n_tensors`` float16 weights; ``consolidated``: in one allocation, as skeletons are."""
    per = total_bytes // n_tensors // 2  # float16 elements per tensor
    cols = 1024
    rows = max(1, per // cols)
    layers = nn.ModuleList()
    for _ in range(n_tensors):
        layers.append(nn.Linear(cols, rows, bias=False, dtype=torch.float16))
    model = nn.ModuleDict({"layers": layers})
    if consolidated:
        consolidate(model)
    with torch.no_grad():
        for p in model.parameters():
            nn.init.normal_(p)
    return model


def _best(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--layout", choices=("consolidated", "separate"), default="consolidated",
                        help="one allocation (as skeleton.build makes it) or one per tensor")
    args = parser.parse_args()
    model = _model(int(args.gib * (1 << 30)), args.tensors, args.layout == "consolidated")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flat = torch.empty(nbytes, dtype=torch.uint8)
    src = torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()])
    memcpy = _best(lambda: flat.copy_(src), args.repeat)
    sampled = _best(lambda: layer_hashes(model, "sampled"), args.repeat)
    full = _best(lambda: layer_hashes(model, "full"), max(1, args.repeat // 2))
    key = bytes(range(32))
    layer_hashes(model, "full", key=key)  # derives and caches the weights, as a worker does once
    sampled_k = _best(lambda: layer_hashes(model, "sampled", key=key), args.repeat)
    full_k = _best(lambda: layer_hashes(model, "full", key=key), max(1, args.repeat // 2))
    gb = nbytes / 1e9
    print(
        f"model: {nbytes / (1 << 30):.2f} GiB in {args.tensors} tensors ({args.layout}),"
        f" torch threads {torch.get_num_threads()}"
    )
    print(f"memcpy        {memcpy * 1e3:8.1f} ms  ({gb / memcpy:.1f} GB/s)")
    print(f"sampled hash  {sampled * 1e3:8.1f} ms  ({sampled / memcpy * 100:.2f}% of one memcpy)")
    print(f"full hash     {full * 1e3:8.1f} ms  ({gb / full:.2f} GB/s)")
    print(f"sampled keyed {sampled_k * 1e3:8.1f} ms  ({sampled_k / sampled:.2f}x unkeyed)")
    print(f"full keyed    {full_k * 1e3:8.1f} ms  ({gb / full_k:.2f} GB/s, {full_k / full:.2f}x unkeyed)")


if __name__ == "__main__":
    main()
