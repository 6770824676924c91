"""The ``nccl-back serve`` sidecar and ``nccl-back status``, as real subprocesses.

Each sidecar is a real ``python -m nccl_back.cli serve`` process against the real
Redis of the ``redis_server`` fixture (the drain-bound test runs a :class:`Sidecar` in
this process, to drive its clock). A load is made observable (not ready yet) with
:func:`gated_model`, a ``--factory`` that blocks until the test creates a gate file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.handshake import run_receiver
from nccl_back.coord.records import to_label
from nccl_back.coord.registry import Registry
from nccl_back.dev.servers import free_port
from nccl_back.errors import WeightLoadError
from nccl_back.model.identity import ModelSpec
from nccl_back.model.skeleton import build
from nccl_back.sidecar.handoff import attach
from nccl_back.sidecar.serve import ServeOptions, Sidecar

from models import TinyTransformer, fill_random, write_checkpoint
from workers import matches_checkpoint

TESTS_DIR = Path(__file__).parent
GATE_ENV = "NCCL_BACK_TEST_GATE"
READY_WAIT = 60.0


def gated_model() -> TinyTransformer:
    """``--factory test_server:gated_model``: a TinyTransformer once ``$GATE_ENV`` exists."""
    gate = os.environ[GATE_ENV]
    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    return TinyTransformer()


class Serve:
    """One ``nccl-back serve`` subprocess; its stdout lines are collected by a thread."""

    def __init__(self, args: list[str], env: dict[str, str], health_port: int) -> None:
        self.health_port = health_port
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nccl_back.cli", "serve", *args,
             "--health-port", str(health_port)],
            cwd=TESTS_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_ready(self, timeout: float = READY_WAIT) -> dict[str, str]:
        """The ``key=value`` fields of the ready line."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"no ready line; stderr:\n{self.stderr()}") from None
        assert line.startswith("ready "), line
        return dict(field.split("=", 1) for field in line.split()[1:])

    def get(self, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.health_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{self.health_port}{path}", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)

    def wait_health(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if self.get("/healthz")[0] == 200:
                    return
            assert self.proc.poll() is None, self.stderr()
            time.sleep(0.05)
        raise AssertionError("health server never answered")

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 30.0) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return "(running)"
        return self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(fill_random(TinyTransformer(), 3), tmp_path / "ckpt", n_shards=2)


@pytest.fixture
def env(redis_url: str, namespace: str, cache_dir: str, tmp_path: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_BACK_")}
    return {
        **clean,
        "NCCL_BACK_REDIS_URL": redis_url,
        "NCCL_BACK_NAMESPACE": namespace,
        "NCCL_BACK_ADVERTISE_HOST": "127.0.0.1",
        "NCCL_BACK_CACHE_DIR": cache_dir,
        "NCCL_BACK_PEER_TTL": "3",
        "NCCL_BACK_TRANSFER_TIMEOUT": "20",
        GATE_ENV: str(tmp_path / "gate"),
    }


@pytest.fixture
def serves() -> Iterator[list[Serve]]:
    """Every started sidecar is killed at the end, whatever happened."""
    started: list[Serve] = []
    yield started
    for s in started:
        s.kill()


def status_text(env: dict[str, str], *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "nccl_back.cli", "status", *args],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout


def status(env: dict[str, str]) -> dict[str, Any]:
    return dict(json.loads(status_text(env, "--json")))


def peers_of(report: dict[str, Any], version: str) -> dict[str, dict[str, Any]]:
    entry = report["versions"].get(version, {"peers": []})
    return {p["peer_id"]: p for p in entry["peers"]}


@pytest.mark.timeout(150)
def test_serve_ready_peer_load_status_and_sigterm(
    ckpt: Path, env: dict[str, str], serves: list[Serve], tmp_path: Path
) -> None:
    """Not ready during the load; a second sidecar loads from the first; SIGTERM withdraws it."""
    version = ModelSpec.from_dir(str(ckpt), cache_dir=env["NCCL_BACK_CACHE_DIR"]).version
    ready_file = tmp_path / "ready1.json"
    first = Serve(["--model", str(ckpt), "--factory", "test_server:gated_model",
                   "--ready-file", str(ready_file)], env, free_port())
    serves.append(first)
    first.wait_health()
    assert first.get("/readyz") == (503, "not_ready\n")
    assert not ready_file.exists()

    Path(env[GATE_ENV]).touch()
    ready1 = first.wait_ready()
    assert ready1["version"] == version and ready1["source"] == "storage"
    assert first.get("/readyz") == (200, "ready\n")
    assert json.loads(ready_file.read_text())["version"] == version

    with tempfile.TemporaryDirectory(prefix="nb-") as sock_dir:
        sock = os.path.join(sock_dir, "handoff.sock")
        second = Serve(["--model", str(ckpt), "--socket", sock], env, free_port())
        serves.append(second)
        ready2 = second.wait_ready()
        assert ready2["source"] == "peer"

        report = status(env)
        listed = peers_of(report, version)
        assert ready2["peer"] in listed
        assert sorted(p["source"] for p in listed.values()) == ["peer", "storage"]
        assert all(p["ground_truth"] and not p["busy"] for p in listed.values())
        # What an operator needs to find each worker: its model, host and pid, what runs it.
        assert {(p["model"], p["engine"]) for p in listed.values()} == {(ckpt.name, "sidecar")}
        assert sorted(p["pid"] for p in listed.values()) == sorted(s.proc.pid for s in serves)
        assert {p["host"] for p in listed.values()} == {to_label(socket.gethostname())}
        table = status_text(env).splitlines()
        assert table[0].split() == ["VERSION", "MODEL", "RANK", "WORKER", "ENGINE", "PEER", "AGE",
                                    "SENDS", "SOURCE", "TRUTH", "ADDRESS"]
        assert sorted(line.split()[5] for line in table[1:]) == sorted(listed)
        assert {line.split()[4] for line in table[1:]} == {"sidecar"}

        # The second sidecar hands its (peer-loaded) weights to a local consumer.
        consumer = build(TinyTransformer)
        assert attach(consumer, sock, version=version).source == "local"
        assert matches_checkpoint(consumer, str(ckpt))

        assert first.stop(signal.SIGTERM) == 0
        assert list(peers_of(status(env), version)) == [
            p for p, info in listed.items() if info["source"] == "peer"
        ]
        assert second.get("/readyz") == (200, "ready\n")
        assert second.stop(signal.SIGINT) == 0
        assert not os.path.exists(sock)
    assert peers_of(status(env), version) == {}


@pytest.mark.timeout(90)
def test_post_drain_withdraws_without_exiting(
    ckpt: Path, env: dict[str, str], serves: list[Serve], tmp_path: Path
) -> None:
    """POST /drain: /readyz 503, gone from Redis, ready file removed; the process stays up."""
    ready_file = tmp_path / "ready.json"
    sidecar = Serve(["--model", str(ckpt), "--ready-file", str(ready_file), "--log-json"], env,
                    free_port())
    serves.append(sidecar)
    version = sidecar.wait_ready()["version"]
    assert len(peers_of(status(env), version)) == 1

    assert sidecar.post("/drain") == 200
    assert sidecar.get("/readyz") == (503, "draining\n")
    assert peers_of(status(env), version) == {}
    assert not ready_file.exists()
    assert sidecar.proc.poll() is None
    assert sidecar.stop() == 0
    events = [json.loads(line)["event"] for line in sidecar.stderr().splitlines()]
    assert events.index("ready") < events.index("drained") < events.index("stopped")


@pytest.mark.timeout(90)
def test_sigterm_during_load_exits_zero_within_drain_bound(
    ckpt: Path, env: dict[str, str], serves: list[Serve]
) -> None:
    """A SIGTERM while the load is stuck exits 0 once --drain-timeout has passed."""
    sidecar = Serve(["--model", str(ckpt), "--factory", "test_server:gated_model",
                     "--drain-timeout", "1"], env, free_port())
    serves.append(sidecar)
    sidecar.wait_health()
    assert sidecar.get("/readyz")[0] == 503
    assert sidecar.stop(signal.SIGTERM, timeout=20) == 0
    assert "load_abandoned" in sidecar.stderr()


@pytest.mark.timeout(60)
def test_drain_gives_up_on_a_stalled_send_at_the_bound(
    ckpt: Path, redis_url: str, namespace: str, cache_dir: str
) -> None:
    """A send whose receiver stalls after the handshake: drain stops waiting at the bound."""
    settings = Settings(redis_url=redis_url, namespace=namespace, advertise_host="127.0.0.1",
                        cache_dir=cache_dir, peer_ttl=3.0,
                        transfer_timeout=3.0)
    now = [0.0]

    class DrainClock(_clock.Clock):
        """Fake time for the draining thread only: the bound passes without real waiting,
        while the service's own threads (the stalled send's watchdog) keep real time."""

        def __init__(self) -> None:
            self.thread = threading.get_ident()

        def monotonic(self) -> float:
            return now[0] if threading.get_ident() == self.thread else super().monotonic()

        def sleep(self, seconds: float) -> None:
            if threading.get_ident() != self.thread:
                super().sleep(seconds)
                return
            now[0] += seconds
            time.sleep(0.001)

    sidecar = Sidecar(settings, ServeOptions(str(ckpt), torch.device("cpu"), drain_timeout=30.0),
                      out=io.StringIO()).start()
    registry = Registry(settings)
    try:
        version = sidecar.load().version
        (peer,) = registry.find_peers(version, 0, 1)
        assert registry.claim(peer.peer_id, "stalled", peer.max_sends, 30) is not None
        request = {"transfer_id": uuid.uuid4().hex, "receiver": "stalled", "version": version,
                   "manifest_digest": peer.manifest_digest, "transport": peer.transport}
        run_receiver(registry, request["transfer_id"], peer.manifest_digest, 5.0,
                     after_ready=lambda: registry.push_request(peer.peer_id, request))
        # The handshake is done and the receiver never connects: the send is in flight.
        assert sidecar.service.active_sends == 1

        with _clock.use(DrainClock()):
            sidecar.drain()
        assert sidecar.abandoned
        assert now[0] >= 30.0
        assert sidecar.health.state == "draining"
        assert registry.find_peers(version, 0, 1) == []
    finally:
        sidecar.close()
        sidecar.service.close()  # returns once the stalled send hits its own watchdog
        registry.close()


@pytest.mark.timeout(120)
def test_serve_hf_model_loads_and_serves_a_peer(
    tmp_path: Path, env: dict[str, str], serves: list[Serve]
) -> None:
    """--hf builds a transformers model from config.json; a second sidecar gets it from the first."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "llama", safe_serialization=True)
    args = ["--model", str(tmp_path / "llama"), "--hf"]
    first = Serve(args, env, free_port())
    serves.append(first)
    assert first.wait_ready()["source"] == "storage"
    second = Serve(args, env, free_port())
    serves.append(second)
    assert second.wait_ready()["source"] == "peer"
    assert first.stop() == 0
    assert second.stop() == 0


def _mapped_ranges(segment: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of the shared-memory segment ``segment``."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith("/" + segment):
                lo, hi = line.split()[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


@pytest.mark.timeout(60)
def test_sidecar_with_handoff_keeps_one_copy(
    ckpt: Path, redis_url: str, namespace: str, cache_dir: str, tmp_path: Path
) -> None:
    """With --factory and a socket, every tensor the sidecar serves to peers lives in the hand-off arena."""
    settings = Settings(redis_url=redis_url, namespace=namespace, advertise_host="127.0.0.1",
                        cache_dir=cache_dir, peer_ttl=3.0)
    options = ServeOptions(str(ckpt), torch.device("cpu"), factory=TinyTransformer,
                           socket_path=str(tmp_path / "handoff.sock"))
    sidecar = Sidecar(settings, options, out=io.StringIO()).start()
    try:
        sidecar.load()
        assert sidecar.handoff is not None and sidecar.handoff.segment_name is not None
        ranges = _mapped_ranges(sidecar.handoff.segment_name)
        assert ranges
        (peer,) = sidecar.service.peers
        served = sidecar.service.served_tensors(peer.peer_id)
        assert served
        outside = [n for n, t in served.items()
                   if not any(lo <= t.data_ptr() < hi for lo, hi in ranges)]
        assert outside == []
    finally:
        sidecar.close()


#: A model large enough that a private copy of it stands out from the interpreter's noise.
_MEMORY_MODEL_MIB = 64
#: What ``nccl-back serve`` imports before its load, for the idle interpreter compared with.
_IDLE = ("import sys, torch, nccl_back.cli, nccl_back.sidecar.serve;"
         " print('idle', flush=True); sys.stdin.read()")


def _held_bytes(pid: int) -> int:
    """RssAnon + RssShmem of ``pid``, in bytes, from its ``/proc/<pid>/status``."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["RssAnon"] + fields["RssShmem"]


def _segments_of(pid: int) -> set[str]:
    """The hand-off segments the process ``pid`` maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split("/dev/shm/")[1].strip() for line in maps if "/dev/shm/nccl_back_" in line}


def _wait_gone(path: str, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


@pytest.mark.timeout(240)
def test_cpu_sidecar_holds_the_model_once_by_its_rss(
    env: dict[str, str], serves: list[Serve], tmp_path: Path
) -> None:
    """A CPU sidecar with a hand-off socket holds RssAnon+RssShmem within 1.35x the model
    above an idle interpreter, after a storage and after a peer load; attach gets the
    exact bytes and no segment outlives its sidecar (SIGTERM or SIGKILL)."""
    from safetensors.torch import load_file, save_file

    from nccl_back.model.checkpoint import flat_skeleton
    from nccl_back.model.skeleton import named_tensors

    ckpt = tmp_path / "big"
    ckpt.mkdir()
    gen = torch.Generator().manual_seed(5)
    per = _MEMORY_MODEL_MIB * (1 << 20) // 8 // 4
    save_file({f"layers.{i}.weight": torch.randn(per, generator=gen) for i in range(8)},
              str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text('{"model_type": "memory"}')
    expected = load_file(str(ckpt / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    spec = ModelSpec.from_dir(str(ckpt), cache_dir=env["NCCL_BACK_CACHE_DIR"])

    idle = subprocess.Popen([sys.executable, "-c", _IDLE], env=env, cwd=TESTS_DIR,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert idle.stdout is not None and idle.stdout.readline().strip() == "idle"
        base = _held_bytes(idle.pid)
    finally:
        idle.kill()
        idle.wait(10)

    socks = [str(tmp_path / f"s{i}" / "handoff.sock") for i in range(2)]
    sidecars: list[Serve] = []
    for sock, source in zip(socks, ("storage", "peer"), strict=True):
        s = Serve(["--model", str(ckpt), "--socket", sock], env, free_port())
        serves.append(s)
        sidecars.append(s)
        assert s.wait_ready()["source"] == source
        ratio = (_held_bytes(s.proc.pid) - base) / nbytes
        assert ratio <= 1.35, f"after a {source} load the sidecar holds {ratio:.2f}x the model"

    for mode in ("copy", "zero_copy"):
        consumer = flat_skeleton(spec)
        assert attach(consumer, socks[1], mode, version=spec.version).source == "local"
        tensors, _ = named_tensors(consumer)
        assert sorted(tensors) == sorted(expected)
        for name, t in tensors.items():
            assert torch.equal(t.view(torch.uint8), expected[name].view(torch.uint8)), name
        del consumer, tensors

    first, second = sidecars
    (seg1,) = _segments_of(first.proc.pid)
    (seg2,) = _segments_of(second.proc.pid)
    assert first.stop(signal.SIGTERM) == 0
    assert _wait_gone(f"/dev/shm/{seg1}"), "segment left behind after SIGTERM"
    second.proc.kill()
    second.proc.wait(10)
    assert _wait_gone(f"/dev/shm/{seg2}"), "segment left behind after SIGKILL"


@pytest.mark.timeout(60)
def test_a_failed_load_leaves_no_segment(
    ckpt: Path, redis_url: str, namespace: str, cache_dir: str, tmp_path: Path
) -> None:
    """A load that fails after the skeleton was built in its segment unlinks it at close()."""
    settings = Settings(redis_url=redis_url, namespace=namespace, advertise_host="127.0.0.1",
                        cache_dir=cache_dir, peer_ttl=3.0)
    before = _segments_of(os.getpid())
    options = ServeOptions(str(ckpt), torch.device("cpu"), factory=lambda: TinyTransformer(d=16),
                           socket_path=str(tmp_path / "handoff.sock"))
    sidecar = Sidecar(settings, options, out=io.StringIO()).start()
    try:
        with pytest.raises(WeightLoadError, match="checkpoint does not fit the skeleton"):
            sidecar.load()
        made = _segments_of(os.getpid()) - before
        assert len(made) == 1 and all(os.path.exists(f"/dev/shm/{n}") for n in made)
    finally:
        sidecar.close()
    assert sidecar.handoff is None
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in made)
