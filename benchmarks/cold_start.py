"""Benchmark: fleet cold start vs cluster size, behind a shared storage bandwidth limit.

For N in ``--sizes`` (default 1 2 4 8), N worker processes start at the same moment and
each loads the same checkpoint with ``WeightService.load``. Storage is the GCS emulator
(``LocalGCS``) behind ``nccl_back/dev/throttle.py``: one token bucket for the response bytes of *all*
workers (``--storage-gbps``, in GB/s = 10^9 B/s), standing in for a bucket's per-fleet
egress. Peer transfers use gloo on loopback. Three scenarios:

* ``storage``: storage only (each worker in its own Redis namespace never finds a peer);
* ``warm``: one warm peer, loaded and serving before the N workers start; its receivers
  sit in a cohort's two trees (the relay's fan-out: one cohort of up to 1,024), each
  member taking half from each of its two parents (before 7 Dec 2026 ``warm`` was a
  relay chain and ``warm_trees`` this: the log's figures say which);
* ``single_flight``: no peer; one worker is elected to download, the others receive
  from peers as they appear (a worker that received serves too: the fleet fans out).
* ``cooperative``: ``single_flight`` with ``download_group_window`` (``--group-window``):
  the workers waiting together each read one share from storage, the elected worker
  gathers and proves the parts, then streams the whole (``load/cooperative.py``); with
  ``--own-links`` each worker reaches storage through its own capped link.
* ``cooperative_kill``: ``cooperative`` with member 1 of the roster (read back from
  Redis) SIGKILLed mid-share (``--kill-at`` of its share's expected read time, one
  download / N, after it announced its endpoint): the elected worker reads that share.
* ``warm_tree`` / ``single_flight_tree``: the same without cohorts
  (``cohort_max_size=1``): every receiver takes a whole copy from a holder and serves
  once it holds the weights, the binomial tree of ⌈log2(N+1)⌉ rounds.

* ``warm_kill``: ``warm`` with one receiver SIGKILLed (``--kill-signal stop``: SIGSTOPped)
  mid-transfer (``--kill-at`` of the warm N=1 median after the release), seat 1, tree 1's
  root with half the cohort below it (seats read back from Redis): the receivers
  seated below it (``below_victim``) say what its death cost (they re-attach further
  up), the others what it did not.

Each receiver's upstream depth (hops from the holder or the downloader, from the source
its load reports) is in the rows and the table, and so is each worker's longest stall
(``stall_s``, the table's ``stall``: the longest its Python threads could not run during
the load, :class:`Stalls`).

``--link-gbps`` caps every worker's outgoing weight traffic (``max_send_gbps``), so each
worker has its own emulated link and this small machine measures the topology rather
than its CPUs. With ``--netns`` (root) every worker and warm peer runs in its own network
namespace on one bridge instead, its outgoing link shaped by ``tc`` at ``--link-gbps``
(``nccl_back/dev/netns.py``): the kernel paces the bytes, as a NIC would, and the send
cap is off. ``--max-storage-n`` bounds the storage-only sizes (linear, slow).

Workers are spawned first and released together by one Event once imports and set-up
are done, so Python start-up is not counted as cold start (``--stagger S``: worker i
starts i·S seconds after the release, a rolling start; its time counts from its own
start). ``--holders K``: K warm peers serve in the warm scenarios; ``warm_whole`` is
``warm`` with each receiver taking the whole model from one holder (``holder_parts`` 1,
the baseline of a receiver filled by several idle holders at once). Each worker records the
time from the release to "weights verified and ready" and its parts: skeleton
(``flat_skeleton``: header reads and allocation), discovery (incl. the single-flight
wait), handshake, transfer or download, verification (peer) or ground-truth hashing
(storage), and the rest (busy waits for a send slot, claims, consensus, publication).
With ``--skeleton-first`` the skeleton is built before the release instead (as an
engine builds its model from code before ``load``), so the measured time is the load.

Writes ``--out``/cold_start.{json,csv} and the plot ``--png`` (median vs N), prints a
table and the goals (PASS/MISS with the measured ratios).

Run: ``.venv/bin/python benchmarks/cold_start.py`` (defaults: 256 MiB, 0.1 GB/s)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import redis

from nccl_back.config import Settings
from nccl_back.dev import netns, throttle
from nccl_back.dev.example import write_example_model
from nccl_back.dev.gcs_emulator import LocalGCS
from nccl_back.dev.servers import LocalRedis
from nccl_back.model.identity import ModelSpec
from nccl_back.transport.relay import topology

#: ``--kill-signal``: the signal a kill scenario's victim gets, and how the goal names it.
KILL_SIGNALS = {"kill": (signal.SIGKILL, "SIGKILLed"), "stop": (signal.SIGSTOP, "SIGSTOPped")}
SCENARIOS = ("storage", "warm", "warm_whole", "warm_kill", "warm_tree",
             "single_flight", "single_flight_tree",
             "cooperative", "cooperative_kill")
BUCKET = "cold-start-bench"
PARTS = ("skeleton", "discovery", "handshake", "transfer", "download", "verify", "other")
#: The warm peers' worker names start with this (``warm``, ``warm1``, ...; their peer
#: ids start with the name).
HOLDER = "warm"


def holder_names(k: int) -> list[str]:
    """The worker names of ``k`` warm peers."""
    return [HOLDER if i == 0 else f"{HOLDER}{i}" for i in range(k)]


# -- a worker (child process) -----------------------------------------------------------


class Stalls:
    """The longest time this process's Python threads could not run while it loads: a
    daemon thread sleeps :attr:`TICK` at a time and keeps the longest gap between two
    wake-ups, and when that gap ended. Whatever a process does, a stall of its
    interpreter (the CPUs taken, or a thread in a call that holds the GIL) shows here;
    a thread that is merely waiting does not."""

    TICK = 0.005

    def __init__(self) -> None:
        self.longest, self.ended_at = 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-meter", daemon=True)

    def __enter__(self) -> Stalls:
        self._began = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.TICK):
            now = time.perf_counter()
            if now - last > self.longest:
                self.longest, self.ended_at = now - last, now - self._began
            last = now


def worker_main(
    name: str, settings_json: str, spec_json: str, storage_host: str, conn: Connection,
    go: Any, go_wall: Any, stop: Any, log_level: str, skeleton_first: bool = False,
    delay: float = 0.0, freeze_heap: bool = False, namespace: str = "",
) -> None:
    """Set up, report ready, wait for ``go``, then skeleton + load; report; serve until ``stop``.

    ``skeleton_first``: build the skeleton before reporting ready, as an engine builds its
    model from code before it calls ``load`` (then ``skeleton_s`` is 0 and the time is
    in ``prebuilt_s``). ``delay``: start this long after ``go`` (``ready_s`` counts from
    this worker's own start). ``freeze_heap``: collect, then ``gc.freeze()`` what start-up
    allocated, before reporting ready (see ``--freeze-heap``). ``namespace``: the network
    namespace this worker runs in (``--netns``), entered before any socket is opened."""
    if namespace:
        netns.enter(namespace)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent cleans up on Ctrl-C
    os.environ["STORAGE_EMULATOR_HOST"] = storage_host
    from nccl_back.log import configure

    # Every fallback reason is in the results; warnings would only interleave the table.
    configure(log_level)
    try:
        # Imports and client set-up happen before the release: not part of cold start.
        import google.cloud.storage  # noqa: F401
        import torch.distributed  # noqa: F401

        from nccl_back.load.service import WeightService
        from nccl_back.model.checkpoint import flat_skeleton

        settings = Settings(**json.loads(settings_json))
        spec = ModelSpec.from_json(spec_json)
        with WeightService(settings, worker_id=name) as svc:
            svc.registry.ping()
            prebuilt, model = 0.0, None
            if skeleton_first:
                t0 = time.perf_counter()
                model = flat_skeleton(spec, "cpu")
                prebuilt = time.perf_counter() - t0
            if freeze_heap:
                gc.collect()
                gc.freeze()
            conn.send_bytes(b'{"ready": true}')
            if not go.wait(600):
                raise TimeoutError("never released")
            time.sleep(delay)
            t0, cpu0 = time.perf_counter(), time.process_time()
            if model is None:
                model = flat_skeleton(spec, "cpu")
            skeleton = time.perf_counter() - t0
            with Stalls() as stalls:
                result = svc.load(model, spec)
            ready_wall = time.time()
            conn.send_bytes(json.dumps({
                "worker": name, "source": result.source, "peer_id": result.peer_id,
                "ready_s": ready_wall - go_wall.value - delay, "local_s": time.perf_counter() - t0,
                "skeleton_s": skeleton, "prebuilt_s": prebuilt, "load_s": result.seconds,
                # Every thread's CPU seconds from the release to ready: N processes on a
                # few cores are CPU-bound once N x cpu_s passes cores x ready_s.
                "cpu_s": time.process_time() - cpu0, "bytes": result.bytes,
                # The longest the process's threads could not run, and when it ended
                # (seconds after the load began).
                "stall_s": stalls.longest, "stall_end_s": stalls.ended_at,
                "verified": result.verified, "fallback_reason": result.fallback_reason,
                "timings": result.timings,
                # Peak resident memory so far: an extra copy of the model in a relay member
                # would show here.
                "rss_peak_mb": peak_rss_mb(),
            }).encode())
            while not stop.wait(0.2):
                pass
    except Exception as e:  # report, never leave the parent waiting
        with contextlib.suppress(OSError):
            conn.send_bytes(json.dumps({"worker": name, "error": f"{type(e).__name__}: {e}",
                                        "traceback": traceback.format_exc()}).encode())


def depths(rows: list[dict[str, Any]], holders: Sequence[str] = (HOLDER,)) -> None:
    """Set each row's ``depth``: hops from a holder or the storage reader, following the
    source its load reports (a relay member's or holder's id starts with its worker's
    name), and ``root``: the holder (worker name) or ``storage`` at the top of its path;
    both None where the source is no worker of the round nor a holder (it died)."""
    by_name = {r["worker"]: r for r in rows}
    names = sorted(by_name, key=len, reverse=True)  # the longest name that prefixes an id

    def upstream(pid: str) -> dict[str, Any] | None:
        return next((by_name[w] for w in names if pid.startswith(w + "-")), None)

    def path(r: dict[str, Any], seen: frozenset[str]) -> tuple[int, str] | None:
        if r["source"] == "storage":
            return 0, "storage"
        # Several sources (the fan-out's trees, holders' parts): the deepest path that
        # reaches a root (in the trees a source's own sources may lead back through this
        # one: the other tree; that path is skipped).
        found = [p for pid in (r.get("peer_id") or "").split(",") if (p := via(pid, r, seen))]
        return max(found) if found else None

    def via(pid: str, r: dict[str, Any], seen: frozenset[str]) -> tuple[int, str] | None:
        up = upstream(pid)
        if up is None:
            return next(((1, h) for h in holders if pid.startswith(h + "-r")), None)
        if up["worker"] in seen:
            return None
        p = path(up, seen | {r["worker"]})
        return None if p is None else (p[0] + 1, p[1])

    for r in rows:
        p = path(r, frozenset())
        r["depth"], r["root"] = (None, None) if p is None else p


def tree_depths(rows: list[dict[str, Any]], seated: dict[str, tuple[str, int]]) -> None:
    """In the fan-out's trees a receiver's sources lead back through it in the other
    tree, so :func:`depths` cannot follow them: each row's ``depth`` is its seat's hops
    from the cohort's source in the deeper of its two trees, in the cohort as it formed."""
    sizes: dict[str, int] = {}
    for chain, _ in seated.values():
        sizes[chain] = sizes.get(chain, 0) + 1
    for r in rows:
        if r["worker"] in seated:
            chain, p = seated[r["worker"]]
            size = max(sizes[chain], p + 1)
            r["depth"] = max(len(topology.seat_upstreams(p, size, t)) for t in range(topology.TREES))


def seats(redis_url: str, namespace: str, workers: Sequence[str]) -> dict[str, tuple[str, int]]:
    """Each worker's relay seat in the round's namespace, ``(chain key, position)``, read
    back from the cohort chains (lists of member records, alive for the join's TTL); a
    member id starts with its worker's name."""
    import redis

    client = redis.Redis.from_url(redis_url)
    names = sorted(workers, key=len, reverse=True)  # the longest name that prefixes an id
    out: dict[str, tuple[str, int]] = {}
    try:
        for key in client.scan_iter(match=f"*{namespace}*cohort*", _type="list"):
            for pos, raw in enumerate(client.lrange(key, 0, -1)):
                try:
                    member_id = str(json.loads(raw).get("member_id", ""))
                except (ValueError, AttributeError):
                    continue
                worker = next((w for w in names if member_id.startswith(w + "-")), None)
                if worker is not None:
                    out.setdefault(worker, (key.decode(), pos))
    finally:
        client.close()
    return out


def parts(row: dict[str, Any]) -> dict[str, float]:
    """A worker's ready time split into :data:`PARTS` (seconds)."""
    t = row["timings"]
    p = {
        "skeleton": row["skeleton_s"],
        "discovery": t.get("discovery", 0.0),
        # A load filled by several holders at once: its parts ran side by side.
        "handshake": _longest(t, "handshake") if row["source"] == "peer" else 0.0,
        "transfer": _longest(t, "transfer") if row["source"] == "peer" else 0.0,
        "download": t.get("storage", 0.0),
        "verify": t.get("verify", 0.0) + t.get("hash", 0.0),
    }
    p["other"] = max(0.0, row["load_s"] - sum(v for k, v in p.items() if k != "skeleton"))
    return p


def _longest(timings: dict[str, float], what: str) -> float:
    """The longest of ``what`` and its parts' ``what.p{i}`` timings."""
    return max((v for k, v in timings.items() if k == what or k.startswith(what + ".p")), default=0.0)


# -- the rounds (parent) ----------------------------------------------------------------


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB (``VmHWM``). Not ``ru_maxrss``: exec
    keeps the parent's high-water mark in it, and the parent here caches the bucket's
    bytes (the proxies), so a later round's worker would seem to hold more."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Bench:
    """Servers, the checkpoint and the spawn context; :meth:`close` removes everything."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ctx = mp.get_context("spawn")
        self.tmp = tempfile.mkdtemp(prefix="nccl-back-cold-start-")
        self.shaped = netns.Links(args.link_gbps).start() if args.netns else None
        """With ``--netns``: the bridge and a namespace per worker, links shaped by tc."""
        self.host = netns.HOST if args.netns else "127.0.0.1"
        """Where the workers reach Redis and the storage proxies."""
        self.redis = LocalRedis(extra=["--bind", "127.0.0.1", netns.HOST] if args.netns else []).start()
        self.gcs = LocalGCS().start()
        self.source: Any = None
        """The warm peers' storage: the emulator, through an uncapped proxy on the bridge."""
        self.proxy: Any = None
        self.links: list[Any] = []
        """With ``--own-links``: one capped proxy per worker (its own link to the bucket)."""
        self.procs: list[Any] = []
        self.kill_after = 1.0
        """Seconds after the release at which ``warm_kill`` kills its victim."""

    def prepare(self) -> ModelSpec:
        """Write the model, upload it, start the throttle; returns the checkpoint's spec."""
        local = write_example_model(Path(self.tmp) / "model", self.args.model_mb,
                                    shards=self.args.shards)
        bucket = self.gcs.client().create_bucket(BUCKET)  # sets STORAGE_EMULATOR_HOST
        for f in sorted(local.iterdir()):
            bucket.blob(f"model/{f.name}").upload_from_filename(str(f))
        shutil.rmtree(local)
        spec = ModelSpec.from_dir(f"gs://{BUCKET}/model")
        # Uploads are done: the objects are immutable from here on, so the proxy may cache.
        self.proxy = throttle.serve(self.gcs.host, self.args.storage_gbps, host=self.host, cache=True)
        self.source = throttle.serve(self.gcs.host, 1000.0, host=self.host, cache=True)
        if self.args.own_links:
            cache = throttle.GetCache()
            self.links = [throttle.serve(self.gcs.host, self.args.storage_gbps, host=self.host,
                                         cache=cache)
                          for _ in range(max(self.args.sizes))]
        return spec

    def storage_host(self, i: int) -> str:
        """Where worker ``i`` reaches the bucket: its own link, or the shared one."""
        proxy = self.links[i] if self.links else self.proxy
        return f"http://{self.host}:{proxy.server_address[1]}"

    @property
    def proxy_host(self) -> str:
        return f"http://{self.host}:{self.proxy.server_address[1]}"

    def settings(self, namespace: str, scenario: str = "warm") -> str:
        s = Settings(redis_url=self.redis.url.replace("127.0.0.1", self.host), namespace=namespace,
                     transport="gloo", advertise_host=self.host,
                     cache_dir=os.path.join(self.tmp, "cache"),
                     # Shaped links (--netns) cap each worker's egress in the kernel instead.
                     max_send_gbps=0.0 if self.args.netns else self.args.link_gbps,
                     cohort_max_size=1 if scenario.endswith("_tree") else self.args.cohort_max_size,
                     bucket_bytes=self.args.bucket_bytes,
                     holder_parts=1 if scenario == "warm_whole" else Settings().holder_parts,
                     # A download group's window is a tenth of the cohort's.
                     cooperative_download=scenario.startswith("cooperative"),
                     cohort_window=(self.args.group_window * 10 if scenario.startswith("cooperative")
                                    else Settings().cohort_window))
        return json.dumps({k: getattr(s, k) for k in s.__dataclass_fields__})

    def spawn(self, name: str, settings: str, spec: ModelSpec, storage_host: str,
              go: Any, go_wall: Any, stop: Any, delay: float = 0.0) -> Connection:
        recv, send = self.ctx.Pipe(duplex=False)
        namespace = ""
        if self.shaped is not None:  # its own namespace and address
            namespace, address = self.shaped.add()
            settings = json.dumps({**json.loads(settings), "advertise_host": address})
        proc = self.ctx.Process(target=worker_main, daemon=True, name=name,
                                args=(name, settings, json.dumps(spec.to_json()), storage_host,
                                      send, go, go_wall, stop, self.args.log_level,
                                      self.args.skeleton_first, delay, self.args.freeze_heap,
                                      namespace))
        proc.start()
        send.close()
        self.procs.append(proc)
        return recv

    def round(self, scenario: str, n: int, spec: ModelSpec) -> list[dict[str, Any]]:
        """One round: spawn, release N workers together, collect their reports, stop all."""
        ns = f"cs-{scenario}-{n}-{uuid.uuid4().hex[:6]}"
        go, stop = self.ctx.Event(), self.ctx.Event()
        go_wall = self.ctx.Value("d", 0.0)
        deadline = time.monotonic() + self.args.timeout
        try:
            if scenario.startswith("warm"):
                # The warm peers load unthrottled, one after the other (the first from
                # storage, the others from it): only the N workers' cold start counts.
                for name in holder_names(self.args.holders):
                    warm_go, warm_wall = self.ctx.Event(), self.ctx.Value("d", time.time())
                    warm_go.set()
                    conn = self.spawn(name, self.settings(ns, scenario),
                                      spec, f"http://{self.host}:{self.source.server_address[1]}",
                                      warm_go, warm_wall, stop)
                    for msg in _collect([conn], 2, deadline):
                        if "error" in msg:
                            raise RuntimeError(f"warm peer {name} failed: {msg['error']}\n"
                                               f"{msg.get('traceback', '')}")
            conns = [
                self.spawn(f"{scenario}-{n}-w{i}",
                           self.settings(f"{ns}-{i}" if scenario == "storage" else ns, scenario),
                           spec, self.storage_host(i), go, go_wall, stop, delay=i * self.args.stagger)
                for i in range(n)
            ]
            for msg in _collect(conns, 1, deadline):
                if "error" in msg:
                    raise RuntimeError(f"{msg['worker']} failed: {msg['error']}")
            taken, commands = self.taken(), self.redis_commands()
            go_wall.value = time.time()
            go.set()
            victim = None
            if scenario == "cooperative_kill" and n > 1:
                victim, killed_running = self.kill_member(ns, n, spec, deadline)
            if scenario == "warm_kill" and n > 1:
                time.sleep(self.kill_after)
                # Seat 1, tree 1's root, with half the cohort below it (by index if the
                # seats cannot be read).
                names = [f"{scenario}-{n}-w{i}" for i in range(n)]
                seated = seats(self.redis.url, ns, names)
                first = min((c for c, _ in seated.values()), default=None)
                at = {p: w for w, (c, p) in seated.items() if c == first}
                victim = names.index(at.get(1, names[1]))
                proc = self.procs[-n + victim]
                killed_running = proc.is_alive()
                # SIGSTOP: silent, as a partition or a hung host looks (reaped by SIGKILL).
                os.kill(proc.pid, KILL_SIGNALS[self.args.kill_signal][0])
            rows = _collect([c for i, c in enumerate(conns) if i != victim], 1, deadline)
            # Everything the round's workers read from the bucket, a killed one's too.
            read = self.taken() - taken
            commands = self.redis_commands() - commands
        finally:
            stop.set()
            self._reap()
        for r in rows:
            if "error" in r:
                raise RuntimeError(f"{r['worker']} failed: {r['error']}\n{r.get('traceback', '')}")
            r.update(scenario=scenario, n=n, storage_x=read / spec.nbytes, redis_commands=commands,
                     **{f"{k}_s": v for k, v in parts(r).items()})
        depths(rows, holder_names(self.args.holders))
        tree_depths(rows, seats(self.redis.url, ns, [r["worker"] for r in rows]))
        if victim is not None and scenario == "cooperative_kill":
            for r in rows:
                r.update(victim=f"{scenario}-{n}-w{victim}", victim_killed_while_loading=killed_running)
        elif victim is not None:
            name = f"{scenario}-{n}-w{victim}"
            seated = seats(self.redis.url, ns, [r["worker"] for r in rows] + [name])
            where = seated.get(name)
            for r in rows:
                r["victim"] = name
                r["victim_killed_while_loading"] = killed_running
                r["victim_signal"] = KILL_SIGNALS[self.args.kill_signal][1]
                seat = seated.get(r["worker"])
                # Below the victim in a tree: what its death can delay.
                r["below_victim"] = (where is not None and seat is not None and seat[0] == where[0]
                                     and any(where[1] in topology.seat_upstreams(seat[1], n, t)
                                             for t in range(topology.TREES)))
        return rows

    def taken(self) -> int:
        """Response bytes the bucket's links have sent so far, all workers together."""
        return sum(p.bucket.taken for p in [self.proxy, *self.links])

    def redis_commands(self) -> int:
        """Commands the coordinating Redis has run so far (every worker's, the benchmark's
        own few reads too): one Redis serves the whole fleet, so its load is a cost of N."""
        with contextlib.closing(redis.Redis.from_url(self.redis.url)) as r:
            return int(r.info("stats")["total_commands_processed"])

    def kill_member(self, ns: str, n: int, spec: ModelSpec, deadline: float) -> tuple[int, bool]:
        """``cooperative_kill``: once the elected worker's roster is in Redis and member 1
        announced its endpoint, wait ``kill_after`` / N (into its share read), SIGKILL it;
        returns its index and whether it was still loading."""
        from nccl_back.coord.registry import Registry

        registry = Registry(Settings(redis_url=self.redis.url, namespace=ns))
        names = [f"cooperative_kill-{n}-w{i}" for i in range(n)]
        try:
            while (roster := registry.download_roster(spec.version, 1)) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("cooperative_kill: no roster was named")
                time.sleep(0.01)
            while registry.download_member(spec.version, 0, 1, 1) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("cooperative_kill: member 1 announced no endpoint")
                time.sleep(0.01)
        finally:
            registry.close()
        if len(roster.members) < 2:
            raise RuntimeError(f"cooperative_kill: the roster names one worker: {roster.members}")
        time.sleep(self.kill_after / n)
        victim = names.index(roster.members[1])
        proc = self.procs[-n + victim]
        running = proc.is_alive()
        proc.kill()
        return victim, running

    def _reap(self) -> None:
        for p in self.procs:
            p.join(15)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        self.procs.clear()

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        self._reap()
        for proxy in (self.proxy, self.source, *self.links):
            if proxy is not None:
                proxy.shutdown()
        self.gcs.stop()
        self.redis.stop()
        if self.shaped is not None:
            self.shaped.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _collect(conns: Sequence[Connection], per_conn: int, deadline: float) -> list[dict[str, Any]]:
    """``per_conn`` messages from each connection (a worker's error ends its stream)."""
    want = dict.fromkeys(conns, per_conn)
    out: list[dict[str, Any]] = []
    while any(want.values()):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{sum(want.values())} report(s) missing at the round's deadline")
        for c in wait([c for c, k in want.items() if k], left):
            try:
                msg = json.loads(c.recv_bytes())  # type: ignore[union-attr]
            except EOFError:
                msg = {"worker": "?", "error": "worker exited before reporting"}
            want[c] = 0 if "error" in msg else want[c] - 1  # type: ignore[index]
            out.append(msg)
    return out


# -- summary, goals, outputs ------------------------------------------------------------


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for scenario in SCENARIOS:
        for n in sorted({r["n"] for r in rows if r["scenario"] == scenario}):
            rs = [r for r in rows if r["scenario"] == scenario and r["n"] == n]
            ready = [r["ready_s"] for r in rs]
            sources = {s: sum(r["source"] == s for r in rs) for s in ("storage", "peer")}
            out.append({
                "scenario": scenario, "n": n, "workers": len(rs),
                "rounds": len({r["repeat"] for r in rs}),
                "median_s": statistics.median(ready), "min_s": min(ready), "max_s": max(ready),
                # Without each worker's own skeleton build, which N processes on a few
                # CPUs slow down for each other (a fleet of machines does not share it).
                "median_after_skeleton_s": statistics.median(r["ready_s"] - r["skeleton_s"] for r in rs),
                **{f"median_{p}_s": statistics.median(r[f"{p}_s"] for r in rs) for p in PARTS},
                # The fleet's CPU seconds over the load against what the cores offer in the
                # median's time: near 1, the CPUs, not the links, set the time.
                "median_cpu_s": statistics.median(r.get("cpu_s", 0.0) for r in rs),
                "median_stall_s": statistics.median(r.get("stall_s", 0.0) for r in rs),
                "median_rss_peak_mb": statistics.median(r.get("rss_peak_mb", 0.0) for r in rs),
                "max_rss_peak_mb": max(r.get("rss_peak_mb", 0.0) for r in rs),
                "cpu_x_cores": sum(r.get("cpu_s", 0.0) for r in rs)
                / len({r["repeat"] for r in rs}) / ((os.cpu_count() or 1) * statistics.median(ready)),
                "from_storage": sources["storage"], "from_peer": sources["peer"],
                "max_depth": max((r["depth"] for r in rs if r.get("depth") is not None), default=None),
                # Which holder (or the storage reader) each receiver's path starts at.
                "roots": {str(k): sum(r.get("root") == k for r in rs)
                          for k in sorted({r.get("root") for r in rs}, key=str)},
                "victim_killed_while_loading": any(r.get("victim_killed_while_loading") for r in rs),
                "victim_signal": next((r["victim_signal"] for r in rs if "victim_signal" in r), None),
                # What the bucket sent per round, over the checkpoint's size (the worst round).
                "storage_x": max(r["storage_x"] for r in rs),
                # The round's Redis commands per worker (the worst round).
                "redis_commands_per_worker": max(r.get("redis_commands", 0) for r in rs) / n,
                "below_victim": sum(bool(r.get("below_victim")) for r in rs),
                "below_victim_max_s": max((r["ready_s"] for r in rs if r.get("below_victim")),
                                          default=None),
                "others_max_s": max((r["ready_s"] for r in rs if not r.get("below_victim")),
                                    default=None),
            })
    return out


def goals(summary: list[dict[str, Any]], holders: int = 1, model_bytes: int = 1,
          probe_bytes: int = 0) -> list[dict[str, Any]]:
    med = {(s["scenario"], s["n"]): s["median_s"] for s in summary}
    ns = sorted({n for _, n in med})
    lo, hi = ns[0], ns[-1]
    out = []
    # The relay's goals (N=1 is the baseline of each scenario, in the same run).
    for scenario, n, bound in (("warm", 8, 1.3), ("warm", 16, 1.5), ("single_flight", 8, 1.15)):
        if (scenario, 1) in med and (scenario, n) in med:
            ratio = med[scenario, n] / med[scenario, 1]
            out.append({"goal": f"{scenario}: median at N={n} <= {bound} x N=1",
                        "ratio": ratio, "pass": ratio <= bound})
            net = {s["n"]: s["median_after_skeleton_s"] for s in summary if s["scenario"] == scenario}
            out.append({"goal": f"{scenario}, skeleton build excluded: N={n} <= {bound} x N=1",
                        "ratio": net[n] / net[1], "pass": net[n] / net[1] <= bound})
    for fan in ("warm",):
        warm_ns = [n for n in ns if (fan, n) in med]
        base = med.get((fan, 1))
        if len(warm_ns) < 2 or warm_ns[-1] < 32 or base is None:
            continue
        big = next(s for s in summary if s["scenario"] == fan and s["n"] == warm_ns[-1])
        who = "one holder" if holders == 1 else f"{holders} holders"
        out.append({"goal": f"{fan}, {who}: N={big['n']} median <= 1.2 x warm N=1, slowest <= 1.35 x,"
                            " storage reads 0",
                    "ratio": big["median_s"] / base, "slowest_ratio": big["max_s"] / base,
                    "max_depth": big["max_depth"],
                    "pass": (big["median_s"] <= 1.2 * base and big["max_s"] <= 1.35 * base
                             and big["from_storage"] == 0)})
    for n in ns:
        if ("warm", n) in med and ("warm_whole", n) in med:
            ratio = med["warm", n] / med["warm_whole", n]
            out.append({"goal": f"warm, {holders} holders, N={n}: receivers filled by idle holders"
                                " at once / each from one holder (information)",
                        "ratio": ratio, "pass": True})
    for scenario in ("warm_kill",):
        kill = [s for s in summary if s["scenario"] == scenario and s["n"] > 1]
        if not kill or ("warm", 1) not in med:
            continue
        k = kill[-1]
        bound = (med["warm", 1] + Settings().stall_timeout) * 1.2
        alive = "" if k["victim_killed_while_loading"] else " (the victim had finished: not a test)"
        below = k["below_victim_max_s"]
        how = k["victim_signal"]
        out.append({"goal": f"{k['scenario']}: N={k['n']}, one receiver {how} mid-transfer{alive}: slowest"
                            f" of the {k['below_victim']} seated below it / warm N=1 <="
                            f" {bound / med['warm', 1]:.2f} ((N=1 + stall bound) x 1.2)",
                    "ratio": None if below is None else below / med["warm", 1],
                    "others_ratio": None if k["others_max_s"] is None else k["others_max_s"] / med["warm", 1],
                    "pass": below is not None and below <= bound and k["victim_killed_while_loading"]})
    for n, bound in ((4, 0.35), (8, 0.2), (16, 0.12)):
        if ("cooperative", n) in med and ("single_flight", 1) in med:
            ratio = med["cooperative", n] / med["single_flight", 1]
            out.append({"goal": f"cooperative: median at N={n} <= {bound} x one download"
                                " (single_flight N=1)", "ratio": ratio, "pass": ratio <= bound})
    for k in (s for s in summary if s["scenario"] == "cooperative_kill" and s["n"] > 1):
        if ("cooperative", k["n"]) in med:
            ratio = k["max_s"] / med["cooperative", k["n"]]
            alive = "" if k["victim_killed_while_loading"] else " (the victim had finished: not a test)"
            out.append({"goal": f"cooperative_kill: N={k['n']}, member 1 SIGKILLed mid-share{alive}:"
                                " slowest survivor <= 1.5 x the fault-free median, storage <= 1.25 x",
                        "ratio": ratio, "storage_x": k["storage_x"],
                        "pass": ratio <= 1.5 and k["storage_x"] <= 1.25 and k["victim_killed_while_loading"]})
    for n in ns:
        if ("cooperative", n) in med:
            c = next(s for s in summary if s["scenario"] == "cooperative" and s["n"] == n)
            # Each worker's load reads each file's header probe, the elected worker's twice
            # (HEADER_PROBE_BYTES per file: 1% of a 64 MiB file, nothing at real sizes).
            probes = (n + 1) * probe_bytes / model_bytes
            out.append({"goal": f"cooperative: storage read at N={n} <= 1.01 x (the checkpoint + {n + 1}"
                                " header probes per file)",
                        "ratio": c["storage_x"], "probes_x": probes,
                        "pass": c["storage_x"] <= 1.01 * (1 + probes)})
    for scenario in ("warm_tree", "single_flight_tree"):
        if (scenario, lo) in med and (scenario, hi) in med:
            out.append({"goal": f"{scenario} (old design, for comparison): N={hi} / N={lo}",
                        "ratio": med[scenario, hi] / med[scenario, lo], "pass": True})
    storage = [(n, med["storage", n]) for n in ns if ("storage", n) in med]
    if len(storage) >= 2:
        ratio = storage[-1][1] / storage[0][1]
        ideal = storage[-1][0] / storage[0][0]
        fit = statistics.linear_regression([n for n, _ in storage], [m for _, m in storage])
        r2 = statistics.correlation([n for n, _ in storage], [m for _, m in storage]) ** 2
        out.append({"goal": f"storage: roughly linear in N (N={storage[-1][0]}/N={storage[0][0]}"
                            f" within 0.6..1.4 x {ideal:g}, R^2 >= 0.9)",
                    "ratio": ratio, "slope_s_per_worker": fit.slope, "r2": r2,
                    "pass": 0.6 * ideal <= ratio <= 1.4 * ideal and r2 >= 0.9})
    if ("warm", 1) in med and ("storage", 1) in med:
        speedup = med["storage", 1] / med["warm", 1]
        out.append({"goal": "warm peer at N=1 >= 5x faster than storage-only at N=1",
                    "ratio": speedup, "pass": speedup >= 5})
    return out


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "python": platform.python_version()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
        info["ram_gib"] = round(kb / 2**20, 1)
    import torch

    info["torch"] = torch.__version__
    return info


def print_table(summary: list[dict[str, Any]]) -> None:
    cols = ["scenario", "N", "median", "min", "max", *PARTS, "depth", "redis/worker", "stall",
            "rss MB", "sources"]
    lines = []
    for s in summary:
        src = " + ".join(f"{s[f'from_{k}']} {k}" for k in ("storage", "peer") if s[f"from_{k}"])
        lines.append([s["scenario"], str(s["n"]), *(f"{s[k]:.2f}" for k in ("median_s", "min_s", "max_s")),
                      *(f"{s[f'median_{p}_s']:.2f}" for p in PARTS),
                      "-" if s["max_depth"] is None else str(s["max_depth"]),
                      f"{s['redis_commands_per_worker']:.0f}", f"{s['median_stall_s']:.2f}",
                      f"{s['median_rss_peak_mb']:.0f}", src])
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols)]
    print("ready time after release, seconds (medians over all workers of all rounds; parts too)")
    for row in [cols, *lines]:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))


def plot(summary: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    labels = {"storage": "storage only", "warm": "one warm peer, the fan-out's two trees",
              "warm_whole": "warm peers, each receiver's model from one",
              "warm_kill": "one warm peer, a receiver killed mid-transfer",
              "warm_tree": "one warm peer, binomial tree (old)",
              "single_flight": "single flight, streamed into the trees",
              "single_flight_tree": "single flight, binomial tree (old)",
              "cooperative": "cooperative first download",
              "cooperative_kill": "cooperative, member 1 killed mid-share"}
    for scenario in SCENARIOS:
        pts = [s for s in summary if s["scenario"] == scenario]
        if not pts:
            continue
        ns = [s["n"] for s in pts]
        (line,) = ax.plot(ns, [s["median_s"] for s in pts], marker="o", label=labels[scenario])
        ax.fill_between(ns, [s["min_s"] for s in pts], [s["max_s"] for s in pts],
                        color=line.get_color(), alpha=0.15)
    ax.set_xscale("log", base=2)
    all_n = sorted({s["n"] for s in summary})
    ax.set_xticks(all_n, [str(n) for n in all_n])
    ax.set_xlabel("workers starting together (N)")
    ax.set_ylabel("cold start to verified weights (s)\nmedian; band: fastest-slowest")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model-mb", type=float, default=256.0, help="checkpoint size in MiB")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--storage-gbps", type=float, default=0.1,
                   help="storage bandwidth shared by all workers, GB/s (10^9 B/s)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="per-worker send cap, GB/s (max_send_gbps; 0: unlimited)")
    p.add_argument("--max-storage-n", type=int, default=1 << 30,
                   help="storage-only scenario only up to this N (it is linear and slow)")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS,
                   default=[s for s in SCENARIOS if s not in ("warm_whole", "cooperative")])
    p.add_argument("--repeat", type=int, default=2,
                   help="rounds per (scenario, N); medians are over all their workers")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per round")
    p.add_argument("--log-level", default="ERROR", help="workers' log level (default ERROR)")
    p.add_argument("--skeleton-first", action="store_true",
                   help="workers build their skeleton before the release, as an engine builds"
                        " its model before load(): N processes on a few CPUs then do not slow"
                        " each other's builds inside the measured time")
    p.add_argument("--freeze-heap", action="store_true",
                   help="workers gc.freeze() their start-up heap before the release, as a"
                        " server does once started: a full collection of it (~70 ms of CPU"
                        " holding the GIL with torch imported) otherwise freezes a worker for"
                        " seconds when 33 processes share 2 CPUs")
    p.add_argument("--stagger", type=float, default=0.0,
                   help="worker i starts i x this many seconds after the release (a rolling"
                        " start; each worker's time counts from its own start). 0: together")
    p.add_argument("--holders", type=int, default=1,
                   help="warm scenarios: warm peers serving before the N workers start")
    p.add_argument("--kill-at", type=float, default=0.4,
                   help="warm_kill: kill its victim this fraction of the warm N=1 median after the"
                        " release (warm runs first); cooperative_kill: this fraction of the"
                        " single_flight N=1 median / N after the roster appeared")
    p.add_argument("--kill-signal", choices=tuple(KILL_SIGNALS), default="kill",
                   help="warm_kill: SIGKILL the victim (a crash: its links reset)"
                        " or SIGSTOP it (silent, as a partition looks: found by a stall bound)")
    p.add_argument("--cohort-max-size", type=int, default=Settings().cohort_max_size,
                   help="most receivers in one cohort (0: the library's 1,024)")
    p.add_argument("--bucket-bytes", type=int, default=Settings().bucket_bytes,
                   help="the step (0: automatic, from the model's size): a relay hop costs one step")
    p.add_argument("--own-links", action="store_true",
                   help="each worker reaches storage through its own link capped at --storage-gbps"
                        " (a worker's own connection to the bucket), not one shared link")
    p.add_argument("--group-window", type=float, default=Settings().download_group_window,
                   help="cooperative: download_group_window, seconds the elected worker waits"
                        " for the others before naming the members (sets cohort_window to 10x it)")
    p.add_argument("--netns", action="store_true",
                   help="each worker in its own network namespace, its outgoing link shaped by tc"
                        " at --link-gbps (instead of the send cap); needs root, ip and tc")
    p.add_argument("--out", default="benchmarks/out", help="directory for the JSON and CSV")
    p.add_argument("--png", default="benchmarks/cold_start.png")
    args = p.parse_args()
    if (args.model_mb <= 0 or args.storage_gbps <= 0 or min(args.sizes) < 1 or args.repeat < 1
            or args.holders < 1 or args.stagger < 0):
        p.error("--model-mb, --storage-gbps, --sizes, --repeat and --holders must be positive,"
                " --stagger not negative")
    if args.netns and (why := netns.unavailable()) is not None:
        p.error(f"--netns: {why}; run as root, or leave --netns out (the send cap stands in)")
    if args.netns and args.link_gbps <= 0:
        p.error(f"--link-gbps={args.link_gbps}: --netns shapes each link at this rate; give it > 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    # Other work on the machine skews every figure: record the load around the run.
    load_before, started = list(os.getloadavg()), time.perf_counter()
    bench = Bench(args)
    rows: list[dict[str, Any]] = []
    reach = "per worker (own links)" if args.own_links else "shared"
    try:
        spec = bench.prepare()
        print(f"model {spec.nbytes / 2**20:.0f} MiB in {len(spec.shards)} shards, storage limit "
              f"{args.storage_gbps:g} GB/s {reach}, {os.cpu_count()} CPUs, load average "
              f"{load_before[0]:.1f}", flush=True)
        # Repeats go round all rounds again, so slow drifts of the machine's load are
        # spread over every scenario rather than landing on one.
        for rep in range(args.repeat):
            for scenario in args.scenarios:
                for n in sorted(args.sizes):
                    if scenario == "storage" and n > args.max_storage_n:
                        continue
                    t = time.perf_counter()
                    base = "single_flight" if scenario == "cooperative_kill" else "warm"
                    once = [r["ready_s"] for r in rows if r["scenario"] == base and r["n"] == 1]
                    if once:
                        bench.kill_after = args.kill_at * statistics.median(once)
                    got = bench.round(scenario, n, spec)
                    for r in got:
                        r["repeat"] = rep
                    rows += got
                    print(f"  [{rep + 1}/{args.repeat}] {scenario:<13} N={n}: median "
                          f"{statistics.median(r['ready_s'] for r in got):6.2f} s"
                          f"  (round {time.perf_counter() - t:.0f} s)", flush=True)
    finally:
        bench.close()

    summary = summarise(rows)
    from nccl_back.model.checkpoint import HEADER_PROBE_BYTES

    verdicts = goals(summary, args.holders, spec.nbytes,
                     sum(min(sh.size, HEADER_PROBE_BYTES) for sh in spec.shards))
    print()
    print_table(summary)
    print()
    for g in verdicts:
        extra = f", slope {g['slope_s_per_worker']:.2f} s/worker, R^2 {g['r2']:.3f}" if "r2" in g else ""
        if "slowest_ratio" in g:
            extra = f", slowest {g['slowest_ratio']:.2f}, deepest receiver {g['max_depth']} hops"
        if g.get("others_ratio") is not None:
            extra = f"; every other survivor's slowest {g['others_ratio']:.2f}"
        if "storage_x" in g:
            extra = f", storage {g['storage_x']:.2f} x the checkpoint"
        if "probes_x" in g:
            extra = f" (the header probes alone: {g['probes_x']:.3f} x)"
        measured = "-" if g["ratio"] is None else f"{g['ratio']:.2f}"
        print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: measured {measured}{extra}")
    for s in summary:
        if s["scenario"].startswith("warm") and args.holders > 1:
            print(f"{s['scenario']} N={s['n']}: receivers per holder {s['roots']}")

    os.makedirs(args.out, exist_ok=True)
    meta = {"model_bytes": spec.nbytes, "shards": len(spec.shards),
            "skeleton_first": args.skeleton_first, "freeze_heap": args.freeze_heap,
            "storage_gbps": args.storage_gbps, "own_links": args.own_links, "link_gbps": args.link_gbps,
            "netns": args.netns,
            "holders": args.holders, "stagger_s": args.stagger,
            "sizes": sorted(args.sizes), "repeat": args.repeat,
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
            "loadavg_before": load_before, "loadavg_after": list(os.getloadavg()),
            "seconds": time.perf_counter() - started}
    with open(os.path.join(args.out, "cold_start.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "goals": verdicts, "workers": rows}, f, indent=1)
    fields = ["scenario", "n", "repeat", "worker", "source", "peer_id", "depth", "root", "ready_s", *(f"{p}_s" for p in PARTS),
              "load_s", "bytes", "verified", "fallback_reason", "below_victim"]
    with open(os.path.join(args.out, "cold_start.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    link = (f", link {args.link_gbps:g} GB/s per worker{' (tc, own namespaces)' if args.netns else ''}"
            if args.link_gbps else "")
    plot(summary, args.png, f"{spec.nbytes / 2**20:.0f} MiB checkpoint, storage {args.storage_gbps:g} GB/s "
         f"{reach}{link}, gloo on loopback, {os.cpu_count()} CPUs")
    print(f"\nwrote {args.out}/cold_start.json, {args.out}/cold_start.csv, {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
