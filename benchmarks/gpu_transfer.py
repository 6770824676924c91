"""GPU figures for one H200 (run by ``scripts/gpu_check.sh``; needs CUDA).

* NCCL transfer between two processes sharing the one GPU, against a device-to-device
  copy of the same bytes in one process (the ceiling for bytes that never leave the
  card). Two ranks on one GPU go through NCCL's socket transport on loopback (see
  ``tests/gpu_pair.py``), so the ratio measures this harness's set-up, not NVLink or
  InfiniBand; it proves the path, the figure is not a fleet's.
* ``full`` and ``sampled`` integrity hashes on the GPU, GB/s over the same bytes.

    python benchmarks/gpu_transfer.py [--mib 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from gpu_pair import run_pair  # noqa: E402

from nccl_back.model.integrity import layer_hashes  # noqa: E402


def d2d_gbps(nbytes: int, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    return nbytes * repeats / (time.perf_counter() - start) / 1e9


def hash_gbps(nbytes: int, mode: str) -> float:
    m = torch.nn.Module()
    # 64 tensors, as a model's layers would be.
    for i in range(64):
        m.register_buffer(f"l{i}", torch.randn(nbytes // 64 // 2, device="cuda").to(torch.bfloat16))
    layer_hashes(m, mode)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    layer_hashes(m, mode)
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - start) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    nbytes = args.mib << 20
    os.environ["PAIR_BENCH_MIB"] = str(args.mib)
    report = run_pair("bench", deadline_s=60, limit_s=120)
    s, r = report["sender"], report["receiver"]
    ok = s.get("outcome") == r.get("outcome") == "done"
    out = {
        "bytes": nbytes,
        "transfer_ok": ok,
        "transfer_gbps_receiver": r.get("gbps"),
        "transfer_gbps_sender": s.get("gbps"),
        "d2d_copy_gbps": round(d2d_gbps(nbytes), 1),
        "full_hash_gbps": round(hash_gbps(nbytes, "full"), 1),
        "sampled_hash_gbps": round(hash_gbps(nbytes, "sampled"), 1),
        "report": {k: v for k, v in report.items() if k in ("hung", "exitcodes")},
    }
    if not ok:
        out["sender"], out["receiver"] = s, r
    if ok and r.get("gbps"):
        out["transfer_vs_d2d"] = round(r["gbps"] / out["d2d_copy_gbps"], 4)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
