"""Benchmark: the storage load from Azure (Azurite), GCS (the GCS emulator) and S3 (moto),
side by side in one run: seconds, throughput, client CPU and requests per backend.

One synthetic checkpoint of ``--size-mb`` in ``--shards`` files is uploaded to the three
local servers (to S3 with a CRC32C in each object's metadata, as a user who follows the
docs uploads; GCS computes its own; Azure keeps none). For each backend:

1. Requests, counted by a real proxy in front of its server (tests/test_storage.py's):
   a spec with a cold CRC32C cache, the same after a restart (new ``Storage``, same
   cache), and a storage load (``load_from_storage`` into a flat skeleton).
2. Time, direct to the server: the cold spec, the restart's, and the storage load
   (best of ``--repeat``, the backends interleaved so machine load hits each alike):
   seconds, GB/s and this process's CPU seconds, and each backend's ratio to GCS's.

The servers are a Node.js process (Azurite) and two Python ones on this machine: the
rates say what these emulators serve and what each client costs, not what Azure, GCS or
AWS would.

Run: ``.venv/bin/python benchmarks/storage_backends.py --size-mb 256``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from storage_load import write_synthetic  # noqa: E402

from nccl_back.config import Settings  # noqa: E402
from nccl_back.dev.azurite import ACCOUNT, LocalAzurite  # noqa: E402
from nccl_back.dev.gcs_emulator import LocalGCS  # noqa: E402
from nccl_back.dev.s3_emulator import LocalS3  # noqa: E402
from nccl_back.model.az import AzureBlobs  # noqa: E402
from nccl_back.model.checkpoint import flat_skeleton  # noqa: E402
from nccl_back.model.identity import ModelSpec  # noqa: E402
from nccl_back.model.loader import load_from_storage  # noqa: E402
from nccl_back.model.storage import Storage  # noqa: E402

BACKENDS = ("gs", "s3", "az")


class Servers:
    """The three servers, each checkpoint's URI, and a ``Storage`` reaching each one
    directly or through a counting proxy."""

    def __init__(self, gcs: LocalGCS, s3: LocalS3, az: LocalAzurite) -> None:
        self.gcs, self.s3, self.az = gcs, s3, az
        self.uri = {"gs": "gs://bench/m", "s3": "s3://bench/m", "az": "az://bench/m"}

    def upload(self, ckpt: Path) -> None:
        from test_s3 import put

        s3c = self.s3.client()
        s3c.create_bucket(Bucket="bench")
        gbucket = self.gcs.client().create_bucket("bench")
        container = self.az.client().create_container("bench")
        for f in sorted(os.listdir(ckpt)):
            data = (ckpt / f).read_bytes()
            put(s3c, "bench", f"m/{f}", data)  # with its CRC32C in the metadata
            gbucket.blob(f"m/{f}").upload_from_string(data)
            container.upload_blob(f"m/{f}", data)

    def upstream(self, kind: str) -> str:
        return {"gs": self.gcs.host, "s3": self.s3.endpoint,
                "az": f"http://127.0.0.1:{self.az.port}"}[kind]

    def storage(self, kind: str, cache: str, via: str | None = None) -> Storage:
        """A new ``Storage`` (a restart: new clients) for ``kind``, through ``via`` if given."""
        settings = Settings(cache_dir=cache, s3_endpoint_url=(via or "") if kind == "s3" else "")
        if kind == "gs":  # the google client reads it when it is made
            os.environ["STORAGE_EMULATOR_HOST"] = via or self.gcs.host
        backends: dict[str, Any] = {}
        if kind == "az":
            endpoint = f"{via}/{ACCOUNT}" if via else None
            backends["az"] = AzureBlobs(settings, env={
                "AZURE_STORAGE_CONNECTION_STRING": self.az.connection_string(endpoint)})
        return Storage(settings, backends=backends)


def _kinds(kind: str, requests: list[tuple[str, str]]) -> dict[str, int]:
    """A proxy's requests by what they asked: listings, metadata, shard bytes, other bytes."""
    from test_azure import az_media
    from test_s3 import s3_media
    from test_storage import gcs_media

    media = {"gs": gcs_media, "s3": s3_media, "az": az_media}[kind]
    out = {"list": 0, "meta": 0, "shard GET": 0, "other GET": 0}
    for method, path in requests:
        base = path.split("?")[0]
        if media(method, path):
            out["shard GET" if base.endswith(".safetensors") else "other GET"] += 1
        elif "list-type=" in path or "comp=list" in path or base.endswith("/o"):
            out["list"] += 1
        else:
            out["meta"] += 1
    return out


def _fmt(counts: dict[str, int]) -> str:
    return f"{sum(counts.values()):3d} = " + ", ".join(f"{v} {k}" for k, v in counts.items())


def count_requests(servers: Servers, tmp: Path) -> dict[str, dict[str, dict[str, int]]]:
    from test_storage import FaultProxy

    out: dict[str, dict[str, dict[str, int]]] = {}
    for kind in BACKENDS:
        proxy = FaultProxy(servers.upstream(kind)).start()
        cache = str(tmp / f"count-{kind}")
        rows: dict[str, dict[str, int]] = {}
        try:
            for step in ("spec, cold cache", "spec, restart"):
                proxy.requests.clear()
                spec = ModelSpec.from_dir(servers.uri[kind],
                                          storage=servers.storage(kind, cache, proxy.host))
                rows[step] = _kinds(kind, proxy.requests)
            store = servers.storage(kind, cache, proxy.host)
            skeleton = flat_skeleton(spec, storage=store)
            proxy.requests.clear()
            load_from_storage(skeleton, spec, storage=store)
            rows["storage load"] = _kinds(kind, proxy.requests)
        finally:
            proxy.stop()
        out[kind] = rows
    return out


def measure(fn: Callable[[], Any]) -> tuple[float, float]:
    """One run of ``fn``: (wall seconds, this process's CPU seconds)."""
    t, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmpdir, LocalGCS() as gcs, LocalS3() as s3, \
            LocalAzurite() as az:
        tmp = Path(tmpdir)
        os.environ.update(s3.env)
        ckpt = tmp / "ckpt"
        ckpt.mkdir()
        write_synthetic(ckpt, args.size_mb, args.shards)
        total = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        servers = Servers(gcs, s3, az)
        servers.upload(ckpt)
        print(f"checkpoint: {total / 2**20:.0f} MiB in {args.shards} shards; "
              f"Azurite, the GCS emulator and moto on loopback; {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.1f}")

        versions = {k: ModelSpec.from_dir(servers.uri[k], storage=servers.storage(
            k, str(tmp / f"v-{k}"))).version for k in BACKENDS}
        local = ModelSpec.from_dir(str(ckpt), cache_dir=str(tmp / "v-local")).version
        print(f"versions: local {local}, " + ", ".join(f"{k} {v}" for k, v in versions.items())
              + ("  (one version)" if set(versions.values()) == {local} else "  DIFFER"))

        print("\nrequests (counted by a proxy in front of each server):")
        for kind, rows in count_requests(servers, tmp).items():
            for step, counts in rows.items():
                print(f"  {kind}  {step:17s} {_fmt(counts)}")

        times: dict[str, dict[str, tuple[float, float]]] = {k: {} for k in BACKENDS}
        colds = {k: 0 for k in BACKENDS}

        def cold_spec(kind: str) -> None:
            colds[kind] += 1  # a fresh cache each run
            ModelSpec.from_dir(servers.uri[kind],
                               storage=servers.storage(kind, str(tmp / f"cold-{kind}-{colds[kind]}")))

        specs = {k: ModelSpec.from_dir(servers.uri[k], storage=servers.storage(k, str(tmp / f"t-{k}")))
                 for k in BACKENDS}
        def timed(kind: str) -> dict[str, tuple[float, float]]:
            cache = str(tmp / f"t-{kind}")
            store = servers.storage(kind, cache)
            skeleton = flat_skeleton(specs[kind], storage=store)
            return {
                "spec, cold cache": measure(lambda: cold_spec(kind)),
                "spec, restart": measure(lambda: ModelSpec.from_dir(
                    servers.uri[kind], storage=servers.storage(kind, cache))),
                "storage load": measure(lambda: load_from_storage(skeleton, specs[kind], storage=store)),
            }

        for _ in range(args.repeat):  # interleaved: each backend sees the same machine load
            for kind in BACKENDS:
                for step, got in timed(kind).items():
                    times[kind][step] = min(times[kind].get(step, got), got)

        print(f"\ntime (best of {args.repeat}, direct to each server; client CPU of this process):")
        for step in ("spec, cold cache", "spec, restart", "storage load"):
            for kind in BACKENDS:
                wall, cpu = times[kind][step]
                rate = f"{total / wall / 1e9:5.2f} GB/s" if step == "storage load" else " " * 10
                ratio = wall / times["gs"][step][0]
                print(f"  {step:17s} {kind}  {wall:6.2f} s  {rate}  CPU {cpu:5.2f} s"
                      f"  x{ratio:4.2f} of gs")
        load = {k: times[k]["storage load"] for k in BACKENDS}
        print("\nstorage load, az against the others: "
              f"time az/gs {load['az'][0] / load['gs'][0]:.2f}, az/s3 {load['az'][0] / load['s3'][0]:.2f};"
              f" client CPU az/gs {load['az'][1] / load['gs'][1]:.2f},"
              f" az/s3 {load['az'][1] / load['s3'][1]:.2f}")


if __name__ == "__main__":
    main()
