"""Shaped links for benchmarks: each process in its own network namespace on one bridge,
its outgoing link shaped by ``tc``, as separate machines' NICs would be.

Needs root, ``ip`` and ``tc`` (:func:`unavailable` says why not). Servers listen on
:data:`HOST`; :meth:`Links.add` makes a namespace, which a process enters (:func:`enter`)
before opening any socket. One at a time on a machine: every bridge takes one address.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

#: The bridge's address in the host namespace; the processes' are 10.77.x.y/16.
HOST = "10.77.0.1"
#: ``setns(2)``'s namespace type for a network namespace.
CLONE_NEWNET = 0x40000000


def unavailable() -> str | None:
    """Why shaped links cannot be made here (not root, no ``ip`` or ``tc``), or None."""
    if os.geteuid() != 0:
        return "not root (network namespaces and tc need CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found (iproute2)" if missing else None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


class Links:
    """One bridge and a namespace per :meth:`add`, each link's egress shaped to ``gbps``
    (GB/s, 10^9 B/s); a context manager."""

    def __init__(self, gbps: float) -> None:
        self.gbps = gbps
        # Interface names have 15 characters at most: a short prefix unique per process.
        self.prefix = f"nb{os.getpid() % 100000}"
        self.bridge = f"{self.prefix}br"
        self.names: list[str] = []

    def __enter__(self) -> Links:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Links:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{HOST}/16", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        return self

    def add(self) -> tuple[str, str]:
        """A new namespace linked to the bridge, its egress shaped: (name, address)."""
        i = len(self.names)
        name, host_end, inner = f"{self.prefix}n{i}", f"{self.prefix}h{i}", f"{self.prefix}p{i}"
        address = f"10.77.{(i + 2) // 256}.{(i + 2) % 256}"
        _run("ip", "netns", "add", name)
        self.names.append(name)
        _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", host_end, "master", self.bridge, "up")
        _run("ip", "link", "set", inner, "netns", name)
        _run("ip", "-n", name, "addr", "add", f"{address}/16", "dev", inner)
        _run("ip", "-n", name, "link", "set", inner, "up")
        _run("ip", "-n", name, "link", "set", "lo", "up")
        bits = int(self.gbps * 8e9)
        # A burst of 1/250 s of bytes at least (one kernel tick), and a queue of 0.2 s:
        # TCP sees the rate, not drops.
        burst = max(64 << 10, bits // 8 // 250)
        _run("tc", "-n", name, "qdisc", "add", "dev", inner, "root", "tbf", "rate", f"{bits}bit",
             "burst", str(burst), "latency", "200ms")
        return name, address

    def close(self) -> None:
        # Deleting a namespace deletes the veth end inside it, and with it the pair.
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.names.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


def enter(name: str) -> None:
    """Move the calling thread (call it before any other starts) into namespace ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
