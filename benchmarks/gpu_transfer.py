"""GPU figures for one H200 (run by ``scripts/gpu_check.sh``; needs CUDA).

* NCCL transfer between two processes sharing the one GPU, against a device-to-device
  copy of the same bytes in one process (the ceiling for bytes that never leave the
  card). Two ranks on one GPU go through NCCL's socket transport on loopback (see
  ``tests/gpu_pair.py``), so the ratio measures this harness's set-up, not NVLink or
  InfiniBand; it proves the path, the figure is not a fleet's.
* ``full`` and ``sampled`` integrity hashes on the GPU, plain and keyed, over 64 and
  300 tensors, GB/s over the same bytes: the fused kernels (``fused_hash``) against the
  torch path in the same run.

    python benchmarks/gpu_transfer.py [--mib 2048] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/gpu_transfer.py --hash-only --device cpu --mib 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from gpu_pair import run_pair  # noqa: E402

from nccl_back.model import fused_hash  # noqa: E402
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


def _model(nbytes: int, tensors: int, device: str) -> torch.nn.Module:
    m = torch.nn.Module()
    for i in range(tensors):  # as a model's layers would be
        m.register_buffer(f"l{i}", torch.randn(nbytes // tensors // 2, device=device).to(torch.bfloat16))
    return m


def hash_gbps(m: torch.nn.Module, nbytes: int, mode: str, key: bytes | None,
              repeats: int = 5) -> float:
    """Median GB/s of ``layer_hashes`` over the model's bytes (warmed up first)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    layer_hashes(m, mode, key=key)  # type: ignore[arg-type]
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        layer_hashes(m, mode, key=key)  # type: ignore[arg-type]
        sync()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def hashes(nbytes: int, device: str) -> dict[str, object]:
    """Full and sampled hashes, plain and keyed, over 64 and 300 bf16 tensors: the fused
    kernels against the torch path, in the same run; the goals (``full`` >= 1,000 GB/s,
    ``sampled`` >= 500 GB/s) checked on the fused figures."""
    dev = torch.device(device)
    start = time.perf_counter()
    if dev.type == "cuda":  # compiled in the background (a load starts it when it begins)
        fused_hash.prepare(dev).wait(180)
    out: dict[str, object] = {"fused_compile_s": round(time.perf_counter() - start, 2),
                              "fused_usable": fused_hash.usable(dev)}
    key = b"k" * 32
    for tensors in (64, 300):
        m = _model(nbytes, tensors, device)
        for mode in ("full", "sampled"):
            for keyed in (False, True):
                name = f"{mode}{'_keyed' if keyed else ''}_{tensors}t"
                fused = hash_gbps(m, nbytes, mode, key if keyed else None)
                with _torch_path():
                    plain = hash_gbps(m, nbytes, mode, key if keyed else None)
                out[f"{name}_fused_gbps"] = round(fused, 1)
                out[f"{name}_torch_gbps"] = round(plain, 1)
        del m
    goal = {"full": 1000.0, "sampled": 500.0}
    out["hash_goals_met"] = all(v >= goal[k.split("_")[0]] for k, v in out.items()
                                if k.endswith("_fused_gbps") and isinstance(v, float))
    out["fused_failed"] = list(fused_hash._failed)
    return out


@contextlib.contextmanager
def _torch_path() -> Iterator[None]:
    usable = fused_hash.usable
    fused_hash.usable = lambda device: False  # type: ignore[assignment]
    try:
        yield
    finally:
        fused_hash.usable = usable  # type: ignore[assignment]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--json", default="")
    # A rehearsal without a GPU: the hash figures only, on CPU tensors (with
    # TRITON_INTERPRET=1 the fused kernels run interpreted: it checks the script, not speed).
    ap.add_argument("--hash-only", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    nbytes = args.mib << 20
    if args.hash_only:
        print(json.dumps(hashes(nbytes, args.device), indent=1))
        return 0
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
        **hashes(nbytes, "cuda"),
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
