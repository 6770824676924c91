"""What one gloo call costs: a raw broadcast of the same bytes as one flat call and in
chunks (why ``config.STEPS_PER_MODEL`` is 64).

Two processes on loopback, a bare ``ProcessGroupGloo`` (no nccl_back code), 128 MiB by
default. Each round times, after a barrier, one flat broadcast and then the same
bytes in chunks of 1, 2 and 4 MiB with a window of 2, 4 or 8 calls in flight. Prints
the median time per variant and the ratio flat / variant (1.0: chunking is free).

    .venv/bin/python benchmarks/gloo_calls.py [--mib 128] [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

VARIANTS = [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 4)]  # (chunk MiB, calls in flight)


def run(rank: int, port: int, mib: int, rounds: int, threads: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=60)
    opts._threads = threads
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(store, rank, 2, opts)
    n = mib << 20
    buf = torch.zeros(n, dtype=torch.uint8)

    def chunked(chunk: int, window: int) -> None:
        q: deque[dist.Work] = deque()
        for at in range(0, n, chunk):
            while len(q) >= window:
                q.popleft().wait()
            q.append(pg.broadcast(buf[at: at + chunk], 0))
        while q:
            q.popleft().wait()

    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in [("flat", lambda: pg.broadcast(buf, 0).wait())] + [
                (f"{c} MiB x{w}", lambda c=c, w=w: chunked(c << 20, w)) for c, w in VARIANTS]:
            pg.barrier().wait()
            began = time.perf_counter()
            fn()
            times.setdefault(name, []).append(time.perf_counter() - began)
    if rank == 1:
        flat = statistics.median(times["flat"])
        for name, ts in times.items():
            m = statistics.median(ts)
            print(f"{name:12s} {m * 1e3:7.1f} ms  {n / m / 1e9:5.2f} GB/s  flat/this {flat / m:.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2, help="gloo threads per process group")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank is not None:
        run(a.rank, a.port, a.mib, a.rounds, a.threads)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [f"--mib={a.mib}", f"--rounds={a.rounds}", f"--threads={a.threads}", f"--port={port}"]
    sender = subprocess.Popen([sys.executable, __file__, "--rank=0", *common])
    try:
        run(1, port, a.mib, a.rounds, a.threads)
    finally:
        sender.wait(timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
