"""Workers that close their service right after their own load: storage reads and the
slowest worker, round after round.

Run: ``.venv/bin/python benchmarks/close_drain.py [--rounds 12] [--model-mb 16]``

Each round, 3 worker processes (nobody holds the version: a fresh Redis namespace) are
spawned, build their skeletons, and are released together by one Event; each loads with
``WeightService.load`` and closes its service at once (a short job, a shutdown just
after start-up), then reports its load and close times and the bytes it read from
storage. The elected worker holds every byte when it closes, so its followers' streams
should finish: a round should read the checkpoint from storage once (the cooperative
download's shares add up to one), and nobody should wait out a stall bound.

Prints one row per round (checkpoint reads from storage, every worker's source, the
slowest worker's load plus close) and the goal: <= 1 read per round, slowest <= 8 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
import uuid
from multiprocessing.connection import Connection, wait
from typing import Any

from nccl_back.config import Settings
from nccl_back.dev.example import write_example_model
from nccl_back.dev.servers import LocalRedis
from nccl_back.model.identity import ModelSpec

WORKERS = 3
GOAL_READS = 1.0
#: What a round may read over one checkpoint and still count as one read: the members of
#: a cooperative download each read the headers of the files their share touches (0.14 %
#: of a 16 MB checkpoint of 4 shards).
READ_SLACK = 0.01
GOAL_SLOWEST = 8.0


def worker(name: str, settings_json: str, ckpt: str, conn: Connection, go: Any,
           log_dir: str = "") -> None:
    """Build the skeleton, wait for ``go``, load, close at once; report as one JSON line."""
    import faulthandler

    faulthandler.dump_traceback_later(150, exit=True)  # a hung worker's stacks, then it ends
    if log_dir:  # each worker's log lines in a file of its own, for a round to be read
        import logging

        logging.basicConfig(filename=f"{log_dir}/{name}.log", level=logging.INFO,
                            format="%(created).3f %(name)s %(message)s")
    try:
        from nccl_back.load.service import WeightService
        from nccl_back.model.checkpoint import flat_skeleton

        settings = Settings(**json.loads(settings_json))
        spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
        model = flat_skeleton(spec, "cpu")
        svc = WeightService(settings, worker_id=name)
        svc.registry.ping()
        conn.send_bytes(b'{"ready": true}')
        if not go.wait(120):
            raise TimeoutError("never released")
        t0 = time.perf_counter()
        try:
            result = svc.load(model, spec)
        finally:
            loaded = time.perf_counter() - t0
            svc.close()
        conn.send_bytes(json.dumps({
            "worker": name, "source": result.source, "load_s": loaded,
            "close_s": time.perf_counter() - t0 - loaded, "storage_bytes": result.storage_bytes,
            "verified": result.verified, "fallback_reason": result.fallback_reason,
        }).encode())
    except Exception as e:  # report, never leave the parent waiting
        with contextlib.suppress(OSError):
            conn.send_bytes(json.dumps({"worker": name, "error": f"{type(e).__name__}: {e}",
                                        "traceback": traceback.format_exc()}).encode())


def one_round(ctx: Any, redis_url: str, ckpt: str, cache_dir: str, extra: dict[str, Any],
              log_dir: str = "") -> list[dict[str, Any]]:
    """Three workers of a fresh namespace, released together; their reports."""
    settings = {"redis_url": redis_url, "namespace": f"close-{uuid.uuid4().hex[:8]}",
                "advertise_host": "127.0.0.1", "cache_dir": cache_dir, **extra}
    go = ctx.Event()
    conns, procs = [], []
    for i in range(WORKERS):
        mine, theirs = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker, args=(f"w{i}", json.dumps(settings), ckpt, theirs, go, log_dir),
                        daemon=True)
        p.start()
        conns.append(mine)
        procs.append(p)
    try:
        for c in conns:  # everyone set up: imports and skeletons are not timed
            if not c.poll(120):
                raise TimeoutError("a worker never got ready")
            c.recv_bytes()
        go.set()
        rows: list[dict[str, Any]] = []
        pending, deadline = list(conns), time.monotonic() + 180
        while pending and time.monotonic() < deadline:
            for c in wait(pending, timeout=max(0.0, deadline - time.monotonic())):
                try:
                    rows.append(json.loads(c.recv_bytes()))
                except EOFError:
                    rows.append({"error": "worker died without a report"})
                pending.remove(c)  # type: ignore[arg-type]
        rows += [{"error": "no report in 180 s"}] * len(pending)
        return rows
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
            elif p.exitcode:
                print(f"         a worker exited with {p.exitcode}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--model-mb", type=float, default=16.0)
    ap.add_argument("--settings", default="{}", help="JSON of Settings fields over the defaults")
    ap.add_argument("--logs", default="", help="a directory: each round's worker logs in round<r>/")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, LocalRedis().start() as redis:
        ckpt = str(write_example_model(f"{tmp}/ckpt", args.model_mb))
        total = sum(s.size for s in ModelSpec.from_dir(ckpt, cache_dir=f"{tmp}/cache").shards)
        print(f"{WORKERS} workers per round, {total / 1e6:.1f} MB checkpoint, each closing"
              " right after its load")
        print("round  reads  sources                    slowest_s  (load + close)  errors")
        worst_reads, worst_slowest, failed = 0.0, 0.0, 0
        for r in range(args.rounds):
            log_dir = ""
            if args.logs:
                log_dir = f"{args.logs}/round{r}"
                os.makedirs(log_dir, exist_ok=True)
            rows = one_round(ctx, redis.url, ckpt, f"{tmp}/cache", json.loads(args.settings), log_dir)
            errors = [row["error"] for row in rows if "error" in row]
            ok = [row for row in rows if "error" not in row]
            reads = sum(row["storage_bytes"] for row in ok) / total
            slow = max(ok, key=lambda row: row["load_s"] + row["close_s"], default=None)
            slowest = slow["load_s"] + slow["close_s"] if slow else float("inf")
            sources = ",".join(sorted(row["source"] for row in ok))
            split = f"({slow['load_s']:.2f} + {slow['close_s']:.2f})" if slow else ""
            print(f"{r:5d}  {reads:5.3f}  {sources:25s}  {slowest:9.2f}  {split:14s}  {errors or ''}")
            for row in ok:
                if row["fallback_reason"] and row["source"] == "storage":
                    print(f"         {row['worker']}: {row['fallback_reason'][:150]}")
            worst_reads, worst_slowest = max(worst_reads, reads), max(worst_slowest, slowest)
            failed += bool(errors)
            sys.stdout.flush()
        good = worst_reads <= GOAL_READS + READ_SLACK and worst_slowest <= GOAL_SLOWEST and not failed
        print(f"most reads in a round {worst_reads:.3f} (goal <= {GOAL_READS:g}); slowest worker"
              f" {worst_slowest:.2f} s (goal <= {GOAL_SLOWEST:g}); rounds with errors {failed}:"
              f" {'PASS' if good else 'MISS'}")
        return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
