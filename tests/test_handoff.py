"""Local hand-off from a sidecar over a Unix socket and shared memory (nccl_back.sidecar.handoff).

The sidecar runs in a separate spawned process wherever the behaviour depends on it
(bit-identical copies, surviving a SIGKILL, refusals); protocol edge cases use a server
thread in the test process, still over a real socket and a real segment.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import pytest
import torch
from groups import CTX  # forked from a server with torch imported (tests/groups.py)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from nccl_back.errors import AttachError, ConfigError, WeightVerificationError
from nccl_back.model.integrity import layer_hashes
from nccl_back.model.skeleton import build, manifest
from nccl_back.sidecar.handoff import HandoffServer, attach, gpu_uuid, local_gpu_index

VERSION = "v1"


class TinyNet(nn.Module):
    """Linear layers, a tied head and an integer buffer: ~0.5 MB in float32."""

    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.head = nn.Linear(dim, 256, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("ids", torch.arange(7, dtype=torch.int64))


def _trained(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet().to(device=device, dtype=dtype)


def _skeleton(dtype: torch.dtype = torch.float32, device: str = "cpu") -> TinyNet:
    model = build(TinyNet, device)
    assert isinstance(model, TinyNet)
    return model.to(dtype)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _assert_identical(model: nn.Module, reference: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert sorted(state) == sorted(reference)
    for name, t in state.items():
        assert t.dtype == reference[name].dtype, name
        # Bitwise: an untouched skeleton may hold NaN patterns, and NaN != NaN.
        assert torch.equal(_bits(t.detach().cpu()), _bits(reference[name])), name


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _sidecar(path: str, dtype: str, device: str, ready: Any, stop: Any) -> None:
    """Spawned sidecar: serve a seeded TinyNet until told to stop (60 s at most)."""
    model = _trained(0, getattr(torch, dtype), device)
    with HandoffServer(model, VERSION, path) as server:
        ready.put(server.segment_name or "")
        stop.wait(60)


@dataclass
class Sidecar:
    process: Any
    stop: Any
    path: str
    segment: str

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self) -> None:
        # Setting an Event that a killed process was waiting on would block forever.
        if self.process.is_alive():
            self.stop.set()
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
        _unlink_segment(self.segment)


def _spawn_sidecar(path: str, dtype: str = "float32", device: str = "cpu") -> Sidecar:
    ready, stop = CTX.Queue(), CTX.Event()
    process = CTX.Process(target=_sidecar, args=(path, dtype, device, ready, stop), daemon=True)
    process.start()
    try:
        segment = ready.get(timeout=60)
    except Exception:
        process.kill()
        raise
    return Sidecar(process, stop, path, segment)


def _unlink_segment(name: str) -> None:
    """What the sidecar's resource tracker does after a crash: unlink its segment."""
    if name:
        with contextlib.suppress(FileNotFoundError):
            shared_memory.SharedMemory(name=name).unlink()


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A short private directory: Unix socket paths are limited to ~107 bytes."""
    path = tempfile.mkdtemp(prefix="nbh")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def sidecar() -> Iterator[Sidecar]:
    """One float32 TinyNet sidecar process shared by the read-only tests."""
    directory = tempfile.mkdtemp(prefix="nbh")
    side = _spawn_sidecar(os.path.join(directory, "handoff.sock"))
    yield side
    side.close()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.timeout(90)
def test_copy_mode_gives_bit_identical_tensors(sidecar: Sidecar) -> None:
    """Copy mode fills the skeleton with exactly the sidecar's tensors, verified."""
    model = _skeleton()
    result = attach(model, sidecar.path, version=VERSION)
    _assert_identical(model, _state(_trained()))
    assert model.head.weight is model.embed.weight
    assert result.source == "local" and result.verified and result.version == VERSION
    assert result.bytes == manifest(model).nbytes
    assert set(result.timings) == {"request", "map", "copy", "verify"}


@pytest.mark.timeout(90)
def test_zero_copy_writes_stay_private(sidecar: Sidecar) -> None:
    """Zero-copy views are correct, and the consumer's writes never reach the sidecar."""
    first = _skeleton()
    attach(first, sidecar.path, "zero_copy", version=VERSION)
    _assert_identical(first, _state(_trained()))
    with torch.no_grad():
        first.get_parameter("layers.0.weight").zero_()
    second = _skeleton()
    attach(second, sidecar.path, "zero_copy", version=VERSION)
    _assert_identical(second, _state(_trained()))


@pytest.mark.timeout(90)
def test_version_mismatch_is_refused(sidecar: Sidecar) -> None:
    """A consumer of another version gets an AttachError naming both versions."""
    model = _skeleton()
    with pytest.raises(AttachError, match=r"serves version 'v1', this model is version 'v2'"):
        attach(model, sidecar.path, version="v2")


@pytest.mark.timeout(90)
def test_manifest_mismatch_is_refused_naming_the_tensors(sidecar: Sidecar) -> None:
    """A bfloat16 skeleton against a float32 sidecar is refused, naming tensor and dtypes."""
    model = _skeleton(torch.bfloat16)
    before = _state(model)
    with pytest.raises(
        AttachError,
        match=r"different tensors .*embed\.weight: \[256, 128\] bfloat16 vs \[256, 128\] float32",
    ):
        attach(model, sidecar.path, version=VERSION)
    _assert_identical(model, before)


@pytest.mark.timeout(120)
def test_consumers_survive_sidecar_sigkill(sock_dir: str) -> None:
    """After SIGKILL and unlink of the segment, copy and zero-copy tensors stay intact."""
    side = _spawn_sidecar(os.path.join(sock_dir, "s.sock"))
    try:
        copied, shared = _skeleton(), _skeleton()
        attach(copied, side.path, "copy", version=VERSION)
        attach(shared, side.path, "zero_copy", version=VERSION)
        side.kill()
        assert side.process.exitcode == -signal.SIGKILL
        _unlink_segment(side.segment)
        assert not os.path.exists(f"/dev/shm/{side.segment}")
        reference = _state(_trained())
        _assert_identical(copied, reference)
        _assert_identical(shared, reference)  # the mapping outlives the name and the sidecar
        with pytest.raises(AttachError, match="nothing listening at"):
            attach(_skeleton(), side.path, version=VERSION, timeout=2.0)
    finally:
        side.close()


def test_nonexistent_socket_is_named(sock_dir: str) -> None:
    """Attaching to a path with no socket raises AttachError naming the path."""
    path = os.path.join(sock_dir, "absent.sock")
    with pytest.raises(AttachError, match=f"no hand-off socket at {path}"):
        attach(_skeleton(), path, version=VERSION)


def test_silent_sidecar_times_out(sock_dir: str) -> None:
    """A socket that accepts but never answers fails at the timeout, not forever."""
    path = os.path.join(sock_dir, "mute.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind(path)
        mute.listen(1)
        with pytest.raises(AttachError, match=r"did not answer within 0\.3s"):
            attach(_skeleton(), path, version=VERSION, timeout=0.3)


def test_wrong_hashes_fail_verification(sock_dir: str) -> None:
    """A sidecar whose ground-truth hashes disagree with its bytes fails verification."""
    path = os.path.join(sock_dir, "h.sock")
    truth = layer_hashes(_trained(seed=1))
    with HandoffServer(_trained(seed=0), VERSION, path, hashes=truth):
        with pytest.raises(WeightVerificationError, match=r"mismatching \[embed, layers\.0"):
            attach(_skeleton(), path, version=VERSION)
        attach(_skeleton(), path, version=VERSION, verify=False)


def test_close_removes_socket_and_unlinks_segment(sock_dir: str) -> None:
    """close() removes the socket and the segment name; the server's model stays usable."""
    path = os.path.join(sock_dir, "c.sock")
    model = _trained()
    reference = _state(model)
    server = HandoffServer(model, VERSION, path).start()
    segment = server.segment_name
    assert segment and os.path.exists(f"/dev/shm/{segment}") and os.path.exists(path)
    server.close()
    server.close()
    assert not os.path.exists(path)
    assert not os.path.exists(f"/dev/shm/{segment}")
    _assert_identical(model, reference)


def test_a_skeleton_built_in_its_arena_is_served_from_it_without_a_copy(sock_dir: str) -> None:
    """arena.host builds a skeleton into a segment (constructor buffers kept); the server
    serves that very segment, attach gets the exact bytes, close() unlinks it."""
    from nccl_back.sidecar.handoff import arena

    model = _skeleton()
    hosted = arena.host(model)
    assert hosted.shm is not None
    lo = hosted.tensor.data_ptr()
    tensors = [t for _, t in model.state_dict(keep_vars=True).items()]
    assert all(lo <= t.data_ptr() < lo + hosted.tensor.numel() for t in tensors)
    assert torch.equal(model.ids, torch.arange(7))  # computed by the constructor
    reference = _state(_trained(4))
    model.load_state_dict(reference)  # a load writes in place, into the segment
    server = HandoffServer(model, VERSION, os.path.join(sock_dir, "h.sock"), hosted=hosted).start()
    try:
        assert server.segment_name == hosted.shm.name
        assert all(lo <= t.data_ptr() < lo + hosted.tensor.numel()
                   for _, t in model.state_dict(keep_vars=True).items())
        for mode in ("copy", "zero_copy"):
            consumer = _skeleton()
            attach(consumer, server.socket_path, mode, version=VERSION)
            _assert_identical(consumer, reference)
    finally:
        server.close()
    assert not os.path.exists(f"/dev/shm/{hosted.shm.name}")
    _assert_identical(model, reference)


def test_a_model_moved_out_of_its_arena_is_repacked_and_the_old_segment_unlinked(
    sock_dir: str,
) -> None:
    """A tensor re-pointed after arena.host makes the server pack a fresh arena and
    unlink the hosted one; consumers still get the exact bytes."""
    from nccl_back.sidecar.handoff import arena

    model = _skeleton()
    hosted = arena.host(model)
    assert hosted.shm is not None
    reference = _state(_trained(5))
    model.load_state_dict(reference)
    model.layers[0].weight.data = model.layers[0].weight.data.clone()
    with HandoffServer(model, VERSION, os.path.join(sock_dir, "r.sock"), hosted=hosted) as server:
        assert server.segment_name not in (None, hosted.shm.name)
        assert not os.path.exists(f"/dev/shm/{hosted.shm.name}")
        consumer = _skeleton()
        attach(consumer, server.socket_path, version=VERSION)
        _assert_identical(consumer, reference)


def test_a_hosted_arena_is_unlinked_when_the_server_cannot_start(sock_dir: str) -> None:
    """A server given a hosted arena that fails to start unlinks its segment."""
    from nccl_back.sidecar.handoff import arena

    model = _skeleton()
    hosted = arena.host(model)
    assert hosted.shm is not None
    blocker = os.path.join(sock_dir, "not-a-socket")
    with open(blocker, "w"):
        pass
    with pytest.raises(AttachError, match="exists and is not a socket"):
        HandoffServer(model, VERSION, blocker, hosted=hosted).start()
    assert not os.path.exists(f"/dev/shm/{hosted.shm.name}")


def test_socket_path_conflicts(sock_dir: str) -> None:
    """A live server's path and a regular file are refused; a stale socket is replaced."""
    path = os.path.join(sock_dir, "p.sock")
    with HandoffServer(_trained(), VERSION, path):
        with pytest.raises(AttachError, match="already listening at"):
            HandoffServer(_trained(), VERSION, path).start()
        attach(_skeleton(), path, version=VERSION)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # bound, never listening: what a crashed server leaves behind
    stale.close()
    with HandoffServer(_trained(), VERSION, path):
        attach(_skeleton(), path, version=VERSION)
    regular = os.path.join(sock_dir, "file")
    with open(regular, "w") as f:
        f.write("not a socket")
    with pytest.raises(AttachError, match="exists and is not a socket"):
        HandoffServer(_trained(), VERSION, regular).start()


def test_garbage_and_foreign_requests_do_not_stop_the_server(sock_dir: str) -> None:
    """Non-JSON and wrong-protocol requests get no segment; the server keeps serving."""
    path = os.path.join(sock_dir, "g.sock")
    with HandoffServer(_trained(), VERSION, path, io_timeout=1.0):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(5)
            raw.connect(path)
            raw.sendall(b"\x80not json\n")
            assert raw.recv(100) == b""  # closed without an answer
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(5)
            raw.connect(path)
            raw.sendall(b'{"protocol": 99, "version": "v1"}\n')
            reply = json.loads(raw.makefile("rb").readline())
        assert reply["ok"] is False and reply["reason"] == "protocol" and "segment" not in reply
        attach(_skeleton(), path, version=VERSION)


def test_concurrent_consumers(sock_dir: str) -> None:
    """Several consumers attaching at once all get identical tensors."""
    path = os.path.join(sock_dir, "m.sock")
    models = [_skeleton() for _ in range(4)]
    errors: list[BaseException] = []

    def run(model: TinyNet) -> None:
        try:
            attach(model, path, version=VERSION)
        except BaseException as e:  # reported below, in the test thread
            errors.append(e)

    with HandoffServer(_trained(), VERSION, path):
        threads = [threading.Thread(target=run, args=(m,)) for m in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert errors == []
    reference = _state(_trained())
    for model in models:
        _assert_identical(model, reference)


def test_bad_arguments_raise_config_error(sock_dir: str) -> None:
    """An unknown mode or a non-positive timeout is a ConfigError, before any I/O."""
    with pytest.raises(ConfigError, match="mode='mmap'"):
        attach(_skeleton(), sock_dir, "mmap", version=VERSION)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="timeout=0"):
        attach(_skeleton(), sock_dir, timeout=0, version=VERSION)


def test_gpu_is_found_by_uuid_not_index() -> None:
    """The sidecar's GPU is mapped to this process's index by UUID; an unseen one is refused."""
    visible = ["GPU-aaaa", "GPU-bbbb"]
    assert local_gpu_index("GPU-bbbb", visible) == 1
    with pytest.raises(AttachError, match="GPU GPU-cccc, which this process cannot see"):
        local_gpu_index("GPU-cccc", visible)
    with pytest.raises(AttachError, match="did not name its GPU by UUID"):
        local_gpu_index("", visible)


@pytest.mark.gpu
@pytest.mark.timeout(30)
def test_gpu_uuid_names_a_visible_device() -> None:
    """On a GPU machine, device 0's UUID maps back to index 0."""
    uuids = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
    assert uuids[0].startswith("GPU-") and local_gpu_index(uuids[0], uuids) == 0


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_ipc_copy_and_zero_copy(sock_dir: str) -> None:
    """On GPU the sidecar shares its arena by CUDA IPC; both modes give identical tensors."""
    side = _spawn_sidecar(os.path.join(sock_dir, "g.sock"), device="cuda")
    try:
        reference = _state(_trained(device="cuda"))
        copied = _skeleton(device="cuda")
        attach(copied, side.path, "copy", version=VERSION)
        _assert_identical(copied, reference)
        shared = _skeleton(device="cuda")
        attach(shared, side.path, "zero_copy", version=VERSION)
        _assert_identical(shared, reference)
        on_cpu = _skeleton()
        attach(on_cpu, side.path, "copy", version=VERSION)
        _assert_identical(on_cpu, reference)
        with pytest.raises(
            AttachError, match="zero_copy needs the skeleton on the sidecar's device"
        ):
            attach(_skeleton(), side.path, "zero_copy", version=VERSION)
        del shared
        torch.cuda.synchronize()
    finally:
        side.close()


def test_a_consolidated_skeleton_is_its_own_arena() -> None:
    """A skeleton laid out by skeleton.build is exported as it is (no second copy on a
    GPU); a model of separate allocations is not, and gets an arena of its own."""
    from nccl_back.model.skeleton import flat_layout, manifest, named_tensors
    from nccl_back.sidecar.handoff.arena import laid_out as _laid_out

    flat = build(TinyNet, "cpu")
    tensors, _ = named_tensors(flat)
    offsets, total = flat_layout(manifest(flat))
    arena = _laid_out(tensors, offsets, total)
    assert arena is not None and arena.numel() == total
    assert all(t.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
               for t in tensors.values())
    separate = _trained()
    tensors, _ = named_tensors(separate)
    offsets, total = flat_layout(manifest(separate))
    assert _laid_out(tensors, offsets, total) is None


# ---------------------------------------------------- what a consumer agrees to map


@contextlib.contextmanager
def _segment_replaced(segment: str) -> Iterator[tuple[str, bytes]]:
    """Move the server's segment file aside for the block; yields its path and bytes,
    so the block can put anything in its place. The original comes back afterwards."""
    real = f"/dev/shm/{segment}"
    aside = f"/dev/shm/{segment}.aside"
    with open(real, "rb") as f:
        data = f.read()
    os.rename(real, aside)
    try:
        yield real, data
    finally:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
            os.unlink(real)
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(real)
        os.rename(aside, real)


def _copy_segment(path: str, data: bytes, mode: int, uid: int, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data[:size])
    os.chmod(path, mode)
    if uid != os.geteuid():
        os.chown(path, uid, -1)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, str]]:
    """A hand-off server in this process: (socket path, segment name)."""
    directory = tempfile.mkdtemp(prefix="nbh")
    path = os.path.join(directory, "s.sock")
    with HandoffServer(_trained(), VERSION, path) as server:
        assert server.segment_name
        yield path, server.segment_name
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p, d: os.symlink(p + ".aside", p), r"is a symbolic link; refusing to map it"),
        (lambda p, d: os.mkfifo(p, 0o600), r"is not a regular file; refusing to map it"),
        (lambda p, d: os.mkdir(p, 0o700), r"is not a regular file; refusing to map it"),
        (lambda p, d: _copy_segment(p, d, 0o666, os.geteuid(), len(d)),
         r"is writable by group or others \(mode 666\); refusing to map it"),
        (lambda p, d: _copy_segment(p, d, 0o600, os.geteuid(), 100),
         r"has 100 bytes, expected \d+"),
    ],
    ids=["symlink", "fifo", "directory", "world-writable", "short"],
)
def test_tampered_segment_is_refused(served: tuple[str, str], make: Any, message: str) -> None:
    """A segment that is a link, not a regular file, writable by others or too short
    is never mapped: AttachError names the problem."""
    path, segment = served
    with _segment_replaced(segment) as (real, data):
        make(real, data)
        with pytest.raises(AttachError, match=f"segment {segment} {message}"):
            attach(_skeleton(), path, version=VERSION, timeout=10)
    attach(_skeleton(), path, version=VERSION)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_segment_of_another_user_is_refused(served: tuple[str, str]) -> None:
    """A segment file owned by a uid other than the sidecar's, ours or root is refused."""
    path, segment = served
    with _segment_replaced(segment) as (real, data):
        _copy_segment(real, data, 0o600, 12345, len(data))
        with pytest.raises(
            AttachError,
            match=rf"segment {segment} belongs to uid 12345, expected uid {os.geteuid()}",
        ):
            attach(_skeleton(), path, version=VERSION)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mode=st.integers(0, 0o7777),
    uid=st.sampled_from([0, 1, 1000, 65534]),
    cut=st.integers(0, 64),
)
def test_segment_checks_are_exact(served: tuple[str, str], mode: int, uid: int, cut: int) -> None:
    """Over every mode, a few owners and sizes, a copy of the segment is mapped exactly
    when it is ours, nobody else may write it and it is whole; then the tensors are
    bit-identical, else AttachError says which rule it broke."""
    path, segment = served
    reference = _state(_trained())
    with _segment_replaced(segment) as (real, data):
        size = len(data) - cut
        _copy_segment(real, data, mode, uid, size)
        if uid != os.geteuid() and uid != 0:
            rule = "belongs to uid"
        elif mode & 0o022:
            rule = "is writable by group or others"
        elif cut:
            rule = f"has {size} bytes"
        else:
            model = _skeleton()
            attach(model, path, version=VERSION)
            _assert_identical(model, reference)
            return
        with pytest.raises(AttachError, match=f"segment {segment} {rule}"):
            attach(_skeleton(), path, version=VERSION)


def test_idle_connections_beyond_the_bound_are_closed(sock_dir: str) -> None:
    """Connections beyond the handlers plus the bounded queue are closed at once instead
    of piling up; once the idle ones go, a consumer attaches."""
    path = os.path.join(sock_dir, "b.sock")
    with HandoffServer(_trained(), VERSION, path, io_timeout=60):
        idle = []
        try:
            deadline = time.monotonic() + 60
            while len(idle) < 100:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(30)
                try:
                    s.connect(path)
                except BlockingIOError:  # the listen backlog is full: let accept catch up
                    s.close()
                    assert time.monotonic() < deadline, "the server stopped accepting"
                    time.sleep(0.01)
                    continue
                idle.append(s)
            closed = 0
            for s in idle[::-1]:  # the newest are the ones beyond the bound
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    closed += s.recv(1) == b""
            deadline = time.monotonic() + 30
            while closed < 100 - 64 - 8:
                assert time.monotonic() < deadline, f"only {closed} of 100 idle connections closed"
                time.sleep(0.1)
                closed = 0
                for s in idle:
                    with contextlib.suppress(BlockingIOError):
                        closed += s.recv(1) == b""
        finally:
            for s in idle:
                s.close()
        # The server frees a slot once its handler sees the EOF: on a loaded machine that
        # takes a moment, and a consumer arriving before it is refused. Wait for the slot.
        deadline = time.monotonic() + 60
        while True:
            try:
                attach(_skeleton(), path, version=VERSION, timeout=30)
                break
            except AttachError:
                assert time.monotonic() < deadline, "no consumer could attach once the idle ones left"
                time.sleep(0.2)
