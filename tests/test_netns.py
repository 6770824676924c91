"""The benchmarks' shaped links (``nccl_back/dev/netns.py``): real namespaces, real tc."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading

import pytest

from nccl_back.dev import netns

pytestmark = pytest.mark.skipif(netns.unavailable() is not None,
                                reason=f"shaped links: {netns.unavailable()}")

PROBE = """
import socket, sys
from nccl_back.dev import netns
netns.enter(sys.argv[1])
for host in (netns.HOST, "127.0.0.1"):
    try:
        socket.create_connection((host, int(sys.argv[2])), timeout=2).close()
        print(host, "reached")
    except OSError:
        print(host, "unreached")
"""


def _accept(server: socket.socket) -> None:
    with contextlib.suppress(OSError):  # closed at the end
        while True:
            server.accept()[0].close()


def _same_port(hosts: tuple[str, ...]) -> list[socket.socket]:
    """A server on each of ``hosts`` at one port: a free one on the first host may be
    taken on another by a process beside the tests (seen once on loopback), so draw again."""
    for _ in range(50):
        first = socket.create_server((hosts[0], 0))
        port, servers = first.getsockname()[1], [first]
        try:
            servers += [socket.create_server((h, port)) for h in hosts[1:]]
            return servers
        except OSError:
            for s in servers:
                s.close()
    raise AssertionError(f"no port free on every one of {hosts} in 50 draws")


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_a_process_in_a_namespace_reaches_the_bridge_not_the_hosts_loopback_and_close_removes_all() -> None:
    """A process that entered its namespace reaches a server on the bridge address, not
    one on the host's loopback; closing removes every namespace and link made."""
    servers: list[socket.socket] = []
    with netns.Links(0.01) as links:
        servers = _same_port((netns.HOST, "127.0.0.1"))
        bridge = servers[0]
        for s in servers:
            threading.Thread(target=_accept, args=(s,), daemon=True).start()
        name, address = links.add()
        assert address.startswith("10.77.") and name.startswith(links.prefix)
        out = subprocess.run([sys.executable, "-c", PROBE, name, str(bridge.getsockname()[1])],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.split("\n")[:2] == [f"{netns.HOST} reached", "127.0.0.1 unreached"], out
        assert links.bridge in _links()
    for s in servers:
        s.close()
    assert links.prefix not in _links()
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(
        links.prefix) == 0
