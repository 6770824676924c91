"""Fixed overhead of a peer load for a tiny model (discovery, consensus, claim,
handshake, communicator set-up, transfer, verification), end to end on loopback.

A sender process loads a tiny model from storage and serves it; this process then
does ``--repeat`` peer loads, each with a fresh skeleton and a fresh WeightService,
and reports the median and the per-phase split. Baseline in the same run: a storage
load of the same tiny model. Goal: median peer load < 100 ms.

    .venv/bin/python benchmarks/peer_overhead.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from nccl_back.devservers import LocalRedis  # noqa: E402
from nccl_back.identity import ModelSpec  # noqa: E402
from nccl_back.loader import load_from_storage  # noqa: E402
from nccl_back.service import WeightService  # noqa: E402
from nccl_back.skeleton import build  # noqa: E402

from models import TinyTransformer, fill_random, write_checkpoint  # noqa: E402
from workers import settings_for, worker_main  # noqa: E402

MODEL = {"n_layers": 2, "d": 32}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as redis_server:
        ckpt = str(write_checkpoint(fill_random(TinyTransformer(**MODEL), 1), Path(tmp) / "ckpt"))
        kw: dict[str, Any] = {"redis_url": redis_server.url, "namespace": "overhead",
                              "cache_dir": f"{tmp}/cache"}
        reader, writer = ctx.Pipe(duplex=False)
        stop = ctx.Event()
        sender = ctx.Process(target=worker_main, args=("sender", ckpt, kw, writer, stop),
                             kwargs={"model_kwargs": MODEL, "serve_for": 600})
        sender.start()
        try:
            first = reader.recv()
            if "error" in first:
                raise SystemExit(first["error"])
            spec = ModelSpec.from_dir(ckpt, cache_dir=f"{tmp}/cache")
            settings = settings_for(**kw)
            peer: list[float] = []
            phases: dict[str, list[float]] = {}
            storage: list[float] = []
            for _ in range(args.repeat):
                model = build(lambda: TinyTransformer(**MODEL))
                with WeightService(settings) as svc:
                    r = svc.load(model, spec)
                if r.source != "peer":
                    raise SystemExit(f"expected a peer load, got {r.source}: {r.fallback_reason}")
                peer.append(r.seconds)
                for k, v in r.timings.items():
                    phases.setdefault(k, []).append(v)
                model = build(lambda: TinyTransformer(**MODEL))
                t = time.perf_counter()
                load_from_storage(model, spec, settings=settings)
                storage.append(time.perf_counter() - t)
        finally:
            stop.set()
            sender.join(10)
            if sender.is_alive():
                sender.kill()
    med = statistics.median(peer)
    print(f"tiny model: {r.bytes / 1e6:.2f} MB, {args.repeat} peer loads")
    print(f"peer load, median      : {med * 1000:7.1f} ms   (goal < 100 ms: {'PASS' if med < 0.1 else 'MISS'})")
    for k, v in sorted(phases.items()):
        print(f"  {k:<20} : {statistics.median(v) * 1000:7.1f} ms")
    print(f"storage load (baseline): {statistics.median(storage) * 1000:7.1f} ms (local files, no hashing)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
