"""Benchmark: s3:// identity and downloads against a real S3-compatible server (moto).

On one synthetic checkpoint of ``--size-mb`` in ``--shards`` files, uploaded twice
(with a CRC32C in each object's metadata, and without one):

1. ``ModelSpec.from_dir`` on each prefix with a cold cache, then again with a new
   ``Storage`` on the same cache (a restart): seconds, and the shard bytes the server
   sent (counted by a real proxy in front of it).
2. ``Storage.download_many`` of every shard from S3, and from the GCS emulator with
   the same bytes: seconds, GB/s and this process's CPU seconds. Both servers are Python processes on this
   machine, so the rates say what those emulators serve, not what AWS or GCS would.
3. ``ModelSpec.from_dir`` on a prefix whose index is 80 MiB, over its 64 MiB bound:
   seconds to the refusal (goal: under a second, its body never read) and this
   process's peak RSS rise (reading the body would add 80 MiB).

Run: ``.venv/bin/python benchmarks/s3_storage.py --size-mb 256``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from storage_load import write_synthetic  # noqa: E402

from nccl_back.config import Settings  # noqa: E402
from nccl_back.dev.gcs_emulator import LocalGCS  # noqa: E402
from nccl_back.dev.s3_emulator import LocalS3  # noqa: E402
from nccl_back.model.identity import ModelSpec  # noqa: E402
from nccl_back.model.storage import Storage  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--shards", type=int, default=4)
    args = p.parse_args()
    from test_s3 import put, s3_media  # tests/: the upload helper and the proxy's filter
    from test_storage import FaultProxy

    with tempfile.TemporaryDirectory() as tmp, LocalS3() as s3, LocalGCS() as gcs:
        ckpt = Path(tmp) / "ckpt"
        ckpt.mkdir()
        write_synthetic(ckpt, args.size_mb, args.shards)
        os.environ.update(s3.env)
        client = s3.client()
        client.create_bucket(Bucket="bench")
        gbucket = gcs.client().create_bucket("bench")
        for f in sorted(os.listdir(ckpt)):
            data = (ckpt / f).read_bytes()
            put(client, "bench", f"with/{f}", data)
            put(client, "bench", f"without/{f}", data, crc32c=False)
            gbucket.blob(f"m/{f}").upload_from_filename(str(ckpt / f))
        proxy = FaultProxy(s3.endpoint, media=s3_media).start()
        total = sum(os.path.getsize(ckpt / f) for f in os.listdir(ckpt))
        print(f"checkpoint: {total / 2**20:.0f} MiB in {args.shards} shards")
        for prefix in ("with", "without"):
            cache = str(Path(tmp) / f"cache-{prefix}")
            for run in ("cold", "restart"):
                proxy.requests.clear()
                store = Storage(Settings(s3_endpoint_url=proxy.host, cache_dir=cache))
                t = time.perf_counter()
                spec = ModelSpec.from_dir(f"s3://bench/{prefix}", storage=store)
                took = time.perf_counter() - t
                heads = sum(1 for m, _ in proxy.requests if m == "HEAD")
                shard_gets = [q for q in proxy.media_requests() if ".safetensors?" not in q
                              and q.split("?")[0].endswith(".safetensors")]
                print(f"spec {prefix} CRC32C, {run}: {took:.2f} s, {heads} HEAD, "
                      f"{len(shard_gets)} shard GETs, version {spec.version}")
        proxy.stop()
        _refusal(client, ckpt, s3.endpoint, str(Path(tmp) / "cache-big"))
        settings = Settings(cache_dir=str(Path(tmp) / "cache-dl"))
        for uri in ("s3://bench/with", f"gs://{gbucket.name}/m"):
            store = Storage(settings)
            spec = ModelSpec.from_dir(uri, storage=store)
            t, cpu = time.perf_counter(), time.process_time()
            got = sum(int(np.asarray(buf).nbytes) for _, buf in store.download_many(spec.shards))
            took, cpu = time.perf_counter() - t, time.process_time() - cpu
            print(f"download {uri.split(':')[0]}: {got / 2**20:.0f} MiB in {took:.2f} s,"
                  f" {got / took / 1e9:.2f} GB/s, client CPU {cpu:.2f} s")


def _refusal(client: object, ckpt: Path, endpoint: str, cache: str) -> None:
    """Time the refusal of an index over its bound (the checkpoint's other files as they are)."""
    import resource

    from nccl_back.errors import NcclBackError
    from nccl_back.model.safetensors_format import INDEX_NAME, MAX_INDEX_BYTES

    for f in sorted(set(os.listdir(ckpt)) - {INDEX_NAME}):
        client.put_object(Bucket="bench", Key=f"big/{f}", Body=(ckpt / f).read_bytes())  # type: ignore[attr-defined]
    client.put_object(Bucket="bench", Key=f"big/{INDEX_NAME}", Body=bytes(80 << 20))  # type: ignore[attr-defined]
    store = Storage(Settings(s3_endpoint_url=endpoint, cache_dir=cache))
    store.list_dir("s3://bench/big")  # boto3's client made first, as a worker's would be
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    try:
        ModelSpec.from_dir("s3://bench/big", storage=store)
        why = "not refused"
    except NcclBackError as e:
        why = str(e)[:120]
    took = time.perf_counter() - t
    rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    print(f"index of 80 MiB (bound {MAX_INDEX_BYTES >> 20} MiB) refused in {took:.3f} s,"
          f" peak RSS +{rise:.1f} MiB: {why}")


if __name__ == "__main__":
    main()
