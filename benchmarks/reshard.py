"""Resharding a library model: bytes moved and load time against a same-layout peer load.

Run: ``.venv/bin/python benchmarks/reshard.py [--d 1024 --repeat 3]``

One TP=1 holder of a plain transformer-shaped checkpoint (fp32; embed V×D, q/k/v/o,
gate/up/down D×F, a norm) loaded from storage. Then, ``repeat`` times: a TP=2 group of
the Megatron layout (fused qkv and gate_up column-parallel, o/down row-parallel,
vocabulary split by rows) loads by resharding from the TP=1 holder; a second TP=2
group of the same layout loads from the first (a same-layout peer load: rank r from
rank r); both are killed and their entries left to expire. Real processes, real Redis,
gloo over loopback, keyed verification. Prints per run and as medians:
bytes moved by each resharded rank / the bytes of its own shards (goal <= 1.1), and
the resharded group's load time / the same-layout group's (goal <= 1.5; each group's
time is its slowest rank's ``LoadResult.seconds``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sends", type=int, default=2, help="the holder's max_concurrent_sends")
    args = ap.parse_args()
    os.environ.update(RESHARD_D=str(args.d), RESHARD_F=str(4 * args.d), RESHARD_V=str(8 * args.d))

    import reshard_workers as rw  # after the sizes are set: forkserver children read them
    import test_reshard as t

    from nccl_back.dev.servers import LocalRedis
    from nccl_back.model.skeleton import build

    from models import fill_random, write_checkpoint

    with LocalRedis() as redis, tempfile.TemporaryDirectory() as tmp:
        model = fill_random(build(lambda: rw.Flat(rw.checkpoint_shapes())), seed=1)
        ckpt = str(write_checkpoint(model, Path(tmp) / "ckpt", n_shards=2))
        size = sum(p.stat().st_size for p in Path(ckpt).glob("*.safetensors"))
        fleet = t.Fleet(ckpt, {"redis_url": redis.url, "namespace": "bench-reshard",
                               "cache_dir": str(Path(tmp) / "cache"), "advertise_host": "127.0.0.1",
                               "peer_ttl": 3.0, "secret": "b" * 32,
                               "transfer_timeout": 120.0, "handshake_timeout": 10.0})
        try:
            fleet.start(1, "plain", settings={"max_concurrent_sends": args.sends})
            (h,) = fleet.reports(1, timeout=300)
            print(f"checkpoint {size / 1e6:.1f} MB; TP=1 holder loaded from {h['source']}")
            byte_ratios, time_ratios = [], []
            for i in range(args.repeat):
                n = len(fleet.procs)
                fleet.start(2, "megatron")
                resharded = fleet.reports(2, timeout=300)
                fleet.start(2, "megatron")
                same = fleet.reports(2, timeout=300)
                assert all(r["source"] == "peer" and r["identical"] for r in resharded + same), \
                    [r["fallback_reason"] for r in resharded + same]
                br = max(r["bytes"] / r["own_bytes"] for r in resharded)
                tr = max(r["seconds"] for r in resharded) / max(r["seconds"] for r in same)
                byte_ratios.append(br)
                time_ratios.append(tr)
                print(f"run {i}: resharded {max(r['seconds'] for r in resharded):.3f} s,"
                      f" same-layout {max(r['seconds'] for r in same):.3f} s;"
                      f" bytes/own {br:.3f}, time ratio {tr:.2f}")
                slow = max(resharded, key=lambda r: r["seconds"])
                print("  resharded rank's phases:", {k: round(v, 3) for k, v in slow["timings"].items()})
                slow = max(same, key=lambda r: r["seconds"])
                print("  same-layout rank's phases:", {k: round(v, 3) for k, v in slow["timings"].items()})
                for k in range(n, len(fleet.procs)):
                    fleet.kill(k)
                time.sleep(4)  # their entries expire (peer_ttl 3 s)
            print(f"median bytes moved / own shards: {statistics.median(byte_ratios):.3f} (goal <= 1.1)")
            print(f"median reshard / same-layout load time: {statistics.median(time_ratios):.2f}"
                  " (goal <= 1.5)")
        finally:
            fleet.close()


if __name__ == "__main__":
    main()
