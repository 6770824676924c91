"""What the elected worker's proof of a cooperative download costs, against reading the
checkpoint: both CRC every byte, the proof from memory and the read from storage.

Run: ``.venv/bin/python benchmarks/held_proof.py [--d 512 --layers 16 --n 8 --repeat 5]``

A transformer-shaped fp32 checkpoint (the shapes of ``benchmarks/share_read.py``; ~277
MiB at D=512 and 16 layers) in two local files, in the page cache. In one process,
alternating, medians of ``--repeat``:

* **read**: one worker's whole download into its tensors (``read_share`` with N=1:
  every byte read, CRC-ed and placed; what a single-flight download costs beyond the
  link);
* **proof**: the elected worker's proof once the N members' parts landed in its
  tensors (``held_proof.held_reads`` then ``prove``: every tensor's bytes CRC-ed from
  memory, cut at every member's boundaries, and only the bytes no tensor holds read).

Reported: seconds of each, the proof against the read, and the bytes the proof read
from storage against the checkpoint. CPU tensors only: a GPU tensor's proof adds its
copy to the host, staged in bounded pieces.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: The plan's bucket: about 64 steps per model, as ``transport="gloo"`` picks.
BUCKET_BYTES = 2 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="members whose parts landed")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.n < 1 or args.repeat < 1:
        ap.error(f"--n {args.n} --repeat {args.repeat}: both must be 1 or more")
    import reshard_workers as rw
    from share_read import shapes

    from nccl_back.config import Settings
    from nccl_back.load.held_proof import held_reads
    from nccl_back.load.share_read import prove, read_share
    from nccl_back.model.checkpoint import model_headers
    from nccl_back.model.identity import ModelSpec
    from nccl_back.model.skeleton import build, named_tensors
    from nccl_back.model.storage import Storage
    from nccl_back.transport import plan

    from models import fill_random, write_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = fill_random(build(lambda: rw.Flat(shapes(args.d, args.layers))), seed=1)
        ckpt = write_checkpoint(model, Path(tmp) / "ckpt", n_shards=2)
        spec = ModelSpec.from_dir(str(ckpt), cache_dir=str(Path(tmp) / "cache"))
        size = sum(s.size for s in spec.shards)
        storage = Storage(Settings())
        headers = model_headers(storage, spec)
        tensors = named_tensors(model)[0]
        steps = plan(tensors, BUCKET_BYTES)
        target = named_tensors(build(lambda: rw.Flat(shapes(args.d, args.layers))))[0]
        print(f"checkpoint {size / 2**20:.1f} MiB in 2 local files (page cache); proof over"
              f" {args.n} members' parts; {args.repeat} runs each, alternating")
        reads, proofs, proof_bytes = [], [], 0
        for _ in range(args.repeat):
            t = time.perf_counter()
            prove(spec, [read_share(storage, spec, headers, steps, 1, 0, target)])
            reads.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = held_reads(storage, spec, headers, steps, args.n, tensors)
            prove(spec, got)
            proofs.append(time.perf_counter() - t)
            proof_bytes = sum(r.bytes for r in got)
        read, proof = statistics.median(reads), statistics.median(proofs)
        print(f"read (one worker's whole download, CRC-ed): {read:.3f} s median"
              f" (runs {', '.join(f'{x:.3f}' for x in reads)}); {size / read / 1e9:.2f} GB/s")
        print(f"proof (every held byte CRC-ed from memory): {proof:.3f} s median"
              f" (runs {', '.join(f'{x:.3f}' for x in proofs)}); {size / proof / 1e9:.2f} GB/s;"
              f" {proof / read:.2f}x the read")
        print(f"bytes the proof read from storage: {proof_bytes} ({proof_bytes / size:.6f}x the checkpoint:"
              " headers and padding)")


if __name__ == "__main__":
    main()
