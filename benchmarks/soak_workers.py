"""The worker processes of the fault-injection soak (benchmarks/soak.py).

One process per rank: a real WeightService against the soak's real Redis, a skeleton of
its pipeline stage (single-rank units hold the whole pipeline), real gloo groups for the
2-rank units (started as torchrun starts them: RANK/WORLD_SIZE/MASTER_* and ``env://``).
Each reports through a pipe: ``loaded`` (source, seconds, a SHA-256 of its tensors'
bytes) or ``error`` (typed or not, with the traceback), then after ``stop`` ``closed``
(threads and file descriptors still open beyond what it had before the service).
Nothing here injects faults (the soak does that from outside, with signals) but one a
rank must carry itself: ``garble`` in its job, every byte it forwards flipped.
"""

from __future__ import annotations

import faulthandler
import gc
import hashlib
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import contextlib

import torch  # noqa: E402

from nccl_back.config import Settings  # noqa: E402
from nccl_back.errors import NcclBackError  # noqa: E402
from nccl_back.load.service import WeightService  # noqa: E402
from nccl_back.model.identity import ModelSpec  # noqa: E402
from nccl_back.model.skeleton import build, named_tensors  # noqa: E402

from models import TinyTransformer  # noqa: E402

#: The pipeline every rollout writes: rank 0 of a 2-rank unit holds the transformer,
#: rank 1 the VAE; a single-rank unit holds both.
PIPELINE: dict[str, dict[str, Any]] = {"transformer": {"n_layers": 2, "d": 32}, "vae": {"n_layers": 1, "d": 16}}


def part_names(rank: int, world: int) -> list[str]:
    """The pipeline components a rank holds."""
    return list(PIPELINE) if world == 1 else [list(PIPELINE)[rank]]


def _factory(kwargs: dict[str, Any]) -> Any:
    return lambda: TinyTransformer(**kwargs)


def make_model(rank: int, world: int) -> dict[str, Any]:
    """The skeleton of a rank's stage (built without weight init)."""
    return {n: build(_factory(PIPELINE[n])) for n in part_names(rank, world)}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over (name, raw bytes) in sorted name order: a byte comparison, NaN-safe."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(name.encode() + b"\0")
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _described(target: str) -> str:
    """An fd's target; a TCP socket's with its ends and state (``/proc/net/tcp``): a
    leaked socket to the Redis port is a client's, one between two ephemeral ports a
    transport's."""
    inode = target.removeprefix("socket:[").removesuffix("]")
    if inode == target:
        return target
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/self/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if len(cols) > 9 and cols[9] == inode:
                    ends = [f"{int(c.split(':')[-1], 16)}" for c in cols[1:3]]
                    return f"{target} {table} port {ends[0]} -> {ends[1]} state {cols[3]}"
    return target


def _wait_for(check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _load(job: dict[str, Any], settings: Settings, svc: WeightService, group: Any, rank: int,
          world: int) -> dict[str, Any]:
    """A pipeline stage, or (``kind`` "tp") a tensor-parallel rank of the flat model in
    its ``scheme`` ("plain": every tensor whole; "megatron": fused and sharded, loaded
    with its sharding, so it may reshard from holders of other layouts)."""
    if job.get("kind") == "tp":
        import reshard_workers as rw

        import nccl_back

        spec = ModelSpec.from_dir(job["flat"], cache_dir=settings.cache_dir)
        scheme = job["scheme"]
        shapes = rw.checkpoint_shapes() if scheme == "plain" else rw.tp_shapes(world, scheme)
        model: Any = build(lambda: rw.Flat(shapes))
        sh = None if scheme == "plain" else nccl_back.sharding(
            model, spec, rw.describe(rank, world, scheme), settings)
        result = svc.load(model, spec, group=group, sharding=sh)
    else:
        model = make_model(rank, world)
        spec = ModelSpec.from_dir(job["ckpt"], cache_dir=settings.cache_dir)
        result = svc.load(model, spec, group=group)
    tensors, _ = named_tensors(model)
    return {"event": "loaded", "source": result.source, "digest": digest(tensors),
            "version": spec.version, "verified": result.verified,
            "fallback_reason": result.fallback_reason, "peer_id": result.peer_id}


def held_bytes() -> int:
    """RssAnon + RssShmem of this process (what a user sees it hold), in bytes."""
    fields: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["RssAnon"] + fields["RssShmem"]


def _socket(job: dict[str, Any]) -> Path:
    return Path(job["log"]).parent / f"sc-u{job['unit']}" / "handoff.sock"


def _sidecar(job: dict[str, Any], settings: Settings) -> Any:
    """A CPU sidecar with a hand-off socket (the real ``nccl-back serve`` object) for the
    soak's large checkpoint, started (its health port bound), not yet loaded."""
    from nccl_back.sidecar.serve import ServeOptions, Sidecar

    sock = _socket(job)
    sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return Sidecar(settings, ServeOptions(model_uri=job["big"], device=torch.device("cpu"),
                                          socket_path=str(sock), health_port=0)).start()


def _sidecar_load(job: dict[str, Any], settings: Settings, sidecar: Any, report: dict[str, Any]) -> None:
    """The sidecar's load: its memory over this process before it (RssAnon + RssShmem,
    per byte of the model), then an app's ``attach``'s bytes."""
    from nccl_back.model.checkpoint import flat_skeleton
    from nccl_back.sidecar.handoff import attach

    before = held_bytes()
    result = sidecar.load()
    spec = ModelSpec.from_dir(job["big"], cache_dir=settings.cache_dir)
    nbytes = spec.nbytes
    ratio = (held_bytes() - before) / nbytes
    app = flat_skeleton(spec)
    attach(app, str(_socket(job)), "copy", version=spec.version)
    tensors, _ = named_tensors(app)
    report.update(event="loaded", source=result.source, digest=digest(tensors), version=spec.version,
                  verified=result.verified, fallback_reason=result.fallback_reason, rss_ratio=ratio)


def cache_files(rollout: int) -> dict[str, bytes]:
    """The compile cache every cache unit of a rollout builds: the same bytes in each."""
    return {f"kernels/k{i}.bin": hashlib.sha256(f"{rollout}/{i}".encode()).digest() * (64 << i)
            for i in range(3)}


def _cache(job: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """A compile cache: fetched from a peer that published it (its installed bytes
    reported), or, on a miss, built here and published (served until stop)."""
    from nccl_back.caches import artifact_transfer as artifacts
    from nccl_back.caches.artifact_transfer import CacheKey

    key = CacheKey({"soak": str(job["rollout"]), "kind": "cache"}, "ab" * 16)
    root = Path(job["log"]).parent / f"cache-u{job['unit']}"
    got = artifacts.fetch(settings, key, str(root), engine="soak")
    if got.ok:
        files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        h = hashlib.sha256()
        for name in sorted(files):
            h.update(name.encode() + b"\0" + files[name])
        return {"event": "cached", "source": "peer", "digest": h.hexdigest(), "peer_id": got.peer}
    for name, data in cache_files(job["rollout"]).items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    what = artifacts.publish(settings, key, str(root), ["kernels"], engine="soak")
    return {"event": "cached", "source": "built", "fallback_reason": got.reason, "published": what}


def cache_digest(rollout: int) -> str:
    """What a fetched cache must hold (:func:`cache_files`, as :func:`_cache` digests it)."""
    h = hashlib.sha256()
    for name, data in sorted(cache_files(rollout).items()):
        h.update(name.encode() + b"\0" + data)
    return h.hexdigest()


def unit_main(job: dict[str, Any], out: Any, stop: Any) -> None:
    """One rank of one unit of one rollout; see the module docstring."""
    log = open(job["log"], "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    # Stacks on demand (the soak sends SIGUSR1 to a unit it declares hung) and on a
    # hang past the soak's own cutoff.
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    faulthandler.dump_traceback_later(job["hang_after"], exit=False, file=log)
    rank, world = job["rank"], job["world"]
    report: dict[str, Any] = {"unit": job["unit"], "rank": rank, "pid": os.getpid()}
    import torch.distributed as dist

    try:
        import logging

        logging.basicConfig(level=logging.INFO, stream=log,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        if world > 1:
            from datetime import timedelta

            os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(job["port"])})
            report["phase"] = "rendezvous"  # the group itself (torchrun's part, not the library's)
            dist.init_process_group("gloo", timeout=timedelta(seconds=job["group_timeout"]))
            report.pop("phase")
        # From here on a silent rank is the library's: the soak judges hangs from this on.
        out.send({"unit": job["unit"], "rank": rank, "event": "phase", "phase": "service"})
        settings = Settings(**job["settings"]).capped(**job["caps"])
        if job.get("garble"):
            from faults import garble_relay_sends

            garble_relay_sends()
        # torch's first TCPStore opens a process-wide pipe it keeps for ever (measured:
        # a second store adds none); make it now so that it is part of the baseline.
        from datetime import timedelta as _td

        dist.TCPStore("127.0.0.1", 0, 1, True, timeout=_td(seconds=5))  # dropped at once
        # What the process holds before the service exists: after close() it must hold
        # no more (the group, torch's own threads, the log are part of the baseline).
        threads0 = {t.ident for t in threading.enumerate()}
        fds0 = _fds()
        group = dist.group.WORLD if world > 1 else None
        t0 = time.monotonic()
        svc: WeightService | None = None
        sidecar: Any = None
        try:
            if job.get("kind") == "cache":
                report.update(_cache(job, settings))
            elif job.get("kind") == "sidecar":
                sidecar = _sidecar(job, settings)
                _sidecar_load(job, settings, sidecar, report)
            else:
                svc = WeightService(settings, worker_id=f"r{job['rollout']}u{job['unit']}-{rank}")
                report.update(_load(job, settings, svc, group, rank, world))
            report["seconds"] = time.monotonic() - t0
        except NcclBackError as e:
            report.update(event="error", typed=True, error=f"{type(e).__name__}: {e}",
                          seconds=time.monotonic() - t0, traceback=traceback.format_exc())
        except Exception as e:
            report.update(event="error", typed=False, error=f"{type(e).__name__}: {e}",
                          seconds=time.monotonic() - t0, traceback=traceback.format_exc())
        faulthandler.cancel_dump_traceback_later()
        out.send(report)
        while not stop.is_set() and not job.get("close_early"):  # (early: the soak's fault)
            time.sleep(0.05)
        faulthandler.dump_traceback_later(job["hang_after"], exit=False, file=log)
        if svc is not None:
            svc.close()
        if sidecar is not None:
            sidecar.close()
            sidecar = None  # its model maps the hand-off segment until it is dropped
        if job.get("kind") == "cache":
            from nccl_back.caches import artifact_transfer as artifacts

            artifacts.close_all()
        # Collect garbage while waiting: what only a reference cycle (an exception's
        # traceback, say) still holds is not a leak, just not freed yet.
        threads_ok = _wait_for(lambda: gc.collect() >= 0 and {t.ident for t in threading.enumerate()} <= threads0, 10)
        fds_ok = _wait_for(lambda: gc.collect() >= 0 and len(_fds() - fds0) == 0, 10)
        leaked_threads = [t.name for t in threading.enumerate() if t.ident not in threads0]
        leaked_fds = sorted(_fds() - fds0)
        fd_targets = []
        for fd in leaked_fds:
            with contextlib.suppress(OSError):
                fd_targets.append(_described(os.readlink(f"/proc/self/fd/{fd}")))
        out.send({"unit": job["unit"], "rank": rank, "event": "closed",
                  "leaked_threads": [] if threads_ok else leaked_threads,
                  "leaked_fds": [] if fds_ok else fd_targets})
    except BaseException as e:  # report, never leave the soak waiting
        report.update(event="error", typed=isinstance(e, NcclBackError), error=f"{type(e).__name__}: {e}",
                      traceback=traceback.format_exc())
        with contextlib.suppress(Exception):
            out.send(report)
            out.send({"unit": job["unit"], "rank": rank, "event": "closed", "skipped": True,
                      "leaked_threads": [], "leaked_fds": []})
    finally:
        faulthandler.cancel_dump_traceback_later()
        log.flush()
        # A group whose other rank was killed can block in destroy_process_group: the
        # soak has what it needs, so leave without tearing anything down.
        os._exit(0)
