"""Peer transfer throughput: the bucketed data plane vs one flat broadcast, over gloo.

Two processes (this script starts the sender as a child of itself) share one gloo
transport per round. In each round, on the same communicator, they run:

* ``flat``: one broadcast of a single pre-allocated buffer of the model's byte size
  (the transport's ceiling: no per-tensor work at all), and
* ``tensors``: :func:`send_tensors` / :func:`recv_tensors` of the model itself.

Both sides' memory is allocated and touched before timing, so this measures the data
plane, not page faults (which a real cold start also pays). Times are
taken on the receiver, from a 1-byte synchronising broadcast to the end.

    .venv/bin/python benchmarks/peer_transfer.py --gib 1 --rounds 3 \
        --bucket-bytes 67108864 16777216 1048576 [--layout consolidated|separate]

Default bucket: what the service uses for gloo and this model
(``Settings().bucket_for("gloo", model_bytes)``).

The model looks like a small LLM in bf16: an embedding and N layers of q/k/v/o, a
gated MLP and two norms, scaled to ``--gib`` (a few hundred tensors for 1 GiB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid

import torch

from nccl_back.config import Settings
from nccl_back.coord.registry import Registry
from nccl_back.model.skeleton import Manifest, TensorEntry, flat_layout
from nccl_back.transport import (
    Transport,
    receiver_transport,
    recv_tensors,
    run_guarded,
    send_tensors,
)
from nccl_back.transport.gloo import GlooRendezvous

HIDDEN, INTER, VOCAB = 1024, 2816, 32000


def model_shapes(gib: float) -> dict[str, tuple[int, ...]]:
    """An LLM-like bf16 state dict of about ``gib`` GiB."""
    per_layer = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN) * 2
    layers = max(1, round((gib * 2**30 - VOCAB * HIDDEN * 2) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (VOCAB, HIDDEN), "norm.weight": (HIDDEN,)}
    for i in range(layers):
        p = f"layers.{i:03d}."
        for name in ("q", "k", "v", "o"):
            shapes[p + f"attn.{name}.weight"] = (HIDDEN, HIDDEN)
        shapes[p + "mlp.gate.weight"] = (INTER, HIDDEN)
        shapes[p + "mlp.up.weight"] = (INTER, HIDDEN)
        shapes[p + "mlp.down.weight"] = (HIDDEN, INTER)
        shapes[p + "norm1.weight"] = (HIDDEN,)
        shapes[p + "norm2.weight"] = (HIDDEN,)
    return shapes


def allocate(shapes: dict[str, tuple[int, ...]], layout: str) -> dict[str, torch.Tensor]:
    """The model's tensors, every page touched before timing.

    ``separate``: one allocation per tensor (a model built the ordinary way);
    ``consolidated``: views of one buffer in manifest order, as ``skeleton.build`` and
    ``checkpoint.flat_skeleton`` lay a skeleton out (``skeleton.consolidate``).
    """
    if layout == "separate":
        return {n: torch.ones(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    man = Manifest(tuple(TensorEntry(n, s, "bfloat16") for n, s in sorted(shapes.items())))
    offsets, total = flat_layout(man)
    buf = torch.ones(total, dtype=torch.uint8)
    return {e.name: buf[offsets[e.name]: offsets[e.name] + e.nbytes].view(torch.bfloat16).view(e.shape)
            for e in man.entries}


def rounds(transport: Transport, tensors: dict[str, torch.Tensor], flat: torch.Tensor,
           buckets: list[int], n: int) -> list[dict[str, float]]:
    """``n`` rounds of: the flat broadcast, then the data plane at each bucket size."""
    sync = torch.zeros(1, dtype=torch.uint8)
    out = []
    for _ in range(n):
        row = {}
        for what in ["flat", *map(str, buckets)]:
            transport.copy(sync).wait()
            start = time.perf_counter()
            if what == "flat":
                transport.copy(flat).wait()
            elif transport.rank == 0:
                send_tensors(transport, tensors, int(what))
            else:
                recv_tensors(transport, tensors, int(what))
            row[what] = time.perf_counter() - start
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-bytes", type=int, nargs="+", default=None,
                        help="one or more bucket sizes, each measured against the same flat run"
                             " (default: what the service chooses for gloo and this model)")
    parser.add_argument("--layout", choices=("consolidated", "separate"), default="consolidated",
                        help="skeleton memory layout on both sides (default: as skeleton.build makes it)")
    parser.add_argument("--serve", metavar="TRANSFER_ID", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.redis_url is None:  # the measuring parent: a Redis for the bootstrap
        from nccl_back.dev.servers import LocalRedis

        with LocalRedis() as redis:
            args.redis_url = redis.url
            measure(args)
    else:
        measure(args)


def measure(args: argparse.Namespace) -> None:
    """One side of the benchmark (the parent receives and reports, ``--serve`` sends)."""
    settings = Settings(advertise_host="127.0.0.1", transfer_timeout=600,
                        redis_url=args.redis_url, namespace="bench")
    registry = Registry(settings)
    shapes = model_shapes(args.gib)
    tensors = allocate(shapes, args.layout)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if args.bucket_bytes is None:
        args.bucket_bytes = [Settings().bucket_for("gloo", nbytes)]
    flat = torch.ones(nbytes, dtype=torch.uint8)
    deadline = time.monotonic() + settings.transfer_timeout

    if args.serve:
        rdv = GlooRendezvous(settings, registry)
        print(json.dumps({"address": rdv.address}), flush=True)
        run_guarded(rdv.sender(args.serve),
                    lambda t: rounds(t, tensors, flat, args.bucket_bytes, args.rounds), deadline)
        rdv.close()
        return

    tid = uuid.uuid4().hex
    cmd = [sys.executable, __file__, "--serve", tid, "--redis-url", args.redis_url, "--gib", str(args.gib),
           "--rounds", str(args.rounds), "--layout", args.layout, "--bucket-bytes", *map(str, args.bucket_bytes)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        address = json.loads(proc.stdout.readline())["address"]
        transport = receiver_transport(settings, "gloo", address, tid, device=torch.device("cpu"),
                                       registry=registry)
        times = run_guarded(
            transport, lambda t: rounds(t, tensors, flat, args.bucket_bytes, args.rounds), deadline
        )
        proc.wait(60)
    gb = nbytes / 1e9
    flat_s = statistics.median(r["flat"] for r in times)
    report: dict[str, object] = {
        "layout": args.layout,
        "tensors": len(tensors),
        "bytes": nbytes,
        "rounds_seconds": [{k: round(v, 3) for k, v in r.items()} for r in times],
        "flat_gbps_median": round(gb / flat_s, 3),
    }
    for bucket in args.bucket_bytes:
        tens_s = statistics.median(r[str(bucket)] for r in times)
        report[f"bucket_{bucket}"] = {
            "gbps_median": round(gb / tens_s, 3),
            "ratio_to_flat_median": round(flat_s / tens_s, 3),
        }
    print(json.dumps(report, indent=1))

if __name__ == "__main__":
    main()
