"""Re-attach of a restarted consumer vs loading the same weights from local safetensors.

Run: ``.venv/bin/python benchmarks/reattach.py [--gib 1.0] [--repeat 3]``

A sidecar process loads a float16 model of ``--gib`` GiB from a safetensors file and
serves it (nccl_back.handoff). Each trial builds a fresh skeleton, as a restarted
consumer would, and fills it by (a) ``attach`` in copy mode, (b) ``attach`` in
zero-copy mode, (c) ``safetensors.torch.load_file`` + ``copy_`` into the skeleton.
The file is in the page cache (it was just written): (c) is the best case of a local
disk. Skeleton allocation is timed separately and is the same for all three. Medians
and best runs are printed: on a shared machine the best run is the least disturbed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from nccl_back.handoff import HandoffServer, attach
from nccl_back.skeleton import build

VERSION = "bench"
DIM = 4096


class Stack(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(DIM, DIM // 2, bias=False, dtype=torch.float16) for _ in range(layers)
        )


def _layers(gib: float) -> int:
    return max(1, int(gib * (1 << 30)) // (DIM * DIM // 2 * 2))


def _sidecar(path: str, socket_path: str, layers: int, ready: Any, stop: Any) -> None:
    model = Stack(layers)
    model.load_state_dict(load_file(path))
    start = time.perf_counter()
    with HandoffServer(model, VERSION, socket_path):
        ready.put(time.perf_counter() - start)
        stop.wait(600)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    layers = _layers(args.gib)
    workdir = tempfile.mkdtemp(prefix="nbbench")
    weights = os.path.join(workdir, "model.safetensors")
    socket_path = os.path.join(workdir, "handoff.sock")
    source = Stack(layers)
    for p in source.parameters():
        nn.init.normal_(p)
    save_file(source.state_dict(), weights)
    nbytes = sum(p.numel() * p.element_size() for p in source.parameters())
    del source

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_sidecar, args=(weights, socket_path, layers, ready, stop))
    proc.start()
    pack = ready.get(timeout=600)
    results: dict[str, list[float]] = {"alloc": [], "copy": [], "zero_copy": [], "safetensors": []}
    phases: dict[str, list[float]] = {}
    try:
        for _ in range(args.repeat):
            hows: tuple[Literal["copy", "zero_copy", "safetensors"], ...] = (
                "copy",
                "zero_copy",
                "safetensors",
            )
            for how in hows:
                alloc_start = time.perf_counter()
                skeleton = build(lambda: Stack(layers))
                assert isinstance(skeleton, Stack)
                for p in skeleton.parameters():  # first touch: page faults, as in a real load
                    p.data.zero_()
                results["alloc"].append(time.perf_counter() - alloc_start)
                if how == "safetensors":

                    def fill(model: Any = skeleton) -> None:
                        state = load_file(weights)
                        with torch.no_grad():
                            for name, t in model.state_dict().items():
                                t.copy_(state[name])

                    results[how].append(_timed(fill))
                else:
                    start = time.perf_counter()
                    result = attach(skeleton, socket_path, how, 60.0, version=VERSION)
                    results[how].append(time.perf_counter() - start)
                    for phase, seconds in result.timings.items():
                        phases.setdefault(f"{how}.{phase}", []).append(seconds)
                del skeleton
    finally:
        stop.set()
        proc.join(30)
    gb = nbytes / 1e9
    median = {k: statistics.median(v) for k, v in results.items()}
    print(
        f"model {nbytes / (1 << 30):.2f} GiB in {layers} tensors; sidecar pack into shm {pack:.2f} s"
    )
    print(f"skeleton alloc+touch   {median['alloc'] * 1e3:8.1f} ms (not included below)")
    for how in ("copy", "zero_copy", "safetensors"):
        print(
            f"{how:22s} {median[how] * 1e3:8.1f} ms  ({gb / median[how]:.1f} GB/s)  runs {[round(x * 1e3) for x in results[how]]}"
        )
    print(
        "attach phases (median ms): "
        + ", ".join(f"{k} {statistics.median(v) * 1e3:.0f}" for k, v in phases.items())
    )
    best = {k: min(v) for k, v in results.items()}
    print(
        f"safetensors / attach(copy): median {median['safetensors'] / median['copy']:.1f}x,"
        f" best {best['safetensors'] / best['copy']:.1f}x"
    )


if __name__ == "__main__":
    main()
