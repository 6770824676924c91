"""A whole peer load against one raw flat gloo broadcast of the same bytes.

Two processes: this script (the receiver) and a child it starts (the holder). The
holder loads a plain ``nn.Module`` (one allocation per parameter, as an engine builds
it) from a checkpoint the parent wrote, through ``WeightService`` (storage, then it
serves), and also hosts a raw gloo sender. In each round the receiver, in this order:

* ``raw``: one broadcast of a fresh ``torch.empty`` buffer of the model's byte size from
  the holder, on a communicator built for it (the ceiling: no per-tensor work, the same
  first-touch page faults as a fresh model);
* ``load``: ``WeightService.load`` of a freshly built module of the same shapes from
  the holder (discovery, claim, handshake, rendezvous, bucketed transfer, verification,
  publication), the skeleton's build timed apart.

It prints both times per round, the phases of each load, and the ratio raw / load (the
goal: at least 0.75 at 1 GiB and at 128 MiB). Ratios, not absolute times: these
machines are shared and noisy.

    .venv/bin/python benchmarks/peer_load.py --gib 1 --rounds 3
    .venv/bin/python benchmarks/peer_load.py --gib 0.125 --rounds 5
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from peer_transfer import model_shapes  # benchmarks/peer_transfer.py: the same model
from safetensors.torch import save_file
from torch import nn

from nccl_back.config import Settings
from nccl_back.coord.registry import Registry
from nccl_back.load.service import WeightService
from nccl_back.model.identity import ModelSpec
from nccl_back.transport import open_rendezvous, prefault, receiver_transport, run_guarded


class Plain(nn.Module):
    """Parameters at dotted names, each its own ``torch.empty`` (no init, no consolidation)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            owner: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(
                leaf, nn.Parameter(torch.empty(shape, dtype=torch.bfloat16), requires_grad=False))


def write_checkpoint(directory: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """Random bf16 weights in 4 shards (sorted-name order), and a config."""
    gen = torch.Generator().manual_seed(0)
    names = sorted(shapes)
    for i in range(4):
        part = names[i * len(names) // 4:(i + 1) * len(names) // 4]
        save_file({n: (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16)
                   for n in part}, str(directory / f"model-{i + 1:05d}-of-00004.safetensors"))
    (directory / "config.json").write_text(json.dumps({"nccl_back_bench": "peer_load"}))


def settings(redis_url: str, namespace: str, cache_dir: str, bucket_mib: float) -> Settings:
    return Settings(redis_url=redis_url, namespace=namespace, advertise_host="127.0.0.1",
                    cache_dir=cache_dir, transfer_timeout=600, cohort_max_size=1,
                    bucket_bytes=int(bucket_mib * (1 << 20)))


def serve(args: argparse.Namespace) -> None:
    """The holder: load from storage, serve; answer ``rounds`` raw broadcasts."""
    s = settings(args.redis_url, args.namespace, args.cache_dir, args.bucket_mib)
    shapes = model_shapes(args.gib)
    spec = ModelSpec.from_dir(args.ckpt, cache_dir=args.cache_dir)
    registry = Registry(s)
    with WeightService(s, worker_id="holder") as svc:
        svc.load(Plain(shapes), spec)
        nbytes = sum(torch.Size(sh).numel() * 2 for sh in shapes.values())
        flat = torch.ones(nbytes, dtype=torch.uint8)
        rdv = open_rendezvous(s, "gloo", registry=registry, device=torch.device("cpu"))
        print(json.dumps({"address": rdv.address}), flush=True)
        for r in range(args.rounds):
            run_guarded(rdv.sender(f"{args.serve}-{r}"), lambda t: t.copy(flat).wait(),
                        time.monotonic() + 600)
        sys.stdin.readline()  # the receiver's last load is done: stop serving
        rdv.close()


def fresh_allocations() -> None:
    """Every allocation of 128 KiB or more its own ``mmap``, returned on free (glibc).

    By default glibc raises its mmap threshold once a large block is freed, and a later
    round's model can then reuse pages an earlier round faulted in (seen: 1 418 faults
    instead of 262 000 in one round of four): each round should load into memory as
    fresh as an engine's first model in a new process.
    """
    if sys.platform == "linux":
        ctypes.CDLL(None).mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD (fixed: no dynamic raise)


def measure(args: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    shapes = model_shapes(args.gib)
    fresh_allocations()
    prefault.ENABLED = not args.no_prefault
    with tempfile.TemporaryDirectory(prefix="nccl-back-peer-load-") as tmp:
        ckpt, cache = Path(tmp) / "ckpt", str(Path(tmp) / "cache")
        ckpt.mkdir()
        write_checkpoint(ckpt, shapes)
        spec = ModelSpec.from_dir(str(ckpt), cache_dir=cache)
        ns, tid = f"pl-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
        s = settings(redis_url, ns, cache, args.bucket_mib)
        registry = Registry(s)
        cmd = [sys.executable, __file__, "--serve", tid, "--redis-url", redis_url,
               "--namespace", ns, "--cache-dir", cache, "--ckpt", str(ckpt),
               "--gib", str(args.gib), "--rounds", str(args.rounds),
               "--bucket-mib", str(args.bucket_mib)]
        rows = []
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None and proc.stdin is not None
            address = json.loads(proc.stdout.readline())["address"]
            nbytes = spec.nbytes
            for r in range(args.rounds):
                # Fresh memory pays first-touch page faults as the fresh model does;
                # --touched-raw measures the broadcast alone (memory already written).
                flat = (torch.ones if args.touched_raw else torch.empty)(nbytes, dtype=torch.uint8)
                transport = receiver_transport(s, "gloo", address, f"{tid}-{r}",
                                               device=torch.device("cpu"), registry=registry)
                t = time.perf_counter()
                run_guarded(transport, lambda tr, flat=flat: tr.copy(flat).wait(),
                            time.monotonic() + 600)
                raw = time.perf_counter() - t
                del flat
                t = time.perf_counter()
                model = Plain(shapes)
                skeleton = time.perf_counter() - t
                with WeightService(s, worker_id=f"receiver{r}") as svc:
                    result = svc.load(model, spec)
                if result.source != "peer":
                    raise SystemExit(f"round {r}: loaded from {result.source}: {result.fallback_reason}")
                rows.append({"raw": raw, "load": result.seconds, "skeleton": skeleton,
                             "phases": {k: round(v, 4) for k, v in result.timings.items()}})
                del model
            proc.stdin.write("stop\n")
            proc.stdin.flush()
            proc.wait(60)
        registry.close()
    raw_s = statistics.median(r["raw"] for r in rows)
    load_s = statistics.median(r["load"] for r in rows)
    gb = spec.nbytes / 1e9
    return {
        "bytes": spec.nbytes, "tensors": len(shapes), "prefault": not args.no_prefault,
        "bucket_bytes": s.bucket_for("gloo", spec.nbytes),
        "rounds": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                   for r in rows],
        "raw_gbps_median": round(gb / raw_s, 3), "load_gbps_median": round(gb / load_s, 3),
        "ratio_raw_over_load_median": round(raw_s / load_s, 3),
        # The same ratio round by round (each load against the raw round just before it):
        # steadier than the ratio of medians when the machine's load drifts.
        "ratio_per_round_median": round(statistics.median(r["raw"] / r["load"] for r in rows), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--touched-raw", action="store_true",
                        help="broadcast the raw round into memory already written (no page faults)")
    parser.add_argument("--bucket-mib", type=float, default=0,
                        help="Settings.bucket_bytes in MiB (default 0: automatic, model/128 within 1-8 MiB)")
    parser.add_argument("--no-prefault", action="store_true",
                        help="receive without faulting pages in ahead (transport.prefault off)")
    parser.add_argument("--serve", metavar="TRANSFER_ID", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    from nccl_back.dev.servers import LocalRedis

    with LocalRedis() as redis:
        print(json.dumps(measure(args, redis.url), indent=1))


if __name__ == "__main__":
    main()
