"""A silent partition between two hosts, in real network namespaces.

Two namespaces joined by a veth pair play two hosts, each with its own address; Redis
runs on the receiver's. The sender advertises what the default chooses (the interface
that reaches Redis, not loopback). Mid-transfer the sender's link goes down: no reset
reaches the receiver, as with a dead node or a partition. The receiver must abort at the
stall bound, not wait out the deadline. Needs root and ``ip netns``; skipped otherwise.

The sides are this file run as a script (``send`` / ``recv``, see the bottom).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from nccl_back.dev.servers import redis_server_binary

STALL = 3.0
DEADLINE = 100.0
NBYTES = 2 << 20
BUCKET = 64 << 10


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


def _netns_usable() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = "nbprobe" + uuid.uuid4().hex[:6]
    if _ip("netns", "add", name).returncode != 0:
        return False
    _ip("netns", "del", name)
    return True


pytestmark = pytest.mark.skipif(not _netns_usable(), reason="needs root and `ip netns`")


class Hosts:
    """Two namespaces ``a`` (10.x.y.1) and ``b`` (10.x.y.2) joined by a veth pair."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.a, self.b = f"nba{tag}", f"nbb{tag}"
        self.va, self.vb = f"va{tag}", f"vb{tag}"
        n = int(tag[:2], 16) % 200 + 20
        self.addr_a, self.addr_b = f"10.213.{n}.1", f"10.213.{n}.2"
        for cmd in (
            ["netns", "add", self.a], ["netns", "add", self.b],
            ["link", "add", self.va, "netns", self.a, "type", "veth", "peer", "name", self.vb,
             "netns", self.b],
            ["-n", self.a, "addr", "add", f"{self.addr_a}/24", "dev", self.va],
            ["-n", self.b, "addr", "add", f"{self.addr_b}/24", "dev", self.vb],
            ["-n", self.a, "link", "set", "lo", "up"], ["-n", self.b, "link", "set", "lo", "up"],
            ["-n", self.a, "link", "set", self.va, "up"], ["-n", self.b, "link", "set", self.vb, "up"],
        ):
            done = _ip(*cmd)
            if done.returncode != 0:
                self.close()
                pytest.skip(f"cannot build the namespaces: ip {' '.join(cmd)}: {done.stderr.strip()}")

    def run(self, ns: str, *argv: str) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE,
                                text=True, env=env)

    def close(self) -> None:
        for ns in (self.a, self.b):
            _ip("netns", "del", ns)  # takes its end of the veth pair with it


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    h = Hosts()
    procs: list[subprocess.Popen[str]] = []
    h.procs = procs  # type: ignore[attr-defined]
    yield h
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
    h.close()


def _line(proc: subprocess.Popen[str], timeout: float = 60.0) -> dict[str, Any]:
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if line.startswith("{"):
            return dict(json.loads(line))
        if not line and proc.poll() is not None:
            raise AssertionError(f"side exited with {proc.returncode} before reporting")
    raise AssertionError("side reported nothing in time")


@pytest.mark.timeout(180)
def test_a_silent_partition_mid_transfer_costs_the_stall_bound(hosts: Hosts) -> None:
    """The sender's link goes down mid-transfer (no reset): the receiver, on another
    host, aborts with TransferStalledError at the stall bound, far before the deadline;
    the sender advertised its own non-loopback address by default."""
    port = 6390 + int(uuid.uuid4().hex[:3], 16) % 500
    redis = hosts.run(hosts.b, redis_server_binary(), "--port", str(port), "--bind", hosts.addr_b,
                      "--save", "", "--appendonly", "no")
    hosts.procs.append(redis)  # type: ignore[attr-defined]
    url = f"redis://{hosts.addr_b}:{port}/0"
    tid = uuid.uuid4().hex
    sender = hosts.run(hosts.a, sys.executable, __file__, "send", url, tid)
    hosts.procs.append(sender)  # type: ignore[attr-defined]
    hello = _line(sender)
    assert hello["address"] == f"{hosts.addr_a}:0", hello
    receiver = hosts.run(hosts.b, sys.executable, __file__, "recv", url, tid, hello["address"])
    hosts.procs.append(receiver)  # type: ignore[attr-defined]
    assert _line(receiver)["step"] >= 0  # mid-transfer
    assert _ip("-n", hosts.a, "link", "set", hosts.va, "down").returncode == 0
    result = _line(receiver, timeout=DEADLINE + 30)
    assert result["error"] == "TransferStalledError", result
    assert result["seconds"] < DEADLINE / 2, result


def _side(role: str, url: str, tid: str, address: str = "") -> None:
    import torch

    from nccl_back.config import Settings
    from nccl_back.coord.registry import Registry
    from nccl_back.errors import NcclBackError
    from nccl_back.transport import (
        open_rendezvous,
        receiver_transport,
        recv_tensors,
        run_guarded,
        send_tensors,
    )
    from nccl_back.transport.pacing import Pacer

    settings = Settings(redis_url=url, namespace="partition")
    end = time.monotonic() + 30
    while True:  # Redis starts beside us
        try:
            registry = Registry(settings)
            registry.ping()
            break
        except NcclBackError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)
    cpu = torch.device("cpu")
    tensors = {"w": torch.zeros(NBYTES, dtype=torch.uint8)}
    if role == "send":
        rdv = open_rendezvous(settings, "gloo", device=cpu, registry=registry)
        print(json.dumps({"address": rdv.address}), flush=True)
        pace = Pacer(0.0005).take  # ~4 s for the whole tensor: time to cut the link
        with contextlib.suppress(NcclBackError):  # its receiver is the one under test
            run_guarded(rdv.sender(tid), lambda t: send_tensors(t, tensors, BUCKET, pace=pace),
                        time.monotonic() + DEADLINE)
        return
    told: list[int] = []

    def step(k: int) -> None:
        if not told:
            told.append(k)
            print(json.dumps({"step": k}), flush=True)

    tr = receiver_transport(settings, "gloo", address, tid, device=cpu, registry=registry)
    t0 = time.monotonic()
    error = None
    try:
        run_guarded(tr, lambda t: recv_tensors(t, tensors, BUCKET, on_step=step),
                    t0 + DEADLINE, stall=STALL)
    except NcclBackError as e:
        error = type(e).__name__
    print(json.dumps({"error": error, "seconds": time.monotonic() - t0}), flush=True)


if __name__ == "__main__":
    _side(*sys.argv[1:])
