"""One receiver filled by two capped senders at once, each sending its part of the
steps, against the whole model from one capped sender: the data plane of the fan-out's
trees (every member receives one part from each tree's parent), on real processes.

Three processes: this script receives; two children (``--serve``) send, each through
its own send-rate cap (the per-worker ``max_send_gbps``, a :class:`Pacer`), as holders
and relay members do. Each round, in order:

* ``whole``: sender A sends every step;
* ``parts``: A sends part 0 and B part 1 of the same steps (:func:`parts`), at once,
  into the same tensors.

Every transfer opens its own communicator (as every real transfer does), and the
receiver's tensors are compared with the senders' by bytes after each round. Times are
taken on the receiver, from opening the transfer to its last step; the ratio
``parts / whole`` is the figure (1.0: no gain; 0.5: two senders' links add up).

    .venv/bin/python benchmarks/parts_transfer.py --mib 256 --cap-gbps 0.1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import torch

from nccl_back.config import Settings
from nccl_back.coord.registry import Registry
from nccl_back.transport import (
    Part,
    Transport,
    parts,
    plan,
    receiver_transport,
    recv_tensors,
    run_guarded,
    send_tensors,
)
from nccl_back.transport.gloo import GlooRendezvous
from nccl_back.transport.pacing import Pacer

SENDERS = ("A", "B")


def model(mib: int, fill: bool) -> dict[str, torch.Tensor]:
    """``mib`` MiB of bf16 layers (4 MiB each, a few small norms between), seeded alike
    on every process (``fill``) or zeroed (the receiver's skeleton)."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for i in range(max(1, mib // 4)):
        for name, shape in ((f"l{i:04d}.w", (1024, 2048)), (f"l{i:04d}.norm", (2048,))):
            out[name] = (torch.randn(shape, generator=g).to(torch.bfloat16) if fill
                         else torch.zeros(shape, dtype=torch.bfloat16))
    return out


def serve(args: argparse.Namespace, settings: Settings, registry: Registry) -> None:
    """A child: send each ``tid:part`` of ``--sends`` in order, through the cap."""
    tensors = model(args.mib, fill=True)
    bucket = settings.bucket_for("gloo", sum(t.numel() * t.element_size() for t in tensors.values()))
    pacer = Pacer(args.cap_gbps)
    rdv = GlooRendezvous(settings, registry)
    print(json.dumps({"address": rdv.address}), flush=True)
    for item in args.sends:
        tid, _, which = item.partition(":")
        part: Part | None = None if which == "-" else (int(which), 2)

        def send(t: Transport, part: Part | None = part) -> None:
            send_tensors(t, tensors, bucket, part=part, pace=pacer.take)

        run_guarded(rdv.sender(tid), send, time.monotonic() + settings.transfer_timeout)
    rdv.close()


def receive(settings: Settings, registry: Registry, address: str, tid: str, tensors: dict[str, torch.Tensor],
            bucket: int, part: Part | None) -> None:
    transport = receiver_transport(settings, "gloo", address, tid, device=torch.device("cpu"),
                                   registry=registry)
    run_guarded(transport, lambda t: recv_tensors(t, tensors, bucket, part=part),
                time.monotonic() + settings.transfer_timeout)


def measure(args: argparse.Namespace, settings: Settings, registry: Registry) -> dict[str, Any]:
    want = model(args.mib, fill=True)
    got = model(args.mib, fill=False)
    nbytes = sum(t.numel() * t.element_size() for t in want.values())
    bucket = settings.bucket_for("gloo", nbytes)
    split = parts(plan(want, bucket), 2)
    tids = [{"whole": uuid.uuid4().hex, "A": uuid.uuid4().hex, "B": uuid.uuid4().hex}
            for _ in range(args.rounds)]
    sends = {"A": [x for r in tids for x in (f"{r['whole']}:-", f"{r['A']}:0")],
             "B": [f"{r['B']}:1" for r in tids]}
    procs: dict[str, subprocess.Popen[str]] = {}
    address: dict[str, str] = {}
    for name in SENDERS:
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--redis-url", settings.redis_url, "--mib", str(args.mib),
             "--cap-gbps", str(args.cap_gbps), "--sends", *sends[name]], stdout=subprocess.PIPE, text=True)
        out = procs[name].stdout
        assert out is not None
        address[name] = json.loads(out.readline())["address"]
    rows = []
    try:
        for r in tids:
            row: dict[str, float] = {}
            for mode in ("whole", "parts"):
                for t in got.values():
                    t.zero_()
                began = time.perf_counter()
                if mode == "whole":
                    receive(settings, registry, address["A"], r["whole"], got, bucket, None)
                else:
                    errors: list[BaseException] = []

                    def one(i: int, name: str, r: dict[str, str] = r, errors: list[BaseException] = errors) -> None:
                        try:
                            receive(settings, registry, address[name], r[name], got, bucket, (i, 2))
                        except BaseException as e:  # noqa: BLE001 - re-raised below
                            errors.append(e)

                    threads = [threading.Thread(target=one, args=(i, n)) for i, n in enumerate(SENDERS)]
                    for th in threads:
                        th.start()
                    for th in threads:
                        th.join()
                    if errors:
                        raise errors[0]
                row[mode] = time.perf_counter() - began
                bad = [n for n in want if not torch.equal(want[n].view(torch.uint8), got[n].view(torch.uint8))]
                if bad:
                    raise SystemExit(f"{mode}: {len(bad)} tensors differ, first {bad[0]}")
            rows.append(row)
    finally:
        for p in procs.values():
            p.wait(60)
    whole = statistics.median(r["whole"] for r in rows)
    both = statistics.median(r["parts"] for r in rows)
    return {
        "bytes": nbytes, "cap_gbps": args.cap_gbps, "steps": len(split[0]) + len(split[1]),
        "part_bytes": [sum(plan(want, bucket)[k].nbytes for k in p) for p in split],
        "rounds_seconds": [{k: round(v, 3) for k, v in r.items()} for r in rows],
        "whole_s_median": round(whole, 3), "parts_s_median": round(both, 3),
        "parts_over_whole": round(both / whole, 3), "exact": True,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="model size in MiB (default 256)")
    parser.add_argument("--cap-gbps", type=float, default=0.1,
                        help="each sender's send-rate cap in GB/s (default 0.1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sends", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mib < 4 or args.cap_gbps <= 0 or args.rounds < 1:
        parser.error("--mib must be >= 4, --cap-gbps > 0 and --rounds >= 1")

    def run(url: str) -> None:
        settings = Settings(advertise_host="127.0.0.1", transfer_timeout=600, redis_url=url,
                            namespace="bench-parts")
        registry = Registry(settings)
        if args.serve:
            serve(args, settings, registry)
        else:
            print(json.dumps(measure(args, settings, registry), indent=1))

    if args.redis_url is None:  # the measuring parent: a Redis for the bootstrap
        from nccl_back.dev.servers import LocalRedis

        with LocalRedis() as redis:
            run(redis.url)
    else:
        run(args.redis_url)


if __name__ == "__main__":
    main()
