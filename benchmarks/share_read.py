"""A cooperative download's storage side: N workers, each with its own capped link to
the bucket, read their shares of a checkpoint, against one worker reading it all.

Run: ``.venv/bin/python benchmarks/share_read.py [--d 384 --layers 16 --gbps 0.05 --sizes 1,2,4,8,16 --repeat 3]``

A transformer-shaped fp32 checkpoint (per layer q/k/v/o D×D and gate/up/down 4D×D, an
embedding 8D×D; ~149 MiB at D=384 and 16 layers, the embedding 3% of it, as in a
real model, where the largest unit the shares are cut by is small beside a share) in
two objects of the GCS emulator. For each N, in the same run and
alternating: N fresh processes, each reaching the emulator through its own throttled
proxy (``nccl_back/dev/throttle.py``, ``--gbps`` GB/s: a worker's own link to the
bucket), plan the model's transfer, parse the headers, then, once all are ready, at one moment read
their share (``load/share_read.py``: worker i reads the bytes of part i of the plan
into its tensors with ranged requests, and its interval CRCs); the parent then proves
every object's CRC32C from all of them. Reported: the time until the slowest share
has landed, against N=1 (one worker reading every byte, its whole link), the bytes
read from storage against the checkpoint, and whether the proof passed.

**The storage side only**: the exchange of the shares (``load/cooperative.py``: the
parts gathered by the elected worker, proven, then streamed to every member) is not in
this figure, so this is not the time to a verified model; it is the floor the exchange
adds to.
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

#: The plan's bucket: about 64 steps per model, as ``transport="gloo"`` picks.
BUCKET_BYTES = 2 << 20


def shapes(d: int, layers: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors: an embedding, then per layer attention and MLP matrices."""
    out: dict[str, tuple[int, ...]] = {"embed": (8 * d, d)}
    for i in range(layers):
        out.update({f"l{i:02d}_{n}": (d, d) for n in ("q", "k", "v", "o")})
        out.update({f"l{i:02d}_{n}": (4 * d, d) for n in ("gate", "up", "down")})
    return out


def worker(args: argparse.Namespace) -> None:
    """Member ``args.member`` of ``args.n``: read its share at ``args.at``, print one JSON line."""
    import reshard_workers as rw

    from nccl_back.config import Settings
    from nccl_back.load.share_read import read_share
    from nccl_back.model.checkpoint import model_headers
    from nccl_back.model.identity import ModelSpec
    from nccl_back.model.skeleton import build, named_tensors
    from nccl_back.model.storage import Storage
    from nccl_back.transport import plan

    spec = ModelSpec.from_dir(args.ckpt)
    storage = Storage(Settings())
    headers = model_headers(storage, spec)
    tensors = named_tensors(build(lambda: rw.Flat(shapes(args.d, args.layers))))[0]
    steps = plan(tensors, BUCKET_BYTES)
    print("ready", flush=True)
    at = float(sys.stdin.readline())
    time.sleep(max(at - time.time(), 0.0))
    hwm = _vm_hwm()
    read = read_share(storage, spec, headers, steps, args.n, args.member, tensors)
    done = time.time()
    print(json.dumps({"member": args.member, "done": done - at, "bytes": read.bytes,
                      "rise": _vm_hwm() - hwm,
                      "intervals": [[iv.uri, iv.start, iv.end, iv.crc] for iv in read.intervals]}),
          flush=True)


def _vm_hwm() -> int:
    """This process's peak resident memory (``VmHWM``), bytes. The model's tensors are
    allocated untouched, so its rise over a read is the pages the share filled plus what
    the read itself held (its staging buffer, the client's buffers)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run(n: int, ckpt: str, hosts: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """N members started together (each through ``hosts[i]``), their reports."""
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", "--member", str(i), "--n", str(n), "--ckpt", ckpt,
         "--d", str(args.d), "--layers", str(args.layers)],
        env={**os.environ, "STORAGE_EMULATOR_HOST": hosts[i]}, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for i in range(n)]
    for p in procs:  # every member imported torch, parsed the headers and planned
        assert p.stdout is not None
        if p.stdout.readline().strip() != b"ready":
            raise RuntimeError("a member failed before reading")
    at = time.time() + 0.2
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(f"{at!r}\n".encode())
        p.stdin.close()
    out = []
    for p in procs:
        assert p.stdout is not None
        stdout = p.stdout.read()
        if p.wait(timeout=600):
            raise RuntimeError(f"member failed: {p.returncode}")
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return sorted(out, key=lambda r: r["member"])


def _proven(ckpt: str, reports: list[dict[str, Any]]) -> bool:
    from nccl_back.errors import ChecksumMismatchError
    from nccl_back.load.share_read import ShareRead, prove
    from nccl_back.model.crc import Interval
    from nccl_back.model.identity import ModelSpec

    reads = [ShareRead(r["member"], r["bytes"], r["done"],
                       tuple(Interval(*iv) for iv in r["intervals"])) for r in reports]
    try:
        prove(ModelSpec.from_dir(ckpt), reads)
    except ChecksumMismatchError as e:
        print(f"  proof failed: {e}")
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--gbps", type=float, default=0.05, help="each worker's link to the bucket, GB/s")
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--member", type=int, default=0)
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--ckpt", default="")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    if not sizes or min(sizes) < 1 or 1 not in sizes:
        ap.error(f"--sizes {args.sizes!r}: a comma-separated list of worker counts that includes 1")
    import reshard_workers as rw

    from nccl_back.dev import throttle
    from nccl_back.dev.gcs_emulator import LocalGCS
    from nccl_back.model.skeleton import build

    from models import fill_random, write_checkpoint

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as up:
        model = fill_random(build(lambda: rw.Flat(shapes(args.d, args.layers))), seed=1)
        local = write_checkpoint(model, Path(tmp) / "ckpt", n_shards=2)
        del model
        size = sum(p.stat().st_size for p in local.glob("*.safetensors"))
        gcs = up.enter_context(LocalGCS().start())
        bucket = gcs.client().create_bucket("ckpt")
        for f in sorted(local.iterdir()):
            bucket.blob(f"ckpt/{f.name}").upload_from_filename(str(f))
        hosts = []
        for _ in range(max(sizes)):
            proxy = throttle.serve(gcs.host, args.gbps, cache=True)
            up.callback(proxy.shutdown)
            hosts.append(f"http://127.0.0.1:{proxy.server_address[1]}")
        ckpt = "gs://ckpt/ckpt"
        print(f"checkpoint {size / 2**20:.1f} MiB in 2 objects at {ckpt} (GCS emulator); each"
              f" worker's link {args.gbps:g} GB/s; N = {sizes}, {args.repeat} runs each, alternating")
        runs: dict[int, list[list[dict[str, Any]]]] = {n: [] for n in sizes}
        for _ in range(args.repeat):
            for n in sizes:
                runs[n].append(run(n, ckpt, hosts, args))
        one = statistics.median(max(r["done"] for r in g) for g in runs[1])
        for n, groups in runs.items():
            slowest = [max(r["done"] for r in g) for g in groups]
            read = statistics.median(sum(r["bytes"] for r in g) for g in groups)
            proven = all(_proven(ckpt, g) for g in groups)
            # Memory beyond the share: the worst member of any run.
            extra = max(r["rise"] - r["bytes"] for g in groups for r in g)
            print(f"N={n:2d}: every share read in {statistics.median(slowest):.2f} s (median;"
                  f" runs {', '.join(f'{s:.2f}' for s in slowest)}) = {statistics.median(slowest) / one:.2f}x"
                  f" N=1; storage bytes {read / size:.2f}x the checkpoint; every object proven: {proven};"
                  f" peak RSS rise over the read at most {extra / 2**20:.0f} MiB beyond the member's share")


if __name__ == "__main__":
    main()
