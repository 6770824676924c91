"""A TP=2 worker's storage load: the whole-checkpoint buffer against the ranged read.

Run: ``.venv/bin/python benchmarks/sharded_storage.py [--d 1728 --repeat 2]``
(``--storage gs --storage-gbps 0.2``: the checkpoint in the GCS emulator instead, each
rank reaching it through its own throttled link, ``nccl_back/dev/throttle.py``)

A plain transformer-shaped fp32 checkpoint (``tests/reshard_workers.py``: embed 8D×D,
q/k/v/o, gate/up/down 4D×D, a norm; ~256 MiB at D=1728) in two local files. For each
layout ("rows": every matrix split by rows, column-parallel; "megatron": fused qkv and
gate_up by rows, o/down row-parallel, split by columns) and each path, in the same run
and alternating: two fresh processes joined by gloo load their pieces from storage,
either by today's whole-buffer path (``model.sharding.load_sharded``: the checkpoint
into a whole-checkpoint buffer on each rank, then cut) or by the ranged path
(``load.ranged.RangedLoader``: each rank reads its pieces' spans through a 64 MiB
staging buffer; tensors both ranks need rows of, the row-parallel o/down and the norm,
are read by halves, one per rank, and broadcast over gloo in staging-sized chunks; the
ranks prove every file's CRC32C together). Per rank: bytes read
(``rchar`` of ``/proc/self/io`` over the load: every read and pread, so both paths
are counted the same way), seconds, peak RSS (``VmHWM``) and its rise over the load.
The files are in the page cache (the parent lists them first): this measures what
each rank reads and holds, not a disk. From ``gs://`` the bytes come over sockets, which
``rchar`` does not count: there the loaders' own count is the figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmHWM, VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise KeyError("rchar")


def worker(args: argparse.Namespace) -> None:
    """One rank: join the group, load its pieces by ``args.mode``, print one JSON line."""
    import reshard_workers as rw
    import torch.distributed as dist

    from nccl_back.config import Settings
    from nccl_back.load.ranged_group import RangedLoader
    from nccl_back.model.identity import ModelSpec
    from nccl_back.model.sharding import load_sharded, sharding
    from nccl_back.model.skeleton import build, named_tensors

    dist.init_process_group("gloo", rank=args.rank, world_size=2,
                            init_method=f"tcp://127.0.0.1:{args.port}")
    group = dist.group.WORLD
    settings = Settings(cache_dir=args.cache)
    spec = ModelSpec.from_dir(args.ckpt, cache_dir=args.cache)
    model = build(lambda: rw.Flat(rw.tp_shapes(2, args.scheme)))
    sh = sharding(model, spec, rw.describe(args.rank, 2, args.scheme), settings)
    share = sum(t.numel() * t.element_size() for t in named_tensors(model)[0].values())
    dist.barrier(group)
    hwm0, rss0, io0, t0 = _status("VmHWM"), _status("VmRSS"), _rchar(), time.perf_counter()
    if args.mode == "whole":
        result = load_sharded(model, spec, settings, sh)
    else:
        result = RangedLoader(sh, group)(model, spec, settings)
    seconds = time.perf_counter() - t0
    read = _rchar() - io0
    print(json.dumps({"rank": args.rank, "seconds": seconds, "read": read, "share": share,
                      "loader_bytes": result.bytes, "verify": result.timings.get("verify", 0.0),
                      "shared": result.timings.get("shared", 0.0),
                      "hwm": _status("VmHWM"), "hwm_before": hwm0,
                      "rss_before": rss0}), flush=True)
    dist.destroy_process_group()


def run_group(mode: str, scheme: str, ckpt: str, cache: str, d: int,
              hosts: list[str]) -> list[dict[str, Any]]:
    """One TP=2 group's load; rank r reaches the emulated bucket through ``hosts[r]``."""
    from nccl_back.dev.servers import free_port

    port = str(free_port())
    env = {**os.environ, "RESHARD_D": str(d), "RESHARD_F": str(4 * d), "RESHARD_V": str(8 * d)}
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", "--rank", str(r), "--port", port, "--mode", mode,
         "--scheme", scheme, "--ckpt", ckpt, "--cache", cache],
        env={**env, "STORAGE_EMULATOR_HOST": hosts[r]} if hosts else env, stdout=subprocess.PIPE)
        for r in range(2)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"{mode} rank failed: {p.returncode}")
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return sorted(out, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=1728)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--schemes", default="rows,megatron")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", default="")
    ap.add_argument("--mode", default="ranged")
    ap.add_argument("--scheme", default="rows")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--cache", default="")
    ap.add_argument("--storage", choices=("local", "gs"), default="local",
                    help="where the checkpoint lies: local files, or the GCS emulator")
    ap.add_argument("--storage-gbps", type=float, default=0.0,
                    help="gs: each rank's link to the bucket in GB/s (0: unthrottled)")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    os.environ.update(RESHARD_D=str(args.d), RESHARD_F=str(4 * args.d), RESHARD_V=str(8 * args.d))
    import reshard_workers as rw

    from nccl_back.model.identity import ModelSpec
    from nccl_back.model.skeleton import build

    from models import fill_random, write_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = fill_random(build(lambda: rw.Flat(rw.checkpoint_shapes())), seed=1)
        ckpt = str(write_checkpoint(model, Path(tmp) / "ckpt", n_shards=2))
        del model
        cache = str(Path(tmp) / "cache")
        size = sum(p.stat().st_size for p in Path(ckpt).glob("*.safetensors"))
        with contextlib.ExitStack() as up:
            hosts: list[str] = []
            if args.storage == "gs":
                ckpt, hosts = _bucket(up, ckpt, args.storage_gbps)
            ModelSpec.from_dir(ckpt, cache_dir=cache)  # the CRC32C cache, and the page cache
            print(f"checkpoint {size / 2**20:.1f} MiB in 2 files at {ckpt}; TP=2, gloo,"
                  f" D={args.d}" + (f"; each rank's link {args.storage_gbps:g} GB/s"
                                    if args.storage_gbps else ""))
            for scheme in args.schemes.split(","):
                runs: dict[str, list[list[dict[str, Any]]]] = {"whole": [], "ranged": []}
                for _ in range(args.repeat):
                    for mode in ("whole", "ranged"):
                        runs[mode].append(run_group(mode, scheme, ckpt, cache, args.d, hosts))
                for mode, groups in runs.items():
                    _report(scheme, mode, groups, size)


def _bucket(up: contextlib.ExitStack, ckpt: str, gbps: float) -> tuple[str, list[str]]:
    """Upload ``ckpt`` to a GCS emulator; its ``gs://`` URI and each rank's endpoint (its
    own throttled proxy when ``gbps``)."""
    from nccl_back.dev import throttle
    from nccl_back.dev.gcs_emulator import LocalGCS

    gcs = up.enter_context(LocalGCS().start())
    bucket = gcs.client().create_bucket("ckpt")  # sets STORAGE_EMULATOR_HOST here
    for f in sorted(Path(ckpt).iterdir()):
        bucket.blob(f"ckpt/{f.name}").upload_from_filename(str(f))
    if not gbps:
        return "gs://ckpt/ckpt", [gcs.host, gcs.host]
    hosts = []
    for _ in range(2):
        proxy = throttle.serve(gcs.host, gbps, cache=True)
        up.callback(proxy.shutdown)
        hosts.append(f"http://127.0.0.1:{proxy.server_address[1]}")
    return "gs://ckpt/ckpt", hosts


def _report(scheme: str, mode: str, groups: list[list[dict[str, Any]]], size: int) -> None:
    mib = 2**20
    med = statistics.median
    total = med(sum(r["read"] for r in g) for g in groups)
    per_rank = [med(g[k]["read"] for g in groups) for k in range(2)]
    secs = med(max(r["seconds"] for r in g) for g in groups)
    hwm = [med(g[k]["hwm"] for g in groups) for k in range(2)]
    rise = [med(g[k]["hwm"] - g[k]["rss_before"] for g in groups) for k in range(2)]
    share = groups[0][0]["share"]
    counted = med(sum(r["loader_bytes"] for r in g) for g in groups)
    print(f"{scheme:8s} {mode:6s}: read per rank {per_rank[0] / mib:.1f} / {per_rank[1] / mib:.1f} MiB,"
          f" total {total / mib:.1f} MiB = {total / size:.2f}x checkpoint; {secs:.2f} s (slowest rank,"
          f" median of {len(groups)}); VmHWM per rank {hwm[0] / mib:.0f} / {hwm[1] / mib:.0f} MiB,"
          f" rise over the load {rise[0] / mib:.0f} / {rise[1] / mib:.0f} MiB (share {share / mib:.0f} MiB)"
          + f"; the loaders' own count {counted / mib:.1f} MiB = {counted / size:.2f}x"
          + (f", the CRC check"
             f" {med(max(r['verify'] for r in g) for g in groups):.3f} s, the shared tensors' reads and"
             f" broadcasts {med(max(r['shared'] for r in g) for g in groups):.2f} s"
             if mode == "ranged" else ""))


if __name__ == "__main__":
    main()
