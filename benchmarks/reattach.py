"""Re-attach of a restarted consumer vs loading the same weights from local safetensors.

Run: ``.venv/bin/python benchmarks/reattach.py [--gib 1.0] [--repeat 3]``

A sidecar process loads a float16 model of ``--gib`` GiB from a safetensors file and
serves it (nccl_back.sidecar.handoff). Each trial is a fresh consumer process, as after a
restart: it builds a skeleton and touches it (timed apart, the same for every method),
then fills it by (a) ``attach`` in copy mode, (b) ``attach`` in zero-copy mode, or
(c) ``safetensors.torch.load_file`` + ``copy_`` into the skeleton, with the file in the
page cache (the best case of a local disk: safetensors maps the file, so this is one
copy from the page cache, like (a)), or (d) the same after evicting just that file
from the page cache (a node that has not read the checkpoint since boot). Medians and
best runs are printed: on a shared machine the best run is the least disturbed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from nccl_back.model.skeleton import build
from nccl_back.sidecar.handoff import HandoffServer, attach

VERSION = "bench"
DIM = 4096
METHODS = ("copy", "zero_copy", "safetensors", "safetensors_cold")


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


def _consumer(how: str, weights: str, socket_path: str, layers: int) -> None:
    """One restarted consumer: print its timings as a JSON line."""
    start = time.perf_counter()
    skeleton = build(lambda: Stack(layers))
    if not isinstance(skeleton, Stack):
        raise TypeError(type(skeleton))
    with torch.no_grad():
        for p in skeleton.parameters():  # first touch: page faults, as in a real load
            p.zero_()
    timings = {"alloc": time.perf_counter() - start}
    start = time.perf_counter()
    if how.startswith("safetensors"):
        state = load_file(weights)
        with torch.no_grad():
            for name, t in skeleton.state_dict().items():
                t.copy_(state[name])
    else:
        result = attach(skeleton, socket_path, how, 60.0, version=VERSION)  # type: ignore[arg-type]
        timings.update({f"phase.{k}": v for k, v in result.timings.items()})
    timings["fill"] = time.perf_counter() - start
    print(json.dumps(timings))


def _evict(path: str) -> None:
    """Drop this one file's pages from the page cache (no other file is affected)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--consumer", nargs=3, metavar=("HOW", "WEIGHTS", "SOCKET"))
    args = parser.parse_args()
    layers = _layers(args.gib)
    if args.consumer:
        how, weights, socket_path = args.consumer
        _consumer(how, weights, socket_path, layers)
        return
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
    runs: dict[str, list[dict[str, float]]] = {how: [] for how in METHODS}
    try:
        for _ in range(args.repeat):
            for how in METHODS:
                if how == "safetensors_cold":
                    _evict(weights)
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--gib",
                        str(args.gib),
                        "--consumer",
                        how,
                        weights,
                        socket_path,
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                runs[how].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        stop.set()
        proc.join(30)
        shutil.rmtree(workdir, ignore_errors=True)
    gb = nbytes / 1e9
    print(
        f"model {nbytes / (1 << 30):.2f} GiB in {layers} tensors; sidecar pack into shm {pack:.2f} s"
    )
    alloc = statistics.median(r["alloc"] for rs in runs.values() for r in rs)
    print(f"skeleton alloc+touch (median, not included below) {alloc * 1e3:.0f} ms")
    fills = {how: [r["fill"] for r in rs] for how, rs in runs.items()}
    for how in METHODS:
        median = statistics.median(fills[how])
        phases = {
            k.removeprefix("phase."): statistics.median(r[k] for r in runs[how])
            for k in runs[how][0]
            if k.startswith("phase.")
        }
        detail = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in phases.items())
        print(
            f"{how:16s} median {median * 1e3:6.0f} ms ({gb / median:5.1f} GB/s)"
            f"  runs {[round(x * 1e3) for x in fills[how]]}"
            + (f"  phases ms: {detail}" if detail else "")
        )
    med = {how: statistics.median(v) for how, v in fills.items()}
    best = {how: min(v) for how, v in fills.items()}
    for how in ("safetensors", "safetensors_cold"):
        print(
            f"{how} / attach(copy): median {med[how] / med['copy']:.1f}x,"
            f" best {best[how] / best['copy']:.1f}x;"
            f" / attach(zero_copy): median {med[how] / med['zero_copy']:.1f}x"
        )


if __name__ == "__main__":
    main()
