"""Benchmark: fingerprinting and loading a local checkpoint from storage.

Measures, on one synthetic checkpoint of ``--size-mb`` in ``--shards`` files:

1. ``ModelSpec.from_dir`` with a cold CRC32C cache vs a warm one (the warm run must
   open no shard file; an injected opener counts the opens).
2. ``load_from_storage`` into a flat skeleton vs a raw read of the same files into a
   pre-allocated buffer, page cache warm for both. Both destinations are fresh
   allocations (first-touch page faults counted, as at a real cold start); the same
   pair is also measured with destinations already touched.
3. Sampled and full integrity hashes (``nccl_back.model.integrity.layer_hashes``) as a
   fraction of the load time.

Run: ``.venv/bin/python benchmarks/storage_load.py --size-mb 1024``
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from safetensors.torch import save_file

from nccl_back.config import Settings
from nccl_back.model.checkpoint import flat_skeleton
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import load_from_storage
from nccl_back.model.storage import LocalFiles, Storage

TENSOR_BYTES = 4 << 20


def write_synthetic(directory: Path, size_mb: int, shards: int) -> None:
    """``shards`` files of float16 tensors (~4 MiB each) totalling ``size_mb`` MiB."""
    per_shard = (size_mb << 20) // shards
    for s in range(shards):
        tensors: dict[str, torch.Tensor] = {}
        left, i = per_shard, 0
        while left > 0:
            n = min(TENSOR_BYTES, left) // 2
            # Distinct cheap content per tensor; the values do not matter, the bytes do.
            tensors[f"model.layers.{s}.w{i}"] = torch.arange(n, dtype=torch.int16).add_(s * 31 + i).view(torch.float16)
            left -= n * 2
            i += 1
        save_file(tensors, str(directory / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))
    (directory / "config.json").write_text('{"model_type": "synthetic"}')
    # Old enough for the CRC32C cache to trust (files modified within 2 s are not cached).
    past = time.time() - 60
    for f in directory.iterdir():
        os.utime(f, (past, past))


def raw_read(files: list[Path], into: np.ndarray) -> None:
    """Read every byte of ``files`` back to back into ``into``."""
    off = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(into[off:]):
                off += n


def best_of(n: int, fn: Any) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed after)")
    args = parser.parse_args()

    work = Path(args.dir or tempfile.mkdtemp(prefix="nccl-back-bench-"))
    ckpt, cache = work / "ckpt", work / "cache"
    ckpt.mkdir(parents=True, exist_ok=True)
    try:
        write_synthetic(ckpt, args.size_mb, args.shards)
        files = sorted(ckpt.glob("*.safetensors"))
        total = sum(f.stat().st_size for f in files)
        print(f"checkpoint: {len(files)} shards, {total / 1e9:.3f} GB, torch threads {torch.get_num_threads()}")

        opened: list[str] = []

        def counting(path: str) -> IO[bytes]:
            opened.append(path)
            return open(path, "rb", buffering=0)

        storage = Storage(backends={"file": LocalFiles(opener=counting)})
        t = time.perf_counter()
        spec = ModelSpec.from_dir(str(ckpt), cache_dir=str(cache), storage=storage)
        cold = time.perf_counter() - t
        cold_opens = len(opened)
        opened.clear()
        t = time.perf_counter()
        again = ModelSpec.from_dir(str(ckpt), cache_dir=str(cache), storage=storage)
        warm = time.perf_counter() - t
        if again.version != spec.version or opened:
            raise SystemExit(f"warm fingerprint differs or read shards: {opened}")
        print(f"fingerprint cold {cold * 1e3:8.1f} ms ({cold_opens} shards read, {total / cold / 1e9:.2f} GB/s)")
        print(f"fingerprint warm {warm * 1e3:8.1f} ms (0 shards read)   cold/warm = {cold / warm:.0f}x")

        raw_read(files, np.empty(total, dtype=np.uint8))  # warm the page cache

        def fresh_raw() -> None:
            # torch's allocator, like the skeleton's: numpy asks for transparent huge
            # pages on large arrays, torch does not, and first-touch cost differs a lot.
            raw_read(files, torch.empty(total, dtype=torch.uint8).numpy())

        # The fingerprint's CRC32C cache: the load checks local shards against it for free.
        settings = Settings(cache_dir=str(cache))

        def fresh_load() -> None:
            load_from_storage(flat_skeleton(spec), spec, settings=settings)

        t_raw = best_of(args.repeat, fresh_raw)
        t_load = best_of(args.repeat, fresh_load)
        print(f"fresh destinations: raw read {total / t_raw / 1e9:.2f} GB/s, "
              f"load (incl. skeleton) {total / t_load / 1e9:.2f} GB/s, ratio {t_raw / t_load:.2f}")

        buf = np.empty(total, dtype=np.uint8)
        skeleton = flat_skeleton(spec)
        raw_read(files, buf)
        result = load_from_storage(skeleton, spec, settings=settings)
        t_raw = best_of(args.repeat, lambda: raw_read(files, buf))
        t_load = best_of(args.repeat, lambda: load_from_storage(skeleton, spec, settings=settings))
        print(f"touched destinations: raw read {total / t_raw / 1e9:.2f} GB/s, "
              f"load {total / t_load / 1e9:.2f} GB/s, ratio {t_raw / t_load:.2f}")
        # Without the CRC32C cache the load checksums every local shard (over its
        # mapping, before copying): the cost of a load that follows no fingerprint.
        no_cache = [Settings(cache_dir=str(work / f"empty-cache-{i}")) for i in range(args.repeat)]
        t_uncached = best_of(args.repeat, lambda: load_from_storage(skeleton, spec, settings=no_cache.pop()))
        print(f"load with CRC32C computed (no cache) {total / t_uncached / 1e9:.2f} GB/s, "
              f"cached/uncached time {t_load / t_uncached:.2f}")

        try:
            from nccl_back.model.integrity import layer_hashes
        except ImportError:
            print("integrity: nccl_back.model.integrity.layer_hashes not available; skipped")
        else:
            for mode in ("sampled", "full"):
                t_hash = best_of(args.repeat, lambda m=mode: layer_hashes(skeleton, mode=m))
                print(f"integrity {mode:7}: {t_hash * 1e3:8.1f} ms = {t_hash / t_load:.1%} of the load")
        del result
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
