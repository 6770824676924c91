"""The attacker suite (issue 12): one test per attack, each asserting the outcome (a
refusal with a reason, a skip, a storage fallback or a clear error) and a time bound.

Local doors: the hand-off socket and the health port. Hostile files: safetensors
headers and config.json. (Coordination through Redis: see the sections below.)
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from nccl_back.checkpoint import parse_header
from nccl_back.errors import AttachError, CheckpointFormatError, ConfigError
from nccl_back.handoff import HandoffServer, attach
from nccl_back.health import HealthServer, main, read_token_file, write_token_file
from nccl_back.metrics import Metrics

pytestmark = pytest.mark.timeout(60)

VERSION = "v-attack"
NOBODY = 65534


class Timed:
    """Asserts the block ran within ``bound`` seconds."""

    def __init__(self, bound: float) -> None:
        self.bound = bound

    def __enter__(self) -> Timed:
        self.start = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.monotonic() - self.start
        assert self.seconds < self.bound, f"took {self.seconds:.2f}s, bound {self.bound}s"


@pytest.fixture
def workdir() -> Iterator[str]:
    """A short directory (Unix socket paths are limited to ~107 bytes), mode 0700."""
    path = tempfile.mkdtemp(prefix="nba")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))


def _listen(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(4)
    return s


# ----------------------------------------------------------------- the hand-off socket


def test_socket_squatter_in_a_shared_directory_is_refused(workdir: str) -> None:
    """A socket in a directory others can write (like /tmp) is refused before connecting."""
    shared = os.path.join(workdir, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    path = os.path.join(shared, "handoff.sock")
    with _listen(path), Timed(1.0), pytest.raises(
        AttachError, match=r"socket directory .*shared is writable by others \(mode 1777\)"
    ):
        attach(_tiny(), path, version=VERSION)


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user needs root")
def test_socket_served_by_another_user_is_refused(workdir: str) -> None:
    """A socket whose listener runs as another uid is refused (SO_PEERCRED), request unsent."""
    path = os.path.join(workdir, "handoff.sock")
    script = (
        "import os, socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        f"s.bind({path!r})\n"
        f"os.setgid({NOBODY}); os.setuid({NOBODY})\n"  # listen() records this uid
        "s.listen(4)\n"
        "print('ready', flush=True)\n"
        "c, _ = s.accept()\n"
        "c.settimeout(2)\n"
        "try:\n"
        "    print('got', len(c.recv(100)), flush=True)\n"
        "except OSError:\n"
        "    print('got', 0, flush=True)\n"
    )
    squatter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == "ready\n"
        with Timed(1.0), pytest.raises(
            AttachError, match=rf"served by uid {NOBODY}, expected uid 0; refusing it"
        ):
            attach(_tiny(), path, version=VERSION)
        out, _ = squatter.communicate(timeout=10)
        assert out == "got 0\n"  # not one byte of the request reached it
    finally:
        squatter.kill()
        squatter.wait()


def test_sidecar_of_an_unexpected_uid_is_refused(workdir: str) -> None:
    """attach(expected_uid=...) refuses a live sidecar that runs as another user."""
    path = os.path.join(workdir, "h.sock")
    with HandoffServer(_tiny(), VERSION, path):
        with Timed(1.0), pytest.raises(
            AttachError, match=rf"served by uid {os.geteuid()}, expected uid 4242"
        ):
            attach(_tiny(), path, version=VERSION, expected_uid=4242)
        attach(_tiny(), path, version=VERSION)  # its own user is served


def test_server_refuses_a_shared_directory_and_makes_a_private_one(workdir: str) -> None:
    """The server never binds in a directory others can write; it creates a 0700 one, socket 0600."""
    shared = os.path.join(workdir, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    with pytest.raises(AttachError, match="writable by others"):
        HandoffServer(_tiny(), VERSION, os.path.join(shared, "h.sock")).start()
    path = os.path.join(workdir, "new", "h.sock")
    with HandoffServer(_tiny(), VERSION, path):
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_deep_json_request_to_the_hand_off_server_is_survived(workdir: str) -> None:
    """A request nested 100,000 deep is dropped; the server keeps serving."""
    path = os.path.join(workdir, "h.sock")
    with HandoffServer(_tiny(), VERSION, path):
        with Timed(2.0), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(5)
            raw.connect(path)
            raw.sendall(b"[" * 100_000 + b"]" * 100_000 + b"\n")
            assert raw.recv(100) == b""  # closed without an answer
        attach(_tiny(), path, version=VERSION)


# ----------------------------------------------------------------- the health port


def _post(port: int, path: str, headers: dict[str, str] | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, headers=headers or {})
        return conn.getresponse().status
    finally:
        conn.close()


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_unauthenticated_drain_is_refused(workdir: str) -> None:
    """POST /drain without the token, or with a wrong one, is 403 and drains nothing."""
    token_file = os.path.join(workdir, "private", "drain.token")
    token = write_token_file(token_file)
    drained: list[bool] = []
    with HealthServer(Metrics(), on_drain=lambda: drained.append(True), drain_token=token) as server:
        with Timed(2.0):
            assert _post(server.port, "/drain") == 403
            assert _post(server.port, "/drain", {"X-Drain-Token": "guess"}) == 403
        assert server.state == "not_ready" and not drained
        assert main(["drain", "--port", str(server.port), "--token-file", token_file]) == 0
        assert drained == [True] and server.state == "draining"


def test_drain_token_file_is_private(workdir: str) -> None:
    """The token file is 0600 in a 0700 directory; a file others can read is refused."""
    token_file = os.path.join(workdir, "private", "drain.token")
    token = write_token_file(token_file)
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(token_file)).st_mode) == 0o700
    assert read_token_file(token_file) == token and len(token) >= 32
    os.chmod(token_file, 0o644)
    with pytest.raises(ConfigError, match="must be a regular file of mode 0600"):
        read_token_file(token_file)
    shared = os.path.join(workdir, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        write_token_file(os.path.join(shared, "drain.token"))


def _threads() -> int:
    return threading.active_count()


def test_health_port_flood_is_bounded() -> None:
    """200 idle connections hold at most max_threads threads; probes answer once they go."""
    with HealthServer(Metrics(), max_threads=4) as server:
        before = _threads()
        flood = []
        with Timed(5.0):
            for _ in range(200):
                s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
                flood.append(s)
            time.sleep(0.3)
            assert _threads() <= before + 4
        for s in flood:
            s.close()
        deadline = time.monotonic() + 5
        while True:
            with contextlib.suppress(OSError, http.client.HTTPException):
                if _get(server.port, "/healthz") == 200:
                    break
            assert time.monotonic() < deadline, "health port did not recover"
            time.sleep(0.05)


# ----------------------------------------------------------------- hostile files


def _safetensors(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def test_overlapping_safetensors_offsets_are_refused() -> None:
    """20,000 entries over one 4 KiB range (an 80 MB skeleton from a tiny file) are refused."""
    entry = {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}
    blob = _safetensors(json.dumps({f"t{i}": entry for i in range(20_000)}).encode(), bytes(4096))
    with Timed(2.0), pytest.raises(CheckpointFormatError, match="overlap"):
        parse_header(blob, "evil.safetensors", len(blob))


def test_deep_json_safetensors_header_is_refused() -> None:
    """A header nested 1,000,000 deep is a CheckpointFormatError, not a RecursionError."""
    blob = _safetensors(b'{"a":' + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}", b"")
    with Timed(2.0), pytest.raises(CheckpointFormatError, match="nested 1000001 deep"):
        parse_header(blob, "evil.safetensors", len(blob))


def test_deep_json_config_is_refused(tmp_path: Path) -> None:
    """A config.json nested 1,000,000 deep is a CheckpointFormatError."""
    from safetensors.torch import save_file

    from nccl_back.identity import ModelSpec

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes(b"[" * 1_000_000 + b"]" * 1_000_000)
    with Timed(3.0), pytest.raises(CheckpointFormatError, match="nested 1000000 deep"):
        ModelSpec.from_dir(str(tmp_path), cache_dir=str(tmp_path / "cache"))


def test_sidecar_drain_needs_the_token_it_wrote(workdir: str, redis_url: str) -> None:
    """`serve --drain-token-file`: the sidecar writes a 0600 token; /drain without it is 403."""
    from nccl_back.config import Settings
    from nccl_back.server import ServeOptions, Sidecar

    token_file = os.path.join(workdir, "run", "drain.token")
    options = ServeOptions("unused", torch.device("cpu"), drain_token_file=token_file)
    sidecar = Sidecar(Settings(redis_url=redis_url, namespace="attack-drain"), options).start()
    try:
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        assert _post(sidecar.health.port, "/drain") == 403
        assert sidecar.health.state == "not_ready"
        token = read_token_file(token_file)
        assert _post(sidecar.health.port, "/drain", {"X-Drain-Token": token}) == 200
        assert sidecar.health.state == "draining"
    finally:
        sidecar.close()


# ----------------------------------------------------------------- the transfer's network door


def test_rendezvous_is_not_reachable_on_other_interfaces() -> None:
    """By default the sender's store listens on the advertised address only."""
    from nccl_back.config import Settings
    from nccl_back.transport.gloo import GlooRendezvous

    rdv = GlooRendezvous(Settings(advertise_host="127.0.0.2"))
    try:
        host, port = rdv.address.rsplit(":", 1)
        assert host == "127.0.0.2"
        socket.create_connection(("127.0.0.2", int(port)), timeout=2).close()
        with Timed(2.0), pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
    finally:
        rdv.close()


def test_transfer_scope_is_unguessable_without_the_secret() -> None:
    """With a secret a transfer's store keys carry a token derived from it and the id."""
    from nccl_back.auth import transfer_scope

    key = bytes(range(32))
    scoped = transfer_scope(key, "a" * 32)
    assert scoped.startswith("a" * 32 + "-") and len(scoped) == 65
    assert scoped != transfer_scope(key[::-1], "a" * 32)
    assert scoped != transfer_scope(key, "b" * 32)
    assert transfer_scope(None, "a" * 32) == "a" * 32
