"""Seeded fault-injection soak: a fleet of real worker processes through many rollouts
with randomised faults at random moments, invariants checked after every rollout.

    python benchmarks/soak.py --seed 7 --rollouts 200 --results benchmarks/RESULTS.md
    python benchmarks/soak.py --seed 7 --only 42        # replay rollout 42's schedule
    python benchmarks/soak.py --seed 7 --rollouts 10 --faults kill,stop --max-faults 2
    python benchmarks/soak.py --seed 7 --rollouts 200 --cover  # the few that draw every path

A schedule depends on the seed, the rollout's number, ``--faults`` and ``--max-faults``:
replay with the same three. Exit status 1 when any invariant broke.

Each rollout is a new model version (a fresh 2-shard pipeline checkpoint, new random
values) loaded by 3-5 *units*: single-rank workers and 2-rank gloo groups (one process
per rank, started as torchrun starts them), at random offsets. Faults, drawn from
``random.Random(f"{seed}/{rollout}")`` (so a rollout's schedule depends on the seed and
its number only, and ``--only N`` replays it; the timing of the processes cannot be
replayed, so which *role* a victim had at that moment is recorded, not scheduled):

- ``kill`` / ``stop``: SIGKILL, or SIGSTOP then SIGCONT after a drawn pause, of one rank
  of a started unit; labelled ``_holder`` if it had finished loading (it serves, relays),
  ``_loading`` otherwise (downloader, receiver or relay member);
- ``redis_flush`` (FLUSHALL: Redis restarted empty, cheap form), ``redis_restart`` (the
  redis-server SIGKILLed and a new empty one started on the same port), ``redis_outage``
  (SIGKILLed, and restarted empty only after a drawn pause of 0.5-4 s: a failover's window);
- ``hostile``: records written into the namespace without the secret: at a key of a kind
  drawn from the record schema (``nccl_back/coord/schema.py``), one of the corruptions
  that kind's entry calls for (``tests/hostile.py``: a stale or TTL-less genuine copy, a
  broken signature, garbage, raw bytes that are not UTF-8, an oversized value, hostile
  numbers or fields, each other Redis type), a fake peer of this version, or at every key
  of the namespace at once garbage, another Redis type or a mutated copy of its value
  (``tests/hostile.py``, ``overwrite_all``);
- ``replay_claim``: a genuine send-slot claim copied out of Redis and written back every
  0.5 s for a drawn 1-4 s (no secret needed): it must stop being obeyed at the expiry
  signed into it;
- ``garble_relay``: one rank of a unit, drawn at the end of the schedule (so the draws
  before it are unchanged) for a quarter of the rollouts, flips every byte it forwards as
  a relay member or a download's stream, while its own copy stays exact
  (tests/faults.py); its receivers must catch it and blame only the senders of failing bytes;
- ``early_close``: one unit, drawn after that for a quarter of the rollouts, closes its
  service right after its own load (a short job, a shutdown just after start-up): what
  it was sending (a holder's sends, relay forwards, an elected download's stream to its
  followers) drains within its bound or is given up with a notice, never waited out;
- ``shard_same`` / ``shard_changed``: one shard rewritten in place with the same bytes
  (must be harmless), with one tensor byte changed (another version: a typed error or
  exactly the bytes of the version the worker computed), or ``shard_flap``: flipped
  between those two versions every 5 ms for a drawn 0.5-2 s (a CRC checked on one
  version, bytes copied from the other).

Units of other kinds run beside them: tensor-parallel ranks of a flat model in a plain
or fused layout at TP 1, 2 and 4 (so groups reshard between layouts), compile-cache units
(one builds and publishes a set, the next fetch it; installed bytes compared), and CPU
sidecars with a hand-off socket on a 32 MiB model (attach's bytes compared, and what the
process holds: RssAnon + RssShmem over the process before it, at most 1.35x the model).

Not injected (said in the table): slow HTTP clients on sidecars (tests/test_health_flood.py
floods a real one) and silent partitions (network namespaces need root and a per-worker netns;
skipped). Invariants after every rollout:

1. every unit that was not killed reported, per rank, either tensors whose bytes equal
   the checkpoint's (before, or after a ``shard_changed``: never anything else), or an
   :class:`NcclBackError` (anything else is a failure, with its traceback);
2. no load took longer than ``bound = 2 * (single_flight_max_wait + peer_budget)
   + STORAGE_ALLOWANCE`` plus the time its own process was SIGSTOPped (the load loop
   runs the election and the peer phase at most twice, then storage); a unit silent
   ``HANG_MARGIN`` past its bound is a hang (its stacks are dumped to its log);
3. after ``close()`` no thread or file descriptor beyond those it had before the
   service; every process exits;
4. no key of the namespace without a TTL (``PTTL == -1``), except those the soak's
   hostile writer made;
5. storage reads per rollout (units whose load came from storage) are counted, and a
   late *probe* receiver started a peer TTL after the last fault says whether a live
   holder of its version still serves peers (its source and fallback reason are
   counted, not judged: a degraded fleet is reported, only broken invariants fail).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import redis  # noqa: E402
import soak_workers  # noqa: E402
import torch  # noqa: E402
from hostile import AT_ONCE, corrupt, corruptions, overwrite_all, read_key  # noqa: E402

from nccl_back.config import Settings  # noqa: E402
from nccl_back.coord import schema  # noqa: E402
from nccl_back.dev.servers import LocalRedis, free_port  # noqa: E402
from nccl_back.model.identity import ModelSpec  # noqa: E402
from nccl_back.model.skeleton import named_tensors  # noqa: E402

from models import TinyTransformer, fill_random, write_checkpoint  # noqa: E402

SECRET = "soak-secret-0123456789abcdef"
#: Small timeouts keep the bound tight and a rollout a few seconds long.
SETTINGS: dict[str, Any] = {
    "advertise_host": "127.0.0.1", "secret": SECRET,
    # claim_ttl 1.8 s; a sender's handshake 1 s; busy_wait 2.5 s, peer_budget 13.5 s.
    "redis_timeout": 0.5, "peer_ttl": 3.0, "handshake_timeout": 2.0, "transfer_timeout": 5.0,
    # The elected worker names a roster of who waits with it (a window of 0.05 s, a tenth
    # of the cohort's): one more path and key kind.
    "cohort_window": 0.5, "stall_timeout": 2.0, "storage_attempts": 2,
    "bucket_bytes": 16384,
    # 200 kB/s per sender: a transfer of the 117 kB transformer takes ~0.6 s, so faults
    # at random moments land inside transfers and relay chains, not only between them.
    "max_send_gbps": 0.0002,
}
#: Derived bounds carved shorter than ``SETTINGS`` gives them (:meth:`Settings.capped`).
CAPS: dict[str, float] = {"single_flight_wait": 3.0, "single_flight_max_wait": 6.0, "download_lease": 2.0}
#: The sidecar units' model: what a sidecar holds is then the model, not interpreter noise.
SIDECAR_MODEL_MIB = 32
#: What a sidecar may hold (RssAnon + RssShmem over its process before it), per model byte.
SIDECAR_RSS_BOUND = 1.35
STORAGE_ALLOWANCE = 10.0
"""Seconds granted to the storage load of a tiny model (reads, CRC, copies) on a loaded
2-core machine, with Redis calls that may each wait ``redis_timeout`` meanwhile."""
HANG_MARGIN = 30.0
GROUP_TIMEOUT = 30.0
FAULT_KINDS = ("kill", "stop", "redis_flush", "redis_restart", "redis_outage", "hostile", "shard_same",
               "shard_changed", "shard_flap", "replay_claim", "garble_relay", "early_close")
#: ``garble_relay`` and ``early_close`` (weight 0 here) are drawn apart, last: see
#: :func:`schedule`.
FAULT_WEIGHTS = (4, 3, 1, 1, 1, 3, 1, 1, 1, 1, 0, 0)
#: The share of rollouts in which one rank garbles what it forwards.
GARBLE_CHANCE = 0.25
#: The share of rollouts in which one unit closes its service right after its own load.
EARLY_CLOSE_CHANCE = 0.25
NOT_INJECTED = {
    "slow_http_client": "units run no sidecar (tests/test_health.py floods a real one)",
    "partition": "needs root and a network namespace per worker",
}

# The fork server is a fresh interpreter: without these paths it silently skips the
# preload of soak_workers and every worker imports it (and torch's users) from disk anew.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests"),
     str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])])
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "nccl_back.load.service", "soak_workers"])


def load_bound(settings: Settings) -> float:
    """The documented deadline of one load (invariant 2, see the module docstring)."""
    return 2 * (settings.single_flight_max_wait + settings.peer_budget) + STORAGE_ALLOWANCE


# --------------------------------------------------------------------------- schedule


def schedule(seed: int, rollout: int, faults: tuple[str, ...] = FAULT_KINDS,
             max_faults: int = 3) -> dict[str, Any]:
    """The rollout's units and faults, from its seed and number only (replayable)."""
    rng = random.Random(f"{seed}/{rollout}")
    n_units = rng.randint(3, 5)
    units: list[dict[str, Any]] = [
        {"unit": u, "kind": "pipeline", "world": rng.choice((1, 1, 2)),
         "start": round(rng.uniform(0, 2.0), 2)} for u in range(n_units)]
    # The flat model's tensor-parallel units: plain and fused layouts at TP 1, 2 and 4,
    # so ranks reshard between layouts (a group of 4 behind a one-slot holder included).
    for _ in range(rng.choice((0, 1, 2, 2, 3))):
        scheme = rng.choice(("plain", "megatron", "megatron"))
        world = 1 if scheme == "plain" else rng.choice((1, 2, 2, 4))
        units.append({"unit": 0, "kind": "tp", "scheme": scheme, "world": world,
                      "start": round(rng.uniform(0, 2.0), 2)})
    for _ in range(rng.choice((0, 0, 1, 2))):  # compile caches: one builds, the next fetch
        units.append({"unit": 0, "kind": "cache", "world": 1, "start": round(rng.uniform(0, 2.0), 2)})
    for _ in range(rng.choice((0, 0, 1))):  # a sidecar with a hand-off socket: its memory checked
        units.append({"unit": 0, "kind": "sidecar", "world": 1, "start": round(rng.uniform(0, 2.0), 2)})
    units.sort(key=lambda u: u["start"])
    for i, u in enumerate(units):
        u["unit"] = i
    weights = [w for k, w in zip(FAULT_KINDS, FAULT_WEIGHTS, strict=True) if k in faults and w]
    kinds = [k for k, w in zip(FAULT_KINDS, FAULT_WEIGHTS, strict=True) if k in faults and w]
    plan = []
    for _ in range(rng.randint(0, max_faults) if kinds else 0):
        # Half the faults land just after some unit starts (inside its election, download
        # or transfer), the rest anywhere in the rollout (holders serving, relays).
        t = round(rng.choice(units)["start"] + rng.uniform(0.05, 0.8) if rng.random() < 0.5
                  else rng.uniform(0.1, 3.0), 2)
        kind = rng.choices(kinds, weights)[0]
        started = [u for u in units if u["start"] <= t]
        f: dict[str, Any] = {"t": t, "kind": kind}
        if kind in ("kill", "stop"):
            if not started:
                continue
            victim = rng.choice(started)
            f.update(unit=victim["unit"], rank=rng.randrange(int(victim["world"])))
            if kind == "stop":
                f["pause"] = round(rng.uniform(0.3, 4.0), 2)
        elif kind == "redis_outage":
            f["pause"] = round(rng.uniform(0.5, 4.0), 2)
        elif kind == "hostile":
            f["form"] = rng.choice(("schema", "schema", "every_key", "fake_peer"))
            f["pick"], f["pick2"], f["pick3"] = rng.random(), rng.random(), rng.random()
        elif kind == "replay_claim":
            f["pause"] = round(rng.uniform(1.0, 4.0), 2)
        elif kind.startswith("shard"):
            f["shard"] = rng.randrange(2)
            f["pick"] = rng.random()
            if kind == "shard_flap":
                f["pause"] = round(rng.uniform(0.5, 2.0), 2)
        plan.append(f)
    plan.sort(key=lambda f: f["t"])
    values_seed = rng.randrange(1 << 30)
    # The retired fan-out's draw (chain or trees), still taken: a seed makes the same
    # schedule as before.
    rng.randrange(2)
    if "garble_relay" in faults and rng.random() < GARBLE_CHANCE:  # drawn after, for the same reason
        victim = rng.choice([u for u in units if u["kind"] == "pipeline"])
        victim["garble"] = rng.randrange(int(victim["world"]))
        plan.append({"t": victim["start"], "kind": "garble_relay", "unit": victim["unit"],
                     "rank": victim["garble"]})
        plan.sort(key=lambda f: f["t"])
    if "early_close" in faults and rng.random() < EARLY_CLOSE_CHANCE:  # drawn after, likewise
        # One of the first two to start: likely the elected downloader or a holder others use.
        victim = rng.choice([u for u in units if u["kind"] == "pipeline"][:2])
        victim["close_early"] = True
        plan.append({"t": victim["start"], "kind": "early_close", "unit": victim["unit"], "rank": 0})
        plan.sort(key=lambda f: f["t"])
    return {"rollout": rollout, "seed": seed, "units": units, "faults": plan,
            "values_seed": values_seed}


def drawn(plan: dict[str, Any]) -> set[str]:
    """The paths a rollout's schedule draws: its fault kinds (hostile ones by form), unit
    kinds, pipeline group sizes, tensor-parallel layouts, fan-out, and a compile cache
    fetched from another unit's build (two cache units)."""
    units = plan["units"]
    out = {f["kind"] if f["kind"] != "hostile" else f"hostile:{f['form']}" for f in plan["faults"]}
    out |= {f"unit:{u['kind']}" for u in units}
    out |= {f"fan_out:{plan['fan_out']}"} if "fan_out" in plan else set()
    out |= {f"pipeline:{u['world']}" for u in units if u["kind"] == "pipeline"}
    out |= {f"tp:{u['scheme']}/{u['world']}" for u in units if u["kind"] == "tp"}
    if sum(u["kind"] == "cache" for u in units) >= 2:
        out.add("cache:fetched")
    return out


def covering(seed: int, numbers: list[int], faults: tuple[str, ...], max_faults: int) -> list[int]:
    """A few of ``numbers`` whose schedules together draw every path that any of them
    draws (greedy: the most new paths per unit started), in their order: a short run
    that still takes every path of a long one."""
    plans = {n: drawn(schedule(seed, n, faults, max_faults)) for n in numbers}
    sizes = {n: len(schedule(seed, n, faults, max_faults)["units"]) for n in numbers}
    wanted, picked = set().union(*plans.values()), []
    while wanted:
        n = max(numbers, key=lambda n: (len(plans[n] & wanted) / sizes[n], -n))
        picked.append(n)
        wanted -= plans[n]
    return sorted(picked)


# --------------------------------------------------------------------------- the fleet


@dataclass
class Proc:
    unit: int
    rank: int
    process: Any
    reader: Any
    started: float
    stopped_since: float | None = None
    stopped_total: float = 0.0
    killed: bool = False
    in_service: bool = False
    """Past the group's rendezvous (torchrun's part): from then on a silence is a hang."""
    report: dict[str, Any] | None = None
    closed: dict[str, Any] | None = None


@dataclass
class Outcome:
    """What one rollout did and which invariants it broke."""

    rollout: int
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    loads: int = 0
    typed_errors: int = 0
    wrong: int = 0
    hangs: int = 0
    storage_reads: int = 0
    pools: int = 0
    """Distinct world sizes among the units: each is its own single-flight election, so
    the ideal is one storage read per pool."""
    worst_ratio: float = 0.0
    caches: collections.Counter[str] = field(default_factory=collections.Counter)
    """Compile-cache units by outcome: ``peer`` (fetched, bytes checked) or ``built``."""
    sidecars: list[float] = field(default_factory=list)
    """What each sidecar unit held, per byte of its model (RssAnon + RssShmem)."""
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    """Fallback reason codes of the loads that ended in storage (or typed error names)."""
    failures: list[str] = field(default_factory=list)
    several: int = 0
    """Peer loads filled by several holders at once (idle holders' parts, a reshard)."""
    probe: str = ""
    """The late probe receiver: ``peer``, ``storage <reason code>`` with a live holder of
    its version, or ``no holder`` (nothing to receive from: not counted)."""


class Soak:
    """Runs rollouts against one real redis-server; every process is reaped on exit."""

    def __init__(self, work: Path, seed: int, faults: tuple[str, ...], verbose: bool = True,
                 keep: bool = False) -> None:
        self.work, self.seed, self.fault_kinds, self.verbose = work, seed, faults, verbose
        self.keep = keep  # every rollout's directory (its logs), not only a failed one's
        self.redis = LocalRedis(port=free_port()).start()
        self.namespace = f"soak{seed}"
        self.procs: list[Proc] = []
        self._stop: Any = None
        self._replays: list[threading.Event] = []
        self._flapper: threading.Thread | None = None
        self.settings_kwargs = {**SETTINGS, "redis_url": self.redis.url, "namespace": self.namespace,
                                "cache_dir": str(work / "cache")}
        self.big, self.big_digest = self._big(work / "big")
        self.settings = Settings(**self.settings_kwargs).capped(**CAPS)
        self.bound = load_bound(self.settings)
        atexit.register(self.close)

    def say(self, text: str) -> None:
        if self.verbose:
            print(text, flush=True)

    def raw_client(self) -> redis.Redis:
        """A client that reads values as the bytes they are (a hostile value need not be text)."""
        return redis.Redis(port=self.redis.port, socket_timeout=2)

    def close(self) -> None:
        for p in self.procs:
            if p.process.is_alive():
                _signal(p.process.pid, signal.SIGKILL)
                p.process.join(5)
        self.procs.clear()
        self.redis.stop()

    # -- one rollout --------------------------------------------------------------------

    def rollout(self, sched: dict[str, Any]) -> Outcome:
        r = sched["rollout"]
        out = Outcome(r)
        self.say(f"rollout {r} schedule {json.dumps(sched)}")
        rdir = self.work / f"r{r}"
        ckpt, expected = self._checkpoint(rdir / "ckpt", sched["values_seed"])
        self._flat(rdir / "flat", sched["values_seed"], expected)
        version = next(iter(expected["0/1"]))
        stop = self._stop = _CTX.Event()
        hostile: set[str] = set()
        events: list[tuple[float, int, str, dict[str, Any]]] = []
        for u in sched["units"]:
            events.append((u["start"], 0, "start", u))
        for i, f in enumerate(sched["faults"]):
            events.append((f["t"], 1 + i, "fault", f))
            if f["kind"] in ("stop", "redis_outage", "replay_claim"):
                events.append((f["t"] + f["pause"], 1 + i, "cont", f))
        events.sort(key=lambda e: (e[0], e[1]))
        t0 = time.monotonic()
        procs: list[Proc] = []
        try:
            for at, _, what, item in events:
                self._pump(procs, max(0.0, t0 + at - time.monotonic()))
                if what == "start":
                    procs += self._start(r, item, ckpt, rdir)
                elif what == "cont" and item["kind"] == "redis_outage":
                    self.redis.restart()  # empty, on the same port
                elif what == "cont" and item["kind"] == "replay_claim":
                    self._replays.pop().set()
                elif what == "cont":
                    self._cont(procs, item)
                else:
                    label = self._fault(item, procs, rdir / "ckpt", expected, hostile, version)
                    out.faults[label] += 1
                    self.say(f"  t={time.monotonic() - t0:5.2f} fault {label} {json.dumps(item)}")
            self._await_reports(procs, out, t0, sched)
            # A late receiver once the faults are over: with a live holder of its version
            # it should load from that peer (what a fleet's next worker would see).
            # Started a peer TTL after the last fault, so that heartbeats had time to
            # republish what a Redis fault removed: what is still missing then stays missing.
            last = max((f["t"] + f.get("pause", 0) for f in sched["faults"]), default=0.0)
            self._pump(procs, max(0.0, t0 + last + self.settings.peer_ttl - time.monotonic()))
            probe_u = {"unit": len(sched["units"]), "world": 1, "start": 0.0}
            sched = {**sched, "units": [*sched["units"], probe_u]}
            probe = self._start(r, probe_u, ckpt, rdir)
            procs += probe
            self._await_reports(procs, out, t0, sched)
            stop.set()
            self._await_closed(procs, out)
            self._check(procs, out, expected, sched)
            self._check_probe(probe[0], procs, out)
            self._check_ttls(out, hostile)
        finally:
            stop.set()
            while self._replays:
                self._replays.pop().set()
            for p in procs:
                if p.process.is_alive():
                    _signal(p.process.pid, signal.SIGKILL)
                p.process.join(5)
                p.reader.close()
            self.procs = [p for p in self.procs if p not in procs]
            with self.raw_client() as c:
                for k in hostile:
                    c.delete(k)
        if not out.failures and not self.keep:
            shutil.rmtree(rdir, ignore_errors=True)
        status = "ok" if not out.failures else "FAILED"
        self.say(f"rollout {r} {status}: loads={out.loads} typed_errors={out.typed_errors} "
                 f"storage_reads={out.storage_reads} worst_load/bound={out.worst_ratio:.2f}")
        for f in out.failures:
            self.say(f"  FAILURE rollout {r} seed {self.seed}: {f}")
        return out

    def _checkpoint(self, path: Path, seed: int) -> tuple[Path, dict[str, dict[str, str]]]:
        parts: dict[str, Any] = {n: fill_random(TinyTransformer(**kw), seed=seed + i)
                 for i, (n, kw) in enumerate(soak_workers.PIPELINE.items())}
        write_checkpoint(parts, path, n_shards=2)
        expected: dict[str, dict[str, str]] = {}
        self._record_state(path, expected)
        return path, expected

    def _big(self, path: Path) -> tuple[Path, str]:
        """The sidecars' checkpoint (large enough that what a process holds is the model,
        not the interpreter's noise): one for the whole soak."""
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(self.seed)
        per = (SIDECAR_MODEL_MIB << 20) // 8 // 4
        tensors = {f"layers.{i}.weight": torch.randn(per, generator=gen) for i in range(8)}
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text('{"model_type": "soak-sidecar"}')
        return path, soak_workers.digest(tensors)

    def _flat(self, path: Path, seed: int, expected: dict[str, dict[str, str]]) -> None:
        """The flat model's checkpoint (the tensor-parallel units') and, per scheme and
        rank layout, the digest of the pieces each must hold."""
        import reshard_workers as rw
        from safetensors.torch import load_file

        from nccl_back.model.skeleton import build

        write_checkpoint(fill_random(build(lambda: rw.Flat(rw.checkpoint_shapes())), seed=seed + 7),
                         path, n_shards=2)
        fresh = tempfile.mkdtemp(dir=self.work, prefix="crc-")
        version = ModelSpec.from_dir(str(path), cache_dir=fresh).version
        shutil.rmtree(fresh, ignore_errors=True)
        flat = {}
        for f in sorted(path.glob("*.safetensors")):
            flat.update(load_file(str(f)))
        for scheme, worlds in (("plain", (1,)), ("megatron", (1, 2, 4))):
            for world in worlds:
                for rank in range(world):
                    want = rw.expected(str(path), rank, world, scheme)
                    expected.setdefault(f"tp-{scheme}-{rank}/{world}", {})[version] = \
                        soak_workers.digest(want)
        expected["cache"] = {"": soak_workers.cache_digest(int(path.parent.name[1:]))}

    def _record_state(self, path: Path, expected: dict[str, dict[str, str]]) -> None:
        """Remember, per rank layout, the digest of the files' bytes under the version
        those bytes have (computed without any cache): a worker that loaded version V
        must hold exactly V's bytes, whatever happened to the files meanwhile."""
        fresh = tempfile.mkdtemp(dir=self.work, prefix="crc-")
        version = ModelSpec.from_dir(str(path), cache_dir=fresh).version
        shutil.rmtree(fresh, ignore_errors=True)
        for world in (1, 2):
            for rank in range(world):
                expected.setdefault(f"{rank}/{world}", {})[version] = self._digest_of(path, rank, world)

    @staticmethod
    def _digest_of(path: Path, rank: int, world: int) -> str:
        from safetensors.torch import load_file

        flat: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            flat.update(load_file(str(f)))
        names = soak_workers.part_names(rank, world)
        model = {n: soak_workers.make_model(0, 1)[n] for n in names}
        tensors, _ = named_tensors(model)
        return soak_workers.digest({k: flat[k] for k in tensors})

    def _start(self, r: int, u: dict[str, Any], ckpt: Path, rdir: Path) -> list[Proc]:
        port = free_port() if u["world"] > 1 else 0
        started = []
        for rank in range(u["world"]):
            job = {"rollout": r, "unit": u["unit"], "rank": rank, "world": u["world"], "port": port,
                   "kind": u.get("kind", "pipeline"), "scheme": u.get("scheme"),
                   "garble": u.get("garble") == rank, "close_early": bool(u.get("close_early")),
                   "ckpt": str(ckpt), "flat": str(rdir / "flat"), "big": str(self.big),
                   # Sidecars move the large model at the link's speed (the soak's cap is for
                   # the tiny ones, so faults land inside their transfers).
                   "settings": {**self.settings_kwargs,
                                **({"max_send_gbps": 0.0} if u.get("kind") == "sidecar" else {})},
                   "caps": CAPS,
                   "log": str(rdir / f"u{u['unit']}-{rank}.log"),
                   "hang_after": self.bound + HANG_MARGIN, "group_timeout": GROUP_TIMEOUT}
            reader, writer = _CTX.Pipe(duplex=False)
            proc = _CTX.Process(target=soak_workers.unit_main, args=(job, writer, self._stop),
                                daemon=True)
            proc.start()
            writer.close()
            p = Proc(u["unit"], rank, proc, reader, started=time.monotonic())
            started.append(p)
            self.procs.append(p)
        return started

    def _pump(self, procs: list[Proc], seconds: float) -> None:
        """Collect reports for ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            readers: dict[Any, Proc] = {p.reader: p for p in procs if not p.reader.closed}
            left = deadline - time.monotonic()
            if left <= 0 or not readers:
                if left > 0:
                    time.sleep(left)
                return
            for conn in mp.connection.wait(list(readers), timeout=left):
                p = readers[conn]
                try:
                    msg: dict[str, Any] = p.reader.recv()
                except (EOFError, OSError):
                    p.reader.close()
                    continue
                if msg.get("event") == "closed":
                    p.closed = msg
                elif msg.get("event") == "phase":
                    p.in_service = True
                else:
                    p.report = msg

    def _cont(self, procs: list[Proc], f: dict[str, Any]) -> None:
        for p in procs:
            if (p.unit, p.rank) == (f["unit"], f["rank"]) and p.stopped_since is not None:
                if not p.killed:
                    _signal(p.process.pid, signal.SIGCONT)
                p.stopped_total += time.monotonic() - p.stopped_since
                p.stopped_since = None

    def _fault(self, f: dict[str, Any], procs: list[Proc], ckpt: Path, expected: dict[str, dict[str, str]],
               hostile: set[str], version: str) -> str:
        kind = f["kind"]
        if kind in ("garble_relay", "early_close"):
            return kind  # the rank garbles / the unit closes after its load (its job says so)
        if kind in ("kill", "stop"):
            victim = next((p for p in procs if (p.unit, p.rank) == (f["unit"], f["rank"])), None)
            if victim is None or victim.killed or not victim.process.is_alive():
                return f"{kind}_gone"
            role = "holder" if victim.report is not None else "loading"
            if kind == "kill":
                _signal(victim.process.pid, signal.SIGKILL)
                victim.killed = True
                if victim.stopped_since is not None:
                    victim.stopped_total += time.monotonic() - victim.stopped_since
                    victim.stopped_since = None
            else:
                if victim.stopped_since is not None:
                    return "stop_again"
                _signal(victim.process.pid, signal.SIGSTOP)
                victim.stopped_since = time.monotonic()
            return f"{kind}_{role}"
        if kind == "replay_claim":
            try:
                return self._replay_claim()
            except redis.ConnectionError:
                self._replays.append(threading.Event())  # nothing replays; its "cont" pops it
                return "replay_claim_skipped_redis_down"
        if kind == "redis_flush":
            try:
                self.redis.flushall()
            except redis.ConnectionError:
                return "redis_flush_skipped_redis_down"  # during a redis_outage
            return kind
        if kind == "redis_restart":
            self.redis.restart()
            return kind
        if kind == "redis_outage":
            self.redis.kill()  # back, empty, after the drawn pause
            return kind
        if kind == "hostile":
            try:
                return self._hostile(f, hostile, version)
            except redis.ConnectionError:
                return "hostile_skipped_redis_down"  # during a redis_outage
        return self._rewrite(f, ckpt, expected)

    def _replay_claim(self) -> str:
        """Copy a genuine claim and write it back every 0.5 s until the fault's pause ends."""
        ns = "{" + self.namespace + "}"
        with self.raw_client() as c:
            claims = [k for k in c.scan_iter(f"{ns}:claim:*", count=500)]
            copy = c.get(claims[0]) if claims else None
        if not claims or copy is None:
            self._replays.append(threading.Event())  # nothing to replay; its "cont" pops it
            return "replay_claim_none"
        done = threading.Event()
        self._replays.append(done)
        key = claims[0]

        def replay() -> None:
            with self.raw_client() as c:
                while not done.is_set():
                    with contextlib.suppress(redis.RedisError):
                        c.set(key, copy, px=2000)
                    done.wait(0.5)

        threading.Thread(target=replay, daemon=True, name="soak-replay").start()
        return "replay_claim"

    def _hostile(self, f: dict[str, Any], hostile: set[str], version: str) -> str:
        """Write what an attacker without the secret could write, at a key of a kind drawn
        from the record schema, with a corruption drawn from that kind's (tests/hostile.py),
        or a fake peer of this version, or every key at once; track every key touched."""
        ns = "{" + self.namespace + "}"
        with self.raw_client() as c:
            keys = sorted(k.decode() for k in c.scan_iter(f"{ns}:*", count=500) if k.decode() not in hostile)
            if f["form"] == "every_key":
                how = AT_ONCE[int(f["pick2"] * len(AT_ONCE))]
                found = {k: got for k in keys if (got := read_key(c, k)) is not None}
                overwrite_all(c, found, how, random.Random(f["pick3"]))
                hostile.update(found)
                return f"hostile_every_key_{how}"
            kinds = [k for k in schema.KINDS if k.name != "check"]
            kind = kinds[int(f["pick"] * len(kinds))]
            of_kind = [k for k in keys if schema.kind_of(k) is kind]
            if f["form"] == "fake_peer" or not of_kind:
                pid = f"evil-{f['pick']:.6f}"
                index, entry = f"{ns}:peers:{version}:0:1", f"{ns}:peer:{version}:0:1:{pid}"
                try:
                    c.sadd(index, pid)
                except redis.ResponseError:  # an earlier hostile write gave the index another type
                    c.delete(index)
                    c.sadd(index, pid)
                c.set(entry, json.dumps({"peer_id": pid, "version": version, "rank": 0, "world_size": 1,
                                         "address": "127.0.0.1:1", "transport": "gloo"}))
                hostile.update((index, entry))
                return "hostile_fake_peer"
            key = of_kind[int(f["pick2"] * len(of_kind))]
            how = corruptions(kind)[int(f["pick3"] * len(corruptions(kind)))]
            hostile.add(key)
            genuine = read_key(c, key) or (str(kind.redis_type), None)
            corrupt(c, key, kind, how, genuine)
            return f"hostile_{how}"

    def _rewrite(self, f: dict[str, Any], ckpt: Path, expected: dict[str, dict[str, str]]) -> str:
        """Rewrite one shard in place (same length: never truncated, see DESIGN's mmap lesson)."""
        self._join_flapper()  # one writer at a time: every state the files take is recorded
        shard = sorted(ckpt.glob("*.safetensors"))[f["shard"]]
        data = bytearray(shard.read_bytes())
        original = bytes(data)
        if f["kind"] != "shard_same":
            header = 8 + int.from_bytes(data[:8], "little")
            pos = header + int(f["pick"] * (len(data) - header))
            data[pos] ^= 0x5A
        _write_in_place(shard, bytes(data))
        if f["kind"] != "shard_same":
            # The changed files are another version; a worker that loads it (its CRCs
            # taken after the change) must hold exactly these bytes.
            self._record_state(ckpt, expected)
        if f["kind"] == "shard_flap":
            # Flip between the two versions every few ms for the drawn pause, ending on
            # the original: a load that checks one version's CRC and copies the other's
            # bytes (the race DESIGN's mmap lesson describes) is caught by invariant 1.
            def flap(until: float = time.monotonic() + f["pause"]) -> None:
                while time.monotonic() < until:
                    _write_in_place(shard, original)
                    time.sleep(0.005)
                    _write_in_place(shard, bytes(data))
                    time.sleep(0.005)
                _write_in_place(shard, original)

            self._flapper = threading.Thread(target=flap, daemon=True, name="soak-shard-flap")
            self._flapper.start()
        return f["kind"]

    def _join_flapper(self) -> None:
        if self._flapper is not None:
            self._flapper.join()
            self._flapper = None

    # -- invariants ---------------------------------------------------------------------

    def _await_reports(self, procs: list[Proc], out: Outcome, t0: float, sched: dict[str, Any]) -> None:
        """Wait (for events, not for time) until every live rank reported or is past its cutoff."""
        self._join_flapper()
        while True:
            now = time.monotonic()
            waiting = [p for p in procs if p.report is None and not p.killed]
            late = [p for p in waiting
                    if now > p.started + self.bound + HANG_MARGIN + p.stopped_total]
            for p in late:
                partner_gone = any(q.killed or (q.report or {}).get("phase") == "rendezvous"
                                   for q in procs if q.unit == p.unit and q is not p)
                if not p.in_service and partner_gone:
                    # Stuck in torch's rendezvous with a rank that was killed or gave up on
                    # it (gloo's connect does not always honour its timeout): the group
                    # never formed, before any library call. Not the library's hang.
                    _signal(p.process.pid, signal.SIGKILL)
                    p.killed = True
                    out.typed_errors += 1
                    out.reasons["group never formed (rank killed in rendezvous)"] += 1
                    continue
                if p.process.is_alive():
                    out.hangs += 1
                    _signal(p.process.pid, signal.SIGUSR1)  # its stacks, into its log
                    time.sleep(0.5)
                    out.failures.append(f"HANG unit {p.unit} rank {p.rank}: no report "
                                        f"{self.bound + HANG_MARGIN:.0f} s after start; stacks in "
                                        f"{self.work}/r{out.rollout}/u{p.unit}-{p.rank}.log")
                else:
                    out.failures.append(f"unit {p.unit} rank {p.rank} exited without a report "
                                        f"(code {p.process.exitcode})")
                _signal(p.process.pid, signal.SIGKILL)
                p.killed = True
            if not [p for p in procs if p.report is None and not p.killed]:
                return
            dead = [p for p in waiting if not p.process.is_alive() and p.reader.closed]
            for p in dead:
                out.failures.append(f"unit {p.unit} rank {p.rank} died without a report "
                                    f"(code {p.process.exitcode})")
                p.killed = True
            self._pump(procs, 0.2)

    def _await_closed(self, procs: list[Proc], out: Outcome) -> None:
        deadline = time.monotonic() + 60  # close() + the 10 s leak waits, on a loaded machine
        while time.monotonic() < deadline:
            if all(p.closed is not None or p.killed or p.reader.closed for p in procs):
                break
            self._pump(procs, 0.2)
        for p in procs:
            if p.killed:
                continue
            if p.closed is None:
                out.failures.append(f"unit {p.unit} rank {p.rank}: no 'closed' report within 60 s of stop")
                continue
            if p.closed["leaked_threads"] or p.closed["leaked_fds"]:
                out.failures.append(f"LEAK unit {p.unit} rank {p.rank}: threads {p.closed['leaked_threads']}"
                                    f" fds {p.closed['leaked_fds']}")
        for p in procs:
            p.process.join(10)

    def _check(self, procs: list[Proc], out: Outcome, expected: dict[str, dict[str, str]],
               sched: dict[str, Any]) -> None:
        worlds = {u["unit"]: u["world"] for u in sched["units"]}
        units = {u["unit"]: u for u in sched["units"]}
        # Each (checkpoint, world size) is one single-flight election: one storage read each
        # (pipeline units, tensor-parallel units and sidecars each load their own checkpoint).
        out.pools = len({(u.get("kind", "pipeline"), u["world"]) for u in sched["units"]
                         if u.get("kind") != "cache"})  # sidecars hold a version of their own
        for p in procs:
            rep = p.report
            if rep is None:
                continue
            world = worlds[p.unit]
            unit = units[p.unit]
            bound = self.bound + p.stopped_total
            if "seconds" in rep:
                out.worst_ratio = max(out.worst_ratio, rep["seconds"] / bound)
                if rep["seconds"] > bound:
                    out.failures.append(f"OVERRUN unit {p.unit} rank {p.rank}: load took {rep['seconds']:.1f} s"
                                        f" > bound {bound:.1f} s ({rep.get('event')})")
            self.say(f"  unit {p.unit} rank {p.rank}/{world}: {rep['event']} {rep.get('source', '')}"
                     f" {rep.get('seconds', 0):.2f} s {rep.get('fallback_reason') or ''}")
            if rep["event"] == "loaded":
                out.loads += 1
                out.several += rep["source"] == "peer" and "," in (rep.get("peer_id") or "")
                if rep.get("fallback_reason"):
                    out.reasons[rep["fallback_reason"].split(":", 1)[0]] += 1
                layout = (f"tp-{unit['scheme']}-{p.rank}/{world}" if unit.get("kind") == "tp"
                          else f"{p.rank}/{world}")
                if unit.get("kind") == "sidecar":
                    states = {rep["version"]: self.big_digest}
                    out.sidecars.append(rep["rss_ratio"])
                    if rep["rss_ratio"] > SIDECAR_RSS_BOUND:
                        out.failures.append(f"RSS unit {p.unit}: the sidecar holds {rep['rss_ratio']:.2f}x"
                                            f" its model (bound {SIDECAR_RSS_BOUND}x) after a {rep['source']} load")
                else:
                    states = expected[layout]
                if rep["digest"] != states.get(rep["version"]):
                    out.wrong += 1
                    which = next((v[:12] for v, d in states.items() if d == rep["digest"]), "no version's")
                    out.failures.append(f"WRONG WEIGHTS unit {p.unit} rank {p.rank}: loaded version"
                                        f" {rep['version'][:12]} but holds {which} bytes; source {rep['source']}"
                                        f" peer {rep.get('peer_id')} reason {rep.get('fallback_reason')}")
                if rep["source"] == "storage" and p.rank == 0:
                    out.storage_reads += 1
            elif rep["event"] == "cached":
                out.caches[rep["source"]] += 1
                if rep["source"] == "peer" and rep["digest"] != expected["cache"][""]:
                    out.wrong += 1
                    out.failures.append(f"WRONG CACHE unit {p.unit}: installed bytes are not the set's")
            elif rep.get("phase") == "rendezvous":
                # The group never formed (its other rank was killed, or the port drawn for
                # it was taken meanwhile on a busy machine): torchrun's failure, before any
                # library call.
                out.typed_errors += 1
                out.reasons["group never formed: " + str(rep.get("error")).split(":", 1)[0]] += 1
            elif rep.get("typed"):
                out.typed_errors += 1
                out.reasons["error " + str(rep.get("error")).split(":", 1)[0]] += 1
                self.say(f"  typed error unit {p.unit} rank {p.rank}: {str(rep.get('error'))[:300]}")
            else:
                out.failures.append(f"UNTYPED unit {p.unit} rank {p.rank}: {rep.get('error', rep)}\n"
                                    f"{rep.get('traceback', '')[-2000:]}")

    def _check_probe(self, probe: Proc, procs: list[Proc], out: Outcome) -> None:
        rep = probe.report or {}
        holders = [p for p in procs if p is not probe and not p.killed and p.report
                   and p.report.get("event") == "loaded" and p.report.get("version") == rep.get("version")
                   and _world_of(p, procs) == 1]
        if not holders or rep.get("event") != "loaded":
            out.probe = "no holder"
        elif rep["source"] == "peer":
            out.probe = "peer"
        else:
            out.probe = "storage " + (rep.get("fallback_reason") or "?").split(":", 1)[0]
            self.say(f"  probe fell back although units {[p.unit for p in holders]} hold its version:"
                     f" {rep.get('fallback_reason')}")

    def _check_ttls(self, out: Outcome, hostile: set[str]) -> None:
        ns = "{" + self.namespace + "}"
        with self.raw_client() as c:
            forever = [k.decode() for k in c.scan_iter(f"{ns}:*", count=500)
                       if k.decode() not in hostile and c.pttl(k) == -1]
        if forever:
            out.failures.append(f"KEYS WITHOUT TTL: {sorted(forever)[:10]}")


# --------------------------------------------------------------------------- report


def table(outcomes: list[Outcome], seed: int, wall: float, faults: tuple[str, ...]) -> str:
    kinds: collections.Counter[str] = collections.Counter()
    for o in outcomes:
        kinds.update(o.faults)
    reasons: collections.Counter[str] = collections.Counter()
    for o in outcomes:
        reasons.update(o.reasons)
    probes = collections.Counter(o.probe for o in outcomes if o.probe != "no holder")
    caches: collections.Counter[str] = collections.Counter()
    for o in outcomes:
        caches.update(o.caches)
    ratios = [r for o in outcomes for r in o.sidecars]
    reads = collections.Counter(o.storage_reads - o.pools for o in outcomes)
    clean_reads = collections.Counter(o.storage_reads - o.pools for o in outcomes if not o.faults)
    failed = [o for o in outcomes if o.failures]
    lines = [
        f"Seed {seed}, {len(outcomes)} rollouts in {wall / 60:.1f} min"
        f" (`python benchmarks/soak.py --seed {seed} --rollouts {len(outcomes)}`).",
        "",
        "| rollouts | loads | typed errors | wrong weights | hangs | worst load / bound | failed rollouts |",
        "|---|---|---|---|---|---|---|",
        f"| {len(outcomes)} | {sum(o.loads for o in outcomes)} | {sum(o.typed_errors for o in outcomes)}"
        f" | {sum(o.wrong for o in outcomes)} | {sum(o.hangs for o in outcomes)}"
        f" | {max((o.worst_ratio for o in outcomes), default=0):.2f} | {len(failed)} |",
        "",
        f"Peer loads filled by several holders at once (idle holders' parts, or a reshard's"
        f" holders): {sum(o.several for o in outcomes)}.",
        "",
        "| fault | injected |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(kinds.items())),
        *(f"| {k} | not injected: {why} |" for k, why in NOT_INJECTED.items()),
        "",
        "Compile-cache units: " + (", ".join(f"{k}: {v}" for k, v in sorted(caches.items())) or "none")
        + " (``peer``: fetched from a unit that built it, every installed byte compared).",
        "",
        f"Sidecar units ({SIDECAR_MODEL_MIB} MiB model, hand-off socket, attach's bytes compared):"
        f" {len(ratios)}; held per model byte (RssAnon + RssShmem over the process before it):"
        + (f" max {max(ratios):.2f}, median {sorted(ratios)[len(ratios) // 2]:.2f}" if ratios else " -")
        + f" (bound {SIDECAR_RSS_BOUND}).",
        "",
        "Late probe receiver (one single-rank worker started after each rollout's faults,"
        " when a live single-rank holder of its version exists): "
        + (", ".join(f"{k}: {v}" for k, v in sorted(probes.items())) or "none") + ".",
        "",
        "| storage fallback reason / typed error (per rank) | count |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(reasons.items())),
        "",
        "Storage reads per rollout beyond the ideal (one per single-flight pool, i.e. per world"
        " size present), as extra reads: rollouts: "
        + ", ".join(f"{n}: {c}" for n, c in sorted(reads.items()))
        + "; rollouts without faults: " + (", ".join(f"{n}: {c}" for n, c in sorted(clean_reads.items())) or "none")
        + ". Bound per load: 2 * (single_flight_max_wait + peer_budget) + "
        f"{STORAGE_ALLOWANCE:g} s = {load_bound(Settings(**SETTINGS).capped(**CAPS)):.0f} s, plus the time the "
        "load's own process was stopped.",
    ]
    if failed:
        lines += ["", "Failures (replay with `--seed S --only N`):", ""]
        for o in failed:
            lines += [f"- rollout {o.rollout}: " + f.splitlines()[0][:300] for f in o.failures]
    return "\n".join(lines) + "\n"


def _world_of(p: Proc, procs: list[Proc]) -> int:
    return sum(1 for q in procs if q.unit == p.unit)


def _signal(pid: int, sig: int) -> None:
    """Signal a worker that may have exited a moment ago (then there is nothing to do)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _write_in_place(path: Path, data: bytes) -> None:
    """Same length, no truncation (a truncated mmap'd file is SIGBUS, not our subject)."""
    with open(path, "r+b") as fh:
        fh.write(data)
        fh.flush()


BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"


def write_results(path: Path, text: str) -> None:
    """Replace (or append) the soak section of RESULTS.md."""
    body = f"{BEGIN}\n## Fault-injection soak (benchmarks/soak.py)\n\n{text}{END}\n"
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + body + rest.split(END, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + body
    path.write_text(new)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rollouts", type=int, default=200)
    ap.add_argument("--first", type=int, default=0, help="number of the first rollout")
    ap.add_argument("--only", type=int, help="replay just this rollout's schedule")
    ap.add_argument("--faults", default=",".join(FAULT_KINDS), help="comma-separated fault kinds")
    ap.add_argument("--max-faults", type=int, default=3)
    ap.add_argument("--cover", action="store_true",
                    help="run only a few of these rollouts that together draw every path they draw")
    ap.add_argument("--budget", type=float, default=0, help="stop starting rollouts after this many seconds")
    ap.add_argument("--results", type=Path, help="replace the soak section of this RESULTS.md")
    ap.add_argument("--json", type=Path, help="write a summary here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory, every rollout's logs too")
    args = ap.parse_args(argv)
    faults = tuple(k for k in args.faults.split(",") if k)
    unknown = set(faults) - set(FAULT_KINDS)
    if unknown:
        ap.error(f"unknown fault kinds {sorted(unknown)}")
    numbers = [args.only] if args.only is not None else list(range(args.first, args.first + args.rollouts))
    if args.cover:
        numbers = covering(args.seed, numbers, faults, args.max_faults)
    work = Path(tempfile.mkdtemp(prefix="nccl-back-soak-"))
    print(f"soak: seed {args.seed}, rollouts "
          f"{', '.join(map(str, numbers)) if args.cover else f'{numbers[0]}..{numbers[-1]}'}, work {work}; "
          f"silent partitions skipped ({NOT_INJECTED['partition']}); slow HTTP clients skipped "
          f"({NOT_INJECTED['slow_http_client']}); timing is not replayed, schedules are", flush=True)
    soak = Soak(work, args.seed, faults, keep=args.keep)
    outcomes: list[Outcome] = []
    t0 = time.monotonic()

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        for n in numbers:
            if args.budget and time.monotonic() - t0 > args.budget:
                print(f"soak: budget of {args.budget:g} s spent after {len(outcomes)} rollouts", flush=True)
                break
            outcomes.append(soak.rollout(schedule(args.seed, n, faults, args.max_faults)))
    finally:
        soak.close()
        if outcomes and not any(o.failures for o in outcomes) and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = table(outcomes, args.seed, time.monotonic() - t0, faults)
    print(text)
    if args.results:
        write_results(args.results, text)
    if args.json:
        args.json.write_text(json.dumps({
            "seed": args.seed, "rollouts": len(outcomes), "loads": sum(o.loads for o in outcomes),
            "wrong": sum(o.wrong for o in outcomes), "hangs": sum(o.hangs for o in outcomes),
            "typed_errors": sum(o.typed_errors for o in outcomes),
            "faults": dict(sum((o.faults for o in outcomes), collections.Counter())),
            "storage_reads": [o.storage_reads for o in outcomes],
            "worst_ratio": max((o.worst_ratio for o in outcomes), default=0.0),
            "probes": dict(collections.Counter(o.probe for o in outcomes)),
            "failures": [{"rollout": o.rollout, "failures": o.failures} for o in outcomes if o.failures],
            "work": str(work),
        }, indent=2))
    return 1 if any(o.failures for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
