"""Every key a real rollout wrote, overwritten at once: the single flight holds.

A rollout of three real worker processes (one elected downloader, the others served by
its stream or as members of its cooperative download) runs against a real
redis-server while Redis' keyspace notifications report every key it writes; a SCAN of
the namespace at its end adds what they missed. Then every one of those keys at once
holds garbage (an empty string, ``{``, ``1e400``, random bytes...), another Redis type
(string, list, set, hash, zset), or a mutated copy of its real value (bytes flipped),
each kept for an hour. N new workers (3, then 8) released together must load the exact
weights, raise nothing, and read storage as a fleet should: with a live holder (one of
the rollout's workers, whose own keys are garbage too) none of them; without one,
exactly one for all of them.

A write that only tidies (pruning dead ids from an index, refreshing an expiry,
releasing a claim that expires anyway) may fail on what an attacker left; it must never
count as a registry outage, which sends each worker to storage on its own.
"""

from __future__ import annotations

import multiprocessing.connection
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from groups import CTX
from hostile import AT_ONCE, overwrite_all, read_key
from test_hostile_redis import SECRET, KeyWatch, kind_of

from nccl_back.dev.servers import LocalRedis

import workers
from models import TinyTransformer, fill_random, write_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: What a worker's settings add to :func:`workers.settings_for` (the hostile-Redis
#: fleet's timings: a receiver the rollout's garbage turns away retries within seconds).
SETTINGS = {
    "secret": SECRET, "peer_ttl": 3.0, "redis_timeout": 3.0,  # claim_ttl 1.8 s
    "handshake_timeout": 2.0, "transfer_timeout": 10.0,  # a sender's handshake 1 s, busy_wait 5 s
    "single_flight_wait": 8.0, "single_flight_max_wait": 12.0, "download_lease": 2.0,  # caps
    "cohort_window": 0.3, "stall_timeout": 3.0,  # a download group's window 0.03 s
}
#: Seconds one worker's load may take, whatever Redis holds (the single flight's waits
#: and one re-publication of the holder's entry add up to well under it).
LOAD_BOUND = 30.0


@dataclass
class Worker:
    """One worker process, its stop event and the end of its report pipe."""

    proc: Any
    stop: Any
    reader: Any


@dataclass
class Fleet:
    """Real worker processes of one namespace on a real redis-server."""

    url: str
    ckpt: str
    cache: str
    namespace: str
    client: redis.Redis
    workers: list[Worker] = field(default_factory=list)

    def start(self, role: str, go: Any) -> Worker:
        reader, writer = CTX.Pipe(duplex=False)
        stop = CTX.Event()
        kwargs = {"redis_url": self.url, "namespace": self.namespace, "cache_dir": self.cache,
                  **SETTINGS}
        p = CTX.Process(target=workers.worker_main, daemon=True,
                        args=(role, self.ckpt, kwargs, writer, stop),
                        kwargs={"serve_for": 120, "go": go})
        p.start()
        w = Worker(p, stop, reader)
        self.workers.append(w)
        return w

    def release(self, n: int, tag: str, before: Callable[[], None] = lambda: None,
                ) -> tuple[list[Worker], list[dict[str, Any]]]:
        """``n`` workers started together (released at once once all of them are up,
        right after ``before`` ran): their reports once each loaded."""
        go = CTX.Barrier(n + 1)  # each worker waits on it (`go.wait`), then this process
        started = [self.start(f"{tag}{i}", go) for i in range(n)]
        deadline = time.monotonic() + 60
        while go.n_waiting < n:
            assert time.monotonic() < deadline, f"{go.n_waiting} of {n} workers started"
            assert all(w.proc.is_alive() for w in started), "a worker died starting"
            time.sleep(0.02)
        before()
        go.wait(10)
        return started, reports(started)

    def stop(self, ws: list[Worker]) -> None:
        """Close these workers (their service withdraws) and wait for them to exit."""
        for w in ws:
            w.stop.set()
        for w in ws:
            w.proc.join(20)
            if w.proc.is_alive():
                w.proc.kill()

    def close(self) -> None:
        self.stop(self.workers)


def reports(ws: list[Worker], timeout: float = 90) -> list[dict[str, Any]]:
    """One report of each of ``ws`` (what it loaded, from where, how long it took)."""
    out: list[dict[str, Any]] = []
    readers = [w.reader for w in ws]
    deadline = time.monotonic() + timeout
    while len(out) < len(ws):
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(out)} of {len(ws)} workers reported: {out}"
        for conn in multiprocessing.connection.wait(readers, timeout=left):
            try:
                out.append(conn.recv())  # type: ignore[union-attr]
            except EOFError:
                readers.remove(conn)
    return out


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    """A redis-server of this module's own: keyspace notifications are server-wide."""
    s = LocalRedis().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("rollout")
    return str(write_checkpoint(fill_random(TinyTransformer(), seed=11), tmp / "ckpt"))


#: Key kinds every such rollout writes (among others: claims, requests, cohort seats,
#: streams, rosters, rendezvous values, as the moment gives them).
WRITTEN = {"peer", "peers", "gt", "dl", "dlg", "hs"}


def rollout_keys(fleet: Fleet, keep: int) -> dict[str, tuple[str, Any]]:
    """Every key a rollout of three workers wrote (``{key: (type, value)}``, the value
    as it was last seen); the first ``keep`` of those workers go on serving."""
    watch = KeyWatch(fleet.client, fleet.namespace)
    try:
        started, got = fleet.release(3, "rollout")
        assert all("error" not in r for r in got), got
        assert all(r["identical"] for r in got), got
        # A string, not a list: pytest cuts a long repr, and the reasons are the evidence.
        assert sorted(r["source"] for r in got).count("storage") == 1, "\n".join(
            f'{r["role"]} {r["source"]} {round(r["load_seconds"], 2)} s: {r.get("fallback_reason")}'
            for r in got)
        time.sleep(0.5)  # the last notifications arrive
    finally:
        watch.close()
    keys = dict(watch.keys)
    for k in fleet.client.scan_iter(f"{{{fleet.namespace}}}:*", count=1000):
        got_now = read_key(fleet.client, k.decode())
        if got_now is not None:
            keys[k.decode()] = got_now
    fleet.stop(started[keep:])
    return keys


@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("holder", [True, False], ids=["live-holder", "no-holder"])
@pytest.mark.parametrize("how", AT_ONCE)
def test_every_key_of_a_rollout_overwritten_at_once_keeps_the_single_flight(
    server: LocalRedis, ckpt: str, tmp_path: Path, how: str, holder: bool, n: int,
) -> None:
    """Garbage, another Redis type or a mutated copy at every key a real rollout wrote,
    all at once: n workers released together load the exact weights and read storage
    0 times with a live holder, once without one."""
    client = redis.Redis.from_url(server.url)
    fleet = Fleet(server.url, ckpt, str(tmp_path / "cache"), f"r{how}{n}{int(holder)}", client)
    try:
        keys = rollout_keys(fleet, 1 if holder else 0)
        assert {kind_of(k) for k in keys} >= WRITTEN, sorted(keys)
        rng = random.Random(f"{how}/{n}/{holder}")
        _, got = fleet.release(n, "new", lambda: overwrite_all(client, keys, how, rng))
        assert all("error" not in r for r in got), got
        assert all(r["identical"] for r in got), got
        assert max(r["load_seconds"] for r in got) < LOAD_BOUND, [r["load_seconds"] for r in got]
        stored = [r for r in got if r["source"] == "storage"]
        assert len(stored) == (0 if holder else 1), f"{len(stored)} of {n} read storage\n" + "\n".join(
            f'{r["role"]} {round(r["load_seconds"], 2)} s: {r["fallback_reason"]}' for r in stored)
        # What storage served, in bytes: one checkpoint at most (a cooperative download
        # splits it among workers), none with a holder.
        whole = sum(p.stat().st_size for p in Path(ckpt).glob("*.safetensors"))
        read = sum(r["storage_bytes"] for r in got)
        assert read <= (1.1 * whole if not holder else 0), (read, whole)
    finally:
        fleet.close()
        client.close()
