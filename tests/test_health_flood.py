"""The health port's probes under connection floods: real processes, real kernel queues.

Three processes, as on a node: the health server, a flood and the prober (this test).
The flood is two threads opening connections to the health port as fast as they can
(non-blocking connects, so a full accept queue never slows them down) and keeping them
open, idle or dripping a byte every 2 s. The prober makes kubelet-like probes: connect,
request and the whole reply within 1 s, or the probe failed.

Two things make the machine a fair stand-in for a node. The flood runs at nice 19: on
loopback every connection's handshake, both ends of it, is computed by the flooding
thread, CPU that a remote flooder spends on its own machine. And the server's
interpreter is busy a quarter of the time (a thread holding the GIL in one 30 ms call
every 120 ms), as a sidecar's is while it loads or serves: the health loop then stalls
for whole milliseconds, and the accept queue must absorb what arrives meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from groups import CTX  # forked from a server with torch imported (tests/groups.py)

from nccl_back.metrics import Metrics
from nccl_back.sidecar.health import HealthServer

pytestmark = pytest.mark.timeout(120)

PROBES = 45
PROBE_TIMEOUT = 1.0
PROBE_EVERY = 0.2
#: Consecutive failed probes before a kubelet acts (``failureThreshold``'s default):
#: what a probe failure costs the pod.
FAILURE_THRESHOLD = 3
#: Failed probes a flood may cost in all, none of them FAILURE_THRESHOLD in a row.
MAX_FAILURES = 2


class Flood:
    """``threads`` threads connecting to ``port`` without pause, keeping every socket.

    Near this process's descriptor limit the oldest 2000 are closed, so the flood runs
    on for as long as it is asked to. With ``drip`` each connection sends one byte at
    once and another every ``drip`` seconds (a slowloris); else it sends nothing.
    """

    def __init__(self, port: int, *, threads: int = 2, drip: float | None = None) -> None:
        self.port = port
        self.drip = drip
        self.connections = 0
        self._keep: collections.deque[socket.socket] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 3000
        self._threads = [threading.Thread(target=self._connect, daemon=True) for _ in range(threads)]
        if drip is not None:
            self._threads.append(threading.Thread(target=self._drip, daemon=True))

    def __enter__(self) -> Flood:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        with self._lock:
            while self._keep:
                self._keep.popleft().close()

    def _connect(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                while len(self._keep) > self._limit:
                    self._keep.popleft().close()
            try:
                s = socket.socket()
            except OSError:
                continue
            s.setblocking(False)
            if s.connect_ex(("127.0.0.1", self.port)) not in (0, errno.EINPROGRESS):
                s.close()
                continue
            if self.drip is not None:
                with contextlib.suppress(OSError):
                    s.send(b"G")
            with self._lock:
                self._keep.append(s)
                self.connections += 1

    def _drip(self) -> None:
        assert self.drip is not None
        while not self._stop.wait(self.drip):
            with self._lock:
                recent = list(self._keep)[-5000:]  # those the server may still hold
            for s in recent:
                with contextlib.suppress(OSError):
                    s.send(b"E")


def probe(port: int, path: str) -> tuple[int, str]:
    """One kubelet-like probe: (status, body) within PROBE_TIMEOUT, else the error raised."""
    deadline = time.monotonic() + PROBE_TIMEOUT
    with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: probe\r\n\r\n".encode())
        data = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no whole reply within {PROBE_TIMEOUT} s: {data[:40]!r}")
            s.settimeout(left)
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def probe_repeatedly(port: int) -> list[tuple[int, str]]:
    """PROBES probes, alternating /healthz and /readyz; the failures, by index, described."""
    failures = []
    for i in range(PROBES):
        started = time.monotonic()
        path = "/healthz" if i % 2 == 0 else "/readyz"
        try:
            answer = probe(port, path)
            if answer != ((200, "ok\n") if path == "/healthz" else (200, "ready\n")):
                failures.append((i, f"{path}: {answer}"))
        except OSError as e:
            failures.append((i, f"{path}: {e!r}"))
        time.sleep(max(0.0, PROBE_EVERY - (time.monotonic() - started)))
    return failures


def _raise_descriptor_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _busy_server(ready: Any, request_timeout: float, stop: Any) -> None:
    """Spawned: a ready HealthServer whose interpreter a thread holds 30 ms of every 150."""
    _raise_descriptor_limit()
    with HealthServer(Metrics(), request_timeout=request_timeout) as server:
        server.set_ready(True)

        def hog() -> None:
            while not stop.is_set():
                sum(range(2_500_000))  # one call: the GIL is not released inside it
                time.sleep(0.12)

        threading.Thread(target=hog, daemon=True).start()
        ready.put((server.port, server.max_connections))
        stop.wait(100)
        ready.put(server.open_connections)


def _flood(port: int, drip: float | None, started: Any, result: Any, stop: Any) -> None:
    """Spawned: a Flood at nice 19 until ``stop``; puts its connection count."""
    os.nice(19)
    _raise_descriptor_limit()
    with Flood(port, drip=drip) as flood:
        started.set()
        stop.wait(100)
    result.put(flood.connections)


@contextlib.contextmanager
def spawned(target: Any, *args: Any) -> Iterator[Any]:
    """``target(*args, stop)`` in a spawned process, stopped (or killed) at the end."""
    stop = CTX.Event()
    process = CTX.Process(target=target, args=(*args, stop), daemon=True)
    process.start()
    try:
        yield stop
    finally:
        stop.set()
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join(10)


@pytest.fixture(scope="module")
def descriptors_for_a_flood() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 8192:
        pytest.skip(f"a flood needs a descriptor limit of 8192 or more; the hard limit is {hard}")


@pytest.mark.timeout(300)  # up to three floods on a loaded machine
@pytest.mark.parametrize("drip", [None, 2.0], ids=["idle", "slowloris"])
def test_every_probe_answers_within_a_second_under_a_connection_flood(
    descriptors_for_a_flood: None, drip: float | None
) -> None:
    """Under an unthrottled flood of idle (or one-byte-every-2-s) connections, the 45
    probes of /healthz and /readyz are answered within 1 s each but for at most
    MAX_FAILURES, never FAILURE_THRESHOLD in a row (what a kubelet acts on), while the
    server holds at most max_connections of the flood's connections: in one of three
    floods, since a 2-core machine running CI's two suites beside can stall a probe's
    process past 1 s (the loop before its fix failed 1 to 6 probes in every flood; a CI
    run beside which nothing else ran failed one probe in each of three floods)."""
    for _ in range(3):
        ready, started, result = CTX.Queue(), CTX.Event(), CTX.Queue()
        with spawned(_busy_server, ready, 10.0):
            port, cap = ready.get(timeout=60)
            with spawned(_flood, port, drip, started, result):
                assert started.wait(60)
                time.sleep(0.3)  # into the flood's opening burst
                failures = probe_repeatedly(port)
            connections = result.get(timeout=60)
        held = ready.get(timeout=60)
        # A flood counts only if it made more connections than the server may hold: it
        # then had to shed some while it answered the probes. No more is asked: the flood
        # runs at nice 19, so what it makes depends on what else runs (20,418 in 9 s beside
        # the start of a CI run, 8,573 beside CI's two suites, where a bound of 10x the cap
        # failed; once 1,017, under the cap of 1,024, where a slowloris's drips beside CI
        # starved its connecting threads: that flood proved nothing and is tried again).
        if connections > cap and _harmless(failures):
            break
    assert _harmless(failures), f"{len(failures)} of {PROBES} probes failed: {failures}"
    assert held <= cap
    assert connections > cap, f"the flood made {connections} connections, the cap is {cap}"


def _harmless(failures: list[tuple[int, str]]) -> bool:
    """At most MAX_FAILURES failed probes (by index), none FAILURE_THRESHOLD in a row."""
    failed = {i for i, _ in failures}
    return len(failed) <= MAX_FAILURES and not any(
        all(i + k in failed for k in range(FAILURE_THRESHOLD)) for i in failed)


def test_a_slowloris_connection_is_cut_at_its_deadline_during_a_flood(
    descriptors_for_a_flood: None,
) -> None:
    """A client sending one byte every 2 s is answered 408 (or closed) at its request
    deadline even while a flood runs: it never holds the server past it."""
    ready, started, result = CTX.Queue(), CTX.Event(), CTX.Queue()
    with spawned(_busy_server, ready, 3.0):
        port, _ = ready.get(timeout=60)
        with spawned(_flood, port, 2.0, started, result), socket.create_connection(
            ("127.0.0.1", port), timeout=10
        ) as s:
            assert started.wait(60)
            began = time.monotonic()
            answer = b""
            with contextlib.suppress(ConnectionError):
                for byte in b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 100:
                    s.sendall(bytes([byte]))
                    s.settimeout(2.0)
                    with contextlib.suppress(TimeoutError):
                        chunk = s.recv(4096)
                        answer += chunk
                        if not chunk:
                            break
            held = time.monotonic() - began
    assert held < 3.0 + 2.5, f"the dripping connection was held {held:.1f} s"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")


def _starved_server(ready: Any, stop: Any) -> None:
    """Spawned: a HealthServer in a process left with 3 free descriptors of 256."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    with HealthServer(Metrics()) as server:
        server.set_ready(True)
        hoard = []
        with contextlib.suppress(OSError):
            while True:
                hoard.append(os.open(os.devnull, os.O_RDONLY))
        for fd in hoard[-3:]:
            os.close(fd)
        ready.put((server.port, server.max_connections))
        stop.wait(100)


def probe_once(port: int, i: int) -> str:
    """Probe number ``i`` of /healthz: '' when answered, else what went wrong."""
    try:
        answer = probe(port, "/healthz")
    except OSError as e:
        return f"{i}: {e!r}"
    return "" if answer == (200, "ok\n") else f"{i}: {answer}"


def test_probes_answer_when_the_process_is_out_of_descriptors() -> None:
    """With every descriptor of the process taken but three, 300 dripping clients and
    probes: accepts fail with EMFILE, and the loop frees descriptors by evicting the
    oldest connections, so every probe is still answered."""
    ready = CTX.Queue()
    with spawned(_starved_server, ready):
        port, cap = ready.get(timeout=60)
        assert cap == 64  # a quarter of the 256 descriptors
        clients = []
        try:
            for _ in range(300):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.send(b"G")
                clients.append(s)
            failures = [f for f in (probe_once(port, i) for i in range(10)) if f]
        finally:
            for s in clients:
                s.close()
    assert failures == []

