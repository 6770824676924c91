"""The README's first command: a small fleet that receives its weights from peers.

``python -m nccl_back.dev.demo`` starts, on loopback: a real ``redis-server`` and the GCS
emulator holding an example checkpoint, each worker's link to it throttled
(:mod:`nccl_back.dev.throttle`) to keep a fleet's bucket-to-peer link ratio, not its
speeds (:func:`_why_this_link`). One worker loads from storage, then ``--workers``
started together load from peers (fanning out), then as many fresh workers split a
brand-new version's download. It prints one row per worker and what the fleet costs
from storage alone, and exits non-zero if any worker failed or was not verified.

``--redis-url`` and ``--model`` point it at real infrastructure instead (no Redis
started, no model written, nothing throttled, a fresh ``--namespace``). Workers are
``multiprocessing`` spawn processes, as separate machines; every process and temporary
directory is removed on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from nccl_back.config import Settings
from nccl_back.coord.registry import Registry
from nccl_back.dev import throttle
from nccl_back.dev.example import write_example_model
from nccl_back.dev.gcs_emulator import LocalGCS
from nccl_back.dev.report import format_comparison, format_new_version, format_phases, format_table
from nccl_back.dev.servers import LocalRedis
from nccl_back.errors import NcclBackError
from nccl_back.model.checkpoint import flat_skeleton
from nccl_back.model.identity import ModelSpec

PROG = "python -m nccl_back.dev.demo"

#: The fleet the demo scales down, Gbit/s: a worker's bucket link (the low end of a VM's
#: 2-10) and its peer links (a GPU VM's NIC). The demo keeps their ratio.
FLEET_BUCKET_GBIT = 2.0
FLEET_PEER_GBIT = 100.0
RATIO = FLEET_PEER_GBIT / FLEET_BUCKET_GBIT
#: What a peer load moves here, Gbit/s: worker processes on 2 shared CPUs copying and
#: checking every byte (measured; the demo prints what it measures).
HERE_PEER_GBIT = 1.0
BUCKET = "nccl-back-demo"


# -- one worker (a child process) -------------------------------------------------------


def worker_main(
    name: str, settings_json: str, spec_json: str, conn: Connection, stop: Any,
    parent_pid: int, serve_seconds: float, log_level: str, storage_host: str | None = None,
    together: Any = None, skeleton_host: str | None = None,
) -> None:
    """Build a skeleton, load (peer first), report one JSON line, serve until ``stop``.

    ``storage_host``: this worker's throttled way to the emulator; ``skeleton_host``: the
    unthrottled one for header reads (a user's model code reads no storage);
    ``together``: a barrier the round's workers pass to start as one.
    """
    # The parent handles Ctrl-C and stops us through ``stop``: no traceback per child.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if skeleton_host is not None:
        os.environ["STORAGE_EMULATOR_HOST"] = skeleton_host
    from nccl_back.load.service import WeightService
    from nccl_back.log import configure

    configure(log_level)

    try:
        settings = Settings(**json.loads(settings_json))
        spec = ModelSpec.from_json(spec_json)
        t = time.perf_counter()
        model = flat_skeleton(spec, "cpu")
        skeleton = time.perf_counter() - t
        if storage_host is not None:  # a client made from here on reads over the link
            os.environ["STORAGE_EMULATOR_HOST"] = storage_host
        with WeightService(settings, worker_id=f"{name}-{os.getpid()}") as svc:
            if together is not None:
                together.wait(serve_seconds)
            result = svc.load(model, spec)
            conn.send_bytes(json.dumps({
                **dataclasses.asdict(result), "worker": name, "worker_id": svc.worker_id,
                "gbps": result.gbps, "skeleton_seconds": skeleton,
            }).encode())
            # Serve the others until told to stop (or orphaned: never outlive the demo).
            deadline = time.monotonic() + serve_seconds
            while not stop.wait(0.2):
                if os.getppid() != parent_pid or time.monotonic() > deadline:
                    break
    except Exception as e:  # report every failure to the parent rather than die silently
        with contextlib.suppress(OSError):
            conn.send_bytes(json.dumps({
                "worker": name, "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }).encode())


# -- the orchestration (parent process) -------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from e
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"{value} is out of range 1..64")
    return value


def _positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from e
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{value} must be a positive number")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--workers", type=_positive_int, default=3,
                   help="workers that load from peers after the first one (default 3)")
    p.add_argument("--model-mb", type=_positive_float, default=24.0,
                   help="size of the example model in MiB (default 24: one download takes"
                        " about 10 s on the default link)")
    p.add_argument("--storage-dir",
                   help="where to write the example model before it is uploaded to the GCS"
                        " emulator (default: a temp dir, removed on exit)")
    link = p.add_mutually_exclusive_group()
    link.add_argument("--ratio", type=_positive_float, default=RATIO,
                      help="how many times slower each worker's link to the example model's"
                           f" storage is than the ~{HERE_PEER_GBIT:g} Gbit/s peer links run at"
                           f" here (default {RATIO:g}: a fleet's {FLEET_BUCKET_GBIT:g} Gbit/s"
                           f" bucket link against {FLEET_PEER_GBIT:g} Gbit/s peer links)")
    link.add_argument("--storage-gbit", type=_positive_float,
                      help="each worker's link to the example model's storage, in Gbit/s"
                           " (instead of --ratio)")
    p.add_argument("--phases", action="store_true",
                   help="also print where each worker's time went (skeleton, discovery,"
                        " handshake, transfer, verify, storage, hash)")
    p.add_argument("--model", metavar="PATH_OR_GS_URI",
                   help="a real checkpoint (directory or gs://bucket/prefix) instead of the example")
    p.add_argument("--redis-url", help="a real Redis instead of an embedded one")
    p.add_argument("--namespace", help="Redis key prefix (default: a fresh demo-<random>)")
    p.add_argument("--log-level", default="ERROR", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="workers' log level (default ERROR: the table shows every fallback reason)")
    p.add_argument("--timeout", type=_positive_float, default=300.0,
                   help="seconds each worker may take to load before the demo fails (default 300)")
    return p


@dataclass
class _Worker:
    name: str
    proc: Any
    conn: Connection
    link: throttle.Proxy | None
    """Its own link to the emulated bucket (None: real storage)."""
    result: dict[str, Any] = field(default_factory=dict)


class Demo:
    """The demo's processes and directories; :meth:`close` removes all of them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ctx = mp.get_context("spawn")
        self.stop = self.ctx.Event()
        self.workers: list[_Worker] = []
        self.redis: LocalRedis | None = None
        self.gcs: LocalGCS | None = None
        self.proxies: list[Any] = []
        self.cache = throttle.GetCache()
        self.unthrottled: str | None = None
        """The way to the emulator at no limit, through the links' cache (skeletons)."""
        self.tmp = tempfile.mkdtemp(prefix="nccl-back-demo-")

    def prepare(self) -> tuple[Settings, ModelSpec]:
        a = self.args
        if a.redis_url is None:
            self.redis = LocalRedis().start()
        settings = Settings(
            redis_url=a.redis_url or self.redis.url,  # type: ignore[union-attr]
            namespace=a.namespace or f"demo-{uuid.uuid4().hex[:8]}",
            cache_dir=os.path.join(self.tmp, "cache"),
            transfer_timeout=min(a.timeout, 120.0),
        )
        if a.redis_url is None:
            # Everything is on this machine: keep it on loopback. For real infrastructure
            # the defaults (this host's address) let other machines reach the workers.
            settings = settings.replace(advertise_host="127.0.0.1")
        registry = Registry(settings)
        try:
            registry.ping()
        finally:
            registry.close()
        if a.model is not None:
            return settings, ModelSpec.from_dir(a.model, cache_dir=settings.cache_dir)
        return settings, self.example(settings, a.storage_dir or os.path.join(self.tmp, "model"))

    def example(self, settings: Settings, directory: str, seed: int = 0) -> ModelSpec:
        """The example model written with ``seed``, uploaded, its bytes in the links' cache."""
        uri = self._upload_example(directory, seed)
        spec = ModelSpec.from_dir(uri, cache_dir=settings.cache_dir)
        self._warm(spec, settings)
        return spec

    def _warm(self, spec: ModelSpec, settings: Settings) -> None:
        """Read every shard once into the proxies' shared cache, unthrottled: a bucket
        serves at the link's rate, the emulator (one request at a time) would not."""
        from nccl_back.model.storage import Storage

        proxy = throttle.serve(self.gcs.host, 1000.0, cache=self.cache)  # type: ignore[union-attr]
        self.proxies.append(proxy)
        self.unthrottled = f"http://127.0.0.1:{proxy.server_address[1]}"
        os.environ["STORAGE_EMULATOR_HOST"] = self.unthrottled
        for _ in Storage(settings).download_many(spec.shards):
            pass

    def _upload_example(self, directory: str, seed: int) -> str:
        """Write the example model and put it in a bucket of the GCS emulator (started
        by the first call)."""
        print(f"writing a {self.args.model_mb:g} MiB example model to {directory} and uploading"
              " it to the GCS emulator ...", flush=True)
        local = write_example_model(directory, self.args.model_mb, seed=seed)
        if self.gcs is None:
            self.gcs = LocalGCS().start()
            self.gcs.client().create_bucket(BUCKET)
        # The client is made here: it sets STORAGE_EMULATOR_HOST to the emulator itself.
        bucket = self.gcs.client().bucket(BUCKET)
        prefix = f"example-{seed}"
        for f in sorted(local.iterdir()):
            bucket.blob(f"{prefix}/{f.name}").upload_from_filename(str(f))
        return f"gs://{BUCKET}/{prefix}"

    def link(self) -> throttle.Proxy | None:
        """A new throttled way to the emulator (one per worker: its own link), or None."""
        if self.gcs is None:
            return None
        # The uploads are done and the objects never change: the proxy may cache reads,
        # so the emulator's one-request-at-a-time server is never the limit, the link is.
        proxy = throttle.serve(self.gcs.host, self.args.storage_gbit / 8, cache=self.cache)
        self.proxies.append(proxy)
        return proxy

    def start(self, name: str, settings: Settings, spec: ModelSpec, together: Any = None) -> _Worker:
        recv, send = self.ctx.Pipe(duplex=False)
        fields = {k: getattr(settings, k) for k in settings.__dataclass_fields__}
        link = self.link()
        host = None if link is None else f"http://127.0.0.1:{link.server_address[1]}"
        proc = self.ctx.Process(
            target=worker_main, name=f"nccl-back-demo-{name}", daemon=True,
            args=(name, json.dumps(fields), json.dumps(spec.to_json()), send, self.stop,
                  os.getpid(), self.args.timeout * 2 + 60, self.args.log_level, host, together,
                  self.unthrottled if link is not None else None),
        )
        proc.start()
        send.close()
        worker = _Worker(name, proc, recv, link)
        self.workers.append(worker)
        return worker

    def wait(self, workers: Sequence[_Worker]) -> None:
        """Each worker's report, within ``--timeout`` (spawn start-up included)."""
        deadline = time.monotonic() + self.args.timeout + 30
        for w in workers:
            left = deadline - time.monotonic()
            try:
                ready = left > 0 and w.conn.poll(left)
                w.result = (json.loads(w.conn.recv_bytes()) if ready
                            else {"worker": w.name, "error": "no report within --timeout"})
            except EOFError:
                w.result = {"worker": w.name,
                            "error": f"process exited with code {w.proc.exitcode} before reporting"}

    def close(self) -> None:
        self.stop.set()
        for w in self.workers:
            w.proc.join(10)
        for w in self.workers:
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)
            w.conn.close()
        for proxy in self.proxies:
            proxy.shutdown()
            proxy.server_close()
        if self.gcs is not None:
            self.gcs.stop()
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _why_this_link(args: argparse.Namespace) -> str:
    """Why the emulated bucket link has the rate it has: the ratio it keeps, said plainly."""
    here = (f"here the peer links are this machine's {os.cpu_count()} CPUs copying and checking"
            f" bytes between processes (about {HERE_PEER_GBIT:g} Gbit/s with 2: the peer rows'"
            " GB/s below)")
    if args.ratio_given is None:
        return (f"(--storage-gbit {args.storage_gbit:g}: about 1/{HERE_PEER_GBIT / args.storage_gbit:.0f}"
                f" of the peer links, {here}; in a fleet the bucket link is 20-200x slower)")
    return (f"why {args.storage_gbit:g} Gbit/s: in a fleet a worker's link to its bucket (about"
            f" {FLEET_BUCKET_GBIT:g} Gbit/s) is some {RATIO:g}x slower than its links to peers"
            f" ({FLEET_PEER_GBIT:g} Gbit/s; 20-200x across fleets); {here}, so the bucket link"
            f" is slowed to 1/{args.ratio:g} of that: the demo keeps a fleet's ratio, not its speeds")


def run(args: argparse.Namespace) -> int:
    # The bucket link: --storage-gbit, else the peer links here slowed by --ratio.
    args.ratio_given = None if args.storage_gbit is not None else args.ratio
    if args.storage_gbit is None:
        args.storage_gbit = HERE_PEER_GBIT / args.ratio
    demo = Demo(args)
    try:
        settings, spec = demo.prepare()
        where = (f"the GCS emulator through google-cloud-storage, {args.storage_gbit:g} Gbit/s"
                 " per worker" if demo.gcs is not None else args.model)
        print(f"model {len(spec.shards)} shards, {spec.nbytes / 2**20:.0f} MiB, "
              f"version {spec.version}; storage: {where}", flush=True)
        if demo.gcs is not None:
            print(_why_this_link(args), flush=True)
        # Alone, with nobody to split the download with: its time is the plain download,
        # the baseline of both comparisons (not the download group's window on top).
        first = demo.start("worker-0", settings.replace(cooperative_download=False), spec)
        demo.wait([first])
        rest = [demo.start(f"worker-{i + 1}", settings, spec) for i in range(args.workers)]
        demo.wait(rest)
        results = [w.result for w in demo.workers]
        print(format_table(results))
        failed = _phases_and_failures(results, args.phases)
        peers = sum(r.get("source") == "peer" for r in results)
        print(f"version {spec.version}: {len(results) - len(failed)}/{len(results)} workers "
              f"ready and verified, {peers} from peers")
        comparison = format_comparison(results, args.storage_gbit if demo.gcs is not None else None)
        if comparison:
            print(comparison)
        if demo.gcs is None and (args.model is None or not args.model.startswith("gs://")):
            print("(storage here is a local directory in the page cache, faster than any bucket)")
        if args.model is None and not failed:
            failed = _new_version(demo, settings, first.result, len(demo.workers))
        return 1 if failed else 0
    finally:
        demo.close()


def _new_version(demo: Demo, settings: Settings, download: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """A brand-new version nobody holds: ``n`` fresh workers started together split its
    download; prints one row per worker; returns the failed rows."""
    spec = demo.example(settings, os.path.join(demo.tmp, "model-new"), seed=1)
    print(f"\na brand-new version {spec.version}: {n} new workers start together, nobody"
          " holds it", flush=True)
    together = demo.ctx.Barrier(n, timeout=demo.args.timeout)
    # The default download_group_window (0.2 s) is well past their start's spread.
    workers = [demo.start(f"new-{i}", settings, spec, together) for i in range(n)]
    demo.wait(workers)
    results = [{**w.result, "link_bytes": w.link.bucket.taken if w.link is not None else 0,
                "link_requests": w.link.requests if w.link is not None else 0} for w in workers]
    rate = download["bytes"] / download["seconds"] if download["seconds"] > 0 else 0.0
    print(format_new_version(results, spec.nbytes, download["seconds"], rate))
    return _phases_and_failures(results, demo.args.phases)


def _phases_and_failures(results: list[dict[str, Any]], phases: bool) -> list[dict[str, Any]]:
    """Print a round's phases (``--phases``) and its failures' tracebacks; the failed rows."""
    if phases:
        print("\nseconds per phase:")
        print(format_phases(results))
    failed = [r for r in results if "error" in r or not r["verified"]]
    for r in failed:
        if "traceback" in r:
            print(r["traceback"], file=sys.stderr)
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (e.g. from a supervisor) cleans up like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; stopped the workers and removed temporary files",
              file=sys.stderr)
        return 130
    except NcclBackError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
