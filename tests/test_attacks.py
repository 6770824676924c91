"""The attacker suite: one test per attack, each asserting the outcome (a
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
from typing import Any

import pytest
import torch
from torch import nn

from nccl_back import log
from nccl_back.cli import main
from nccl_back.coord import schema
from nccl_back.errors import AttachError, CheckpointFormatError, ConfigError
from nccl_back.metrics import Metrics
from nccl_back.model.checkpoint import parse_header
from nccl_back.model.scheme import SCHEME
from nccl_back.sidecar.drain import read_token_file, write_token_file
from nccl_back.sidecar.handoff import HandoffServer, attach
from nccl_back.sidecar.health import HealthServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    """main() (the nccl-back command line) configures logging for the process; undo it
    so other tests see the default."""
    yield
    log.reset()

VERSION = "v-attack"
NOBODY = 65534


class Timed:
    """Asserts the block ran within ``bound`` seconds.

    Bounds prove "no hang, no stall past a deadline", not speed: they sit well above
    what a loaded 2-core CI machine adds to the operation. ``cpu``: this process's CPU
    seconds, for work that waits on nothing (a parser's): a busy machine stretches its
    wall time without bound (5 s for a 0.4 s parse beside a CI run and two CPU burners),
    not the work it does."""

    def __init__(self, bound: float, *, cpu: bool = False) -> None:
        self.bound = bound
        self.clock = time.process_time if cpu else time.monotonic

    def __enter__(self) -> Timed:
        self.start = self.clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = self.clock() - self.start
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
    with _listen(path), Timed(5.0), pytest.raises(
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
        with Timed(5.0), pytest.raises(
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
        with Timed(5.0), pytest.raises(
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
        with Timed(10.0), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
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
        with Timed(10.0):
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
    """200 idle connections hold at most max_connections sockets and no threads; probes answer once they go."""
    with HealthServer(Metrics(), max_connections=4) as server:
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
    with Timed(5.0, cpu=True), pytest.raises(CheckpointFormatError, match="overlap"):
        parse_header(blob, "evil.safetensors", len(blob))


def test_deep_json_safetensors_header_is_refused() -> None:
    """A header nested 1,000,000 deep is a CheckpointFormatError, not a RecursionError."""
    blob = _safetensors(b'{"a":' + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}", b"")
    with Timed(10.0, cpu=True), pytest.raises(CheckpointFormatError, match="nested 1000001 deep"):
        parse_header(blob, "evil.safetensors", len(blob))


def test_deep_json_config_is_refused(tmp_path: Path) -> None:
    """A config.json nested 1,000,000 deep is a CheckpointFormatError."""
    from safetensors.torch import save_file

    from nccl_back.model.identity import ModelSpec

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes(b"[" * 1_000_000 + b"]" * 1_000_000)
    with Timed(10.0, cpu=True), pytest.raises(CheckpointFormatError, match="nested 1000000 deep"):
        ModelSpec.from_dir(str(tmp_path), cache_dir=str(tmp_path / "cache"))


def test_sidecar_drain_needs_the_token_it_wrote(workdir: str, redis_url: str) -> None:
    """`serve --drain-token-file`: the sidecar writes a 0600 token; /drain without it is 403."""
    from nccl_back.config import Settings
    from nccl_back.sidecar.serve import ServeOptions, Sidecar

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


def test_rendezvous_opens_no_port_a_network_neighbour_could_reach(redis_url: str, namespace: str) -> None:
    """The sender's rendezvous listens nowhere: a neighbour without Redis has nothing to
    list, read or write (the transfer's keys are signed records in Redis; tests/test_rendezvous.py)."""
    from rendezvous_util import listening_sockets

    from nccl_back.config import Settings
    from nccl_back.coord.registry import Registry
    from nccl_back.transport.gloo import GlooRendezvous

    before = listening_sockets()
    settings = Settings(advertise_host="127.0.0.2", redis_url=redis_url, namespace=namespace)
    rdv = GlooRendezvous(settings, Registry(settings))
    try:
        assert rdv.address == "127.0.0.2:0"
        rdv.sender("t")  # a transfer's transport, before it connects: no listener either
        assert listening_sockets() == before
    finally:
        rdv.close()


def test_transfer_scope_is_unguessable_without_the_secret() -> None:
    """With a secret a transfer's store keys carry a token derived from it and the id."""
    from nccl_back.coord.auth import transfer_scope

    key = bytes(range(32))
    scoped = transfer_scope(key, "a" * 32)
    assert scoped.startswith("a" * 32 + "-") and len(scoped) == 65
    assert scoped != transfer_scope(key[::-1], "a" * 32)
    assert scoped != transfer_scope(key, "b" * 32)
    assert transfer_scope(None, "a" * 32) == "a" * 32


# ----------------------------------------------------------------- coordination through Redis
#
# The receiver is a WeightService in this process against a real redis-server; the
# attacker is whoever else writes to that Redis: a Registry without the fleet secret
# (or with a wrong one), or raw redis commands.

SECRET = "fleet-secret-" + "s" * 24


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    from models import TinyTransformer, fill_random, write_checkpoint

    return str(write_checkpoint(fill_random(TinyTransformer(), seed=11), tmp_path / "ckpt"))


@pytest.fixture
def plain(redis_url: str, namespace: str, cache_dir: str) -> Any:
    """Settings of this fleet without a secret (the attacker's, or an unsigned fleet)."""
    from nccl_back.config import Settings

    return Settings(redis_url=redis_url, namespace=namespace, advertise_host="127.0.0.1",
                    cache_dir=cache_dir, peer_ttl=3.0, transfer_timeout=20.0,
                    handshake_timeout=3.0).capped(single_flight_wait=20.0, busy_wait=5.0)


@pytest.fixture
def signed(plain: Any) -> Any:
    """The fleet's settings, with the secret."""
    return plain.replace(secret=SECRET)


def _rejected(svc: Any, kind: str) -> float:
    """The service's records_rejected counter for ``kind``."""
    value = svc.metrics.records_rejected.labels(kind=kind)._value.get()
    return float(value)


def _spec_and_model(ckpt: str, settings: Any) -> tuple[Any, Any]:
    from nccl_back.model.identity import ModelSpec
    from nccl_back.model.skeleton import build

    from models import TinyTransformer

    return ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir), build(TinyTransformer)


class Tarpit:
    """A TCP listener that accepts and never answers (a fake peer's rendezvous)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.conns.append(self.sock.accept()[0])

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _fake_peer(reg: Any, spec: Any, model: Any, peer_id: str, address: str) -> Any:
    from nccl_back.coord.registry import PeerInfo
    from nccl_back.model.skeleton import manifest

    info = PeerInfo(peer_id=peer_id, version=spec.version, rank=0, world_size=1,
                    manifest_digest=manifest(model).digest, transport="gloo", address=address)
    reg.publish_peer(info)
    return info


def _forged_truth(reg: Any, spec: Any, model: Any) -> None:
    from nccl_back.coord.registry import encode_truth
    from nccl_back.model import integrity
    from nccl_back.model.skeleton import manifest

    # The hashes of other weights: what a poisoner wants every receiver to accept.
    forged = {layer: "0" * 32 for layer in integrity.layer_hashes(model)}
    reg.put_ground_truth(spec.version, 0, 1, manifest(model).digest, SCHEME, encode_truth({"sampled": forged}))


def test_fake_peer_and_forged_ground_truth_before_any_worker(ckpt: str, plain: Any, signed: Any) -> None:
    """Unsigned peer and ground truth written first: skipped, storage load, truth replaced."""
    from nccl_back.coord.registry import Registry
    from nccl_back.load.service import WeightService
    from nccl_back.model.skeleton import manifest

    spec, model = _spec_and_model(ckpt, signed)
    attacker, tarpit = Registry(plain), Tarpit()
    try:
        _fake_peer(attacker, spec, model, "evil-1", tarpit.address)
        _forged_truth(attacker, spec, model)
        with Timed(15.0), WeightService(signed) as svc:
            result = svc.load(model, spec)
            assert result.source == "storage"
            assert result.fallback_reason is not None
            assert result.fallback_reason.startswith("untrusted_record: no trusted peer")
            assert _rejected(svc, "peer") >= 1
            # The storage loader's view replaced the poisoned record, signed.
            truth = Registry(signed).get_ground_truth(spec.version, 0, 1, manifest(model).digest, SCHEME)
            assert truth is not None and "0" * 32 not in truth.values()
        assert tarpit.conns == []  # nobody ever connected to the fake peer
    finally:
        tarpit.close()


def test_forged_ground_truth_after_a_legit_worker_is_replaced(ckpt: str, plain: Any, signed: Any) -> None:
    """Truth overwritten after a legit load: a receiver refuses it and waits (single
    flight) while the holder's heartbeat replaces it, then loads from the peer; so does
    the next receiver."""
    from nccl_back.coord.registry import Registry, encode_truth
    from nccl_back.load.service import WeightService
    from nccl_back.model.skeleton import manifest

    spec, model = _spec_and_model(ckpt, signed)
    digest = manifest(model).digest
    attacker = Registry(plain)
    with WeightService(signed) as first:
        assert first.load(model, spec).source == "storage"
        key = attacker.keys.of(schema.GROUND_TRUTH, spec.version, 0, 1, digest, SCHEME)
        attacker.client.set(key, json.dumps({"manifest_digest": digest, "scheme": SCHEME, "hashes": encode_truth(
            {"sampled": {"x": "0" * 32}})}), ex=30)
        with Timed(15.0), WeightService(signed) as second:
            _, m2 = _spec_and_model(ckpt, signed)
            result = second.load(m2, spec)
            assert result.source == "peer", result.fallback_reason
            assert _rejected(second, "ground_truth") >= 1
        with Timed(15.0), WeightService(signed) as third:
            _, m3 = _spec_and_model(ckpt, signed)
            assert third.load(m3, spec).source == "peer"


def test_records_signed_with_another_secret_are_skipped(ckpt: str, plain: Any, signed: Any) -> None:
    """Peer entry, ground truth, request and handshake value under a wrong secret: each refused."""
    from nccl_back.coord import handshake
    from nccl_back.coord.registry import Registry
    from nccl_back.errors import HandshakeTimeoutError, UntrustedRecordError

    spec, model = _spec_and_model(ckpt, signed)
    ours, theirs = Registry(signed), Registry(plain.replace(secret="another-" + "x" * 20))
    metrics = Metrics()
    ours.on_untrusted = metrics.record_untrusted  # the real callback, as the service wires it
    info = _fake_peer(theirs, spec, model, "evil-2", "127.0.0.1:1")
    _forged_truth(theirs, spec, model)
    with Timed(5.0):
        assert ours.find_peers(spec.version, 0, 1) == []
        with pytest.raises(UntrustedRecordError, match="bad signature"):
            ours.get_ground_truth(spec.version, 0, 1, info.manifest_digest, SCHEME)
        theirs.push_request("me", {"transfer_id": "t" * 32, "receiver": "evil", "version": "v",
                                   "manifest_digest": "d" * 32, "transport": "gloo"})
        assert ours.pop_request("me", timeout=0.2) is None
    # A forged acknowledgement cannot complete the receiver's handshake.
    tid = "h" * 32
    r_key, _ = handshake.keys(ours, tid)

    def forge() -> None:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            found = theirs.client.get(r_key)
            if found:
                value = json.loads(found)["value"]
                theirs.set_signed(r_key, {"by": "sender", "value": value + 1, "digest": "m"},
                                  schema.HANDSHAKE)
                return
            time.sleep(0.01)

    forger = threading.Thread(target=forge)
    forger.start()
    with Timed(3.0), pytest.raises(HandshakeTimeoutError, match="R1 WAIT_ACK"):
        handshake.run_receiver(ours, tid, "m", 1.0)
    forger.join()
    for kind in ("peer", "ground_truth", "request", "handshake"):
        assert metrics.records_rejected.labels(kind=kind)._value.get() >= 1, kind


HOSTILE_PEER_VALUES = {
    "max_sends=-1": lambda e: json.dumps({**e, "max_sends": -1}),
    "max_sends=1e400": lambda e: json.dumps(e).replace('"max_sends": 1', '"max_sends": 1e400'),
    "max_sends=10**6": lambda e: json.dumps({**e, "max_sends": 10**6}),
    "deep JSON": lambda e: '{"a":' + "[" * 100_000 + "]" * 100_000 + "}",
    "bad address": lambda e: json.dumps({**e, "address": "nowhere"}),
    "bad transport": lambda e: json.dumps({**e, "transport": "carrier-pigeon"}),
    "not JSON": lambda e: "\x00\xff garbage",
}


@pytest.mark.parametrize("case", [*HOSTILE_PEER_VALUES, "wrong Redis type", "no TTL"])
def test_each_malformed_peer_entry_is_skipped_not_raised(ckpt: str, plain: Any, case: str) -> None:
    """Every malformed entry of the review's table: load() neither raises nor waits."""
    from dataclasses import asdict

    from nccl_back.coord.registry import Registry
    from nccl_back.load.service import WeightService

    spec, model = _spec_and_model(ckpt, plain)
    reg = Registry(plain)
    info = _fake_peer(reg, spec, model, "bad-1", "127.0.0.1:1")
    key = reg.keys.key("peer", spec.version, 0, 1, "bad-1")
    entry = asdict(info)
    if case == "wrong Redis type":
        reg.client.delete(key)
        reg.client.rpush(key, "x")
        reg.client.expire(key, 30)
    elif case == "no TTL":
        reg.client.set(key, json.dumps(entry))  # a valid entry, kept forever
    else:
        reg.client.set(key, HOSTILE_PEER_VALUES[case](entry), ex=30)
    with Timed(15.0), WeightService(plain) as svc:
        result = svc.load(model, spec)
    assert result.source == "storage"
    assert result.fallback_reason is not None and result.fallback_reason.startswith(
        "untrusted_record"), result.fallback_reason


def test_keys_without_ttl_do_not_stall_claims_or_the_election(ckpt: str, plain: Any) -> None:
    """A claim and a download lease written without TTL are taken over, not waited out."""
    from nccl_back.coord.registry import Registry
    from nccl_back.load.service import WeightService

    spec, model = _spec_and_model(ckpt, plain)
    reg = Registry(plain)
    reg.client.set(reg.keys.of(schema.LEASE, spec.version, 1),
                   json.dumps({"owner": "ghost"}))  # no TTL
    with Timed(10.0), WeightService(plain) as first:  # single_flight_wait is 20 s
        assert first.load(model, spec).source == "storage"
        peer_id = first.peers[0].peer_id
        reg.client.set(reg.keys.key("claim", peer_id, 0), json.dumps({"token": "0:" + "0" * 32}))
        with Timed(10.0), WeightService(plain) as second:  # busy_wait is 5 s
            _, m2 = _spec_and_model(ckpt, plain)
            assert second.load(m2, spec).source == "peer"


def test_request_flood_and_deep_json_request_leave_the_sender_serving(ckpt: str, signed: Any) -> None:
    """5,000 junk requests and a deep-JSON one queued first: trimmed or skipped; a
    receiver is then served, and the serve loop is alive."""
    from nccl_back.coord.registry import Registry
    from nccl_back.load.service import WeightService

    spec, model = _spec_and_model(ckpt, signed)
    reg = Registry(signed)
    with WeightService(signed) as sender:
        assert sender.load(model, spec).source == "storage"
        key = reg.keys.key("req", sender.peers[0].peer_id)
        pipe = reg.client.pipeline()
        pipe.rpush(key, "[" * 100_000 + "]" * 100_000)
        for i in range(5_000):
            pipe.rpush(key, json.dumps({"transfer_id": f"{i:032x}", "receiver": "evil",
                                        "version": spec.version, "manifest_digest": "d" * 32,
                                        "transport": "gloo"}))
        pipe.expire(key, 30)
        pipe.execute()
        with Timed(20.0), WeightService(signed) as receiver:
            _, m2 = _spec_and_model(ckpt, signed)
            assert receiver.load(m2, spec).source == "peer"
        assert reg.client.llen(key) <= 256  # the receiver's push trimmed the flood
        assert _rejected(sender, "request") >= 1
        assert sender.peers and sender._server._served[sender.peers[0].peer_id].thread.is_alive()


def test_fake_peers_that_answer_the_handshake_then_stall_cost_at_most_the_budget(
    ckpt: str, plain: Any
) -> None:
    """Without a secret, three fake peers complete handshakes then stall: bounded by peer_budget."""
    from nccl_back.coord import handshake
    from nccl_back.coord.registry import Registry
    from nccl_back.load.service import WeightService
    from nccl_back.model.skeleton import manifest

    settings = plain.replace(transfer_timeout=60.0).capped(peer_budget=3.0)
    spec, model = _spec_and_model(ckpt, settings)
    digest = manifest(model).digest
    attacker, tarpit, stop = Registry(plain), Tarpit(), threading.Event()
    peers = [_fake_peer(attacker, spec, model, f"stall-{i}", tarpit.address) for i in range(3)]
    attacker.put_ground_truth(spec.version, 0, 1, digest, SCHEME, {"sampled|x": "0" * 32})

    def answer(peer_id: str) -> None:
        while not stop.is_set():
            request = attacker.pop_request(peer_id, timeout=0.2)
            if request is not None:
                with contextlib.suppress(Exception):
                    handshake.run_sender(attacker, request["transfer_id"], digest, 2.0)

    threads = [threading.Thread(target=answer, args=(p.peer_id,), daemon=True) for p in peers]
    for t in threads:
        t.start()
    try:
        with WeightService(settings) as svc:
            start = time.monotonic()
            result = svc.load(model, spec)
            peer_phase = result.timings.get("peer", time.monotonic() - start)
        assert result.source == "storage"
        # The budget, plus at most one aborted attempt's grace to unwind (3 fake peers
        # would otherwise cost 3 x (connect timeout + grace), or 3 transfer timeouts).
        grace = 5.0  # Transport.join_grace of gloo
        assert peer_phase < 3.0 + grace + 1.5, result.timings
        assert result.fallback_reason is not None
    finally:
        stop.set()
        tarpit.close()
