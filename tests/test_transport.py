"""Gloo transport, watchdog and bucketed data plane, between real processes.

The sender runs in a child process started from this very file (see the ``__main__``
block at the bottom): it opens a gloo rendezvous (bootstrapping through the test's real
Redis), prints its address as a JSON line, then serves the transfers named on its
command line. Both sides build the same tensors
from a seed, so the receiver checks bit-identity without the data crossing any other
way.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch

from nccl_back.config import Settings
from nccl_back.coord import handshake
from nccl_back.coord.registry import Registry
from nccl_back.errors import (
    ManifestMismatchError,
    NcclBackError,
    TransferAbandonedError,
    TransferError,
    TransferStalledError,
    TransferTimeoutError,
)
from nccl_back.model.skeleton import Manifest, TensorEntry
from nccl_back.transport import (
    Pending,
    Transport,
    open_rendezvous,
    plan,
    receiver_transport,
    recv_tensors,
    run_guarded,
    send_tensors,
)
from nccl_back.transport.broadcast import ALIGN, DIRECT_BYTES, plan_digest
from nccl_back.transport.gloo import GlooRendezvous, GlooTransport
from nccl_back.transport.nccl import NcclTransport, check_available

BUCKET = 64 << 10
CPU = torch.device("cpu")


#: The test's Redis (set by the autouse fixture below, or by the child's command line).
REDIS: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _redis(redis_url: str, namespace: str) -> None:
    REDIS.update(url=redis_url, namespace=namespace)


def settings(**overrides: object) -> Settings:
    base: dict[str, object] = {"advertise_host": "127.0.0.1", "redis_url": REDIS["url"],
                               "namespace": REDIS["namespace"]}
    base.update(overrides)
    return Settings(**base)  # type: ignore[arg-type]


def registry(s: Settings | None = None) -> Registry:
    return Registry(s or settings())


def model_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Mixed dtypes and sizes: buckets, direct steps, non-contiguous, scalar, empty."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a.bias": torch.randn(7, generator=g),
        "a.weight": torch.randn(300, 200, generator=g),  # 240 KB > BUCKET: direct
        "b.bf16": torch.randn(1000, generator=g).to(torch.bfloat16),
        "b.fp16": torch.randn(33, 3, generator=g).to(torch.float16),
        "c.mask": torch.randint(0, 2, (99,), generator=g).bool(),
        "c.steps": torch.randint(-(2**40), 2**40, (13,), generator=g),
        "d.scalar": torch.tensor(3.5, dtype=torch.float64),
        "d.empty": torch.empty(0, 4),
        "e.transposed": torch.randn(40, 30, generator=g).t(),  # non-contiguous, bucketed
        "e.big_t": torch.randn(250, 100, generator=g).to(torch.bfloat16).t(),  # non-contig, 50 KB
        "f.uint8": torch.randint(0, 256, (70_000,), generator=g, dtype=torch.uint8),  # direct
        "f.big_transposed": torch.randn(200, 120, generator=g).t(),  # 96 KB direct non-contig
    }


def skeleton_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Containers of the same shapes/dtypes, filled with garbage; transposed where the source is."""
    out = {}
    for name, t in tensors.items():
        if t.dim() == 2 and not t.is_contiguous():
            out[name] = torch.full((t.shape[1], t.shape[0]), 7, dtype=t.dtype).t()
        else:
            out[name] = torch.full(t.shape, 7, dtype=t.dtype)
    return out


def mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return [n for n in want if not torch.equal(raw(got[n]), raw(want[n]))]


# -- a transport that misbehaves on purpose (sender side) -------------------------------------


class Faulty(Transport):
    """Delegates to a real transport; at broadcast number ``at`` it dies or stalls."""

    def __init__(self, inner: Transport, at: int, fault: str) -> None:
        super().__init__(inner.rank, inner.transfer_id, inner.device)
        self.kind = inner.kind
        self.inner, self.at, self.fault = inner, at, fault
        self.count = 0
        self.aborted = threading.Event()

    def connect(self, deadline: float) -> None:
        self.inner.connect(deadline)

    def copy(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        self.count += 1
        if self.count == self.at and self.fault == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.count == self.at and self.fault == "stall":
            self.aborted.wait(60)
        return self.inner.copy(tensor, src)

    def abort(self) -> None:
        self.aborted.set()
        self.inner.abort()

    def close(self) -> None:
        self.inner.close()


def serve(args: argparse.Namespace) -> None:
    """Child-process sender: one rendezvous, the transfers in ``args.transfers`` in turn."""
    rdv = GlooRendezvous(settings(), registry())
    print(json.dumps({"address": rdv.address}), flush=True)
    tensors = model_tensors(args.seed)
    pace = None
    if args.gbps:  # slow enough for a test to act mid-transfer
        from nccl_back.transport.pacing import Pacer

        pace = Pacer(args.gbps).take
    for i, tid in enumerate(args.transfers):
        transport: Transport = rdv.sender(tid)
        if i == 0 and args.fault:
            transport = Faulty(transport, args.at, args.fault)
        deadline = time.monotonic() + args.timeout
        try:
            run_guarded(transport, lambda t: send_tensors(t, tensors, args.bucket, pace=pace),
                        deadline)
            print(json.dumps({"transfer": tid, "ok": True}), flush=True)
        except NcclBackError as e:
            print(json.dumps({"transfer": tid, "error": type(e).__name__}), flush=True)
    rdv.close()


@pytest.fixture
def spawn_sender() -> Iterator[Callable[..., tuple[subprocess.Popen[str], str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(*transfers: str, fault: str = "", at: int = 0, timeout: float = 30.0,
              bucket: int = BUCKET, gbps: float = 0.0) -> tuple[subprocess.Popen[str], str]:
        cmd = [sys.executable, __file__, *transfers, "--timeout", str(timeout), "--bucket", str(bucket),
               "--redis-url", REDIS["url"], "--namespace", REDIS["namespace"], "--gbps", str(gbps)]
        if fault:
            cmd += ["--fault", fault, "--at", str(at)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        return proc, json.loads(line)["address"]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


def receive(address: str, tid: str, into: dict[str, torch.Tensor], timeout: float,
            bucket: int = BUCKET, stall: float | None = None,
            on_step: Callable[[int], None] | None = None) -> object:
    s = settings()
    transport = receiver_transport(s, "gloo", address, tid, device=CPU, registry=registry(s))
    return run_guarded(transport, lambda t: recv_tensors(t, into, bucket, on_step=on_step),
                       time.monotonic() + timeout, stall=stall)


def results(proc: subprocess.Popen[str]) -> list[dict[str, object]]:
    out, _ = proc.communicate(timeout=30)
    return [json.loads(line) for line in out.splitlines()]


# -- tests ----------------------------------------------------------------------------------


def test_plan_is_derived_from_the_manifest_alone() -> None:
    """Tensors and their manifest give the same plan; buckets are aligned and bounded."""
    tensors = model_tensors()
    manifest = Manifest(tuple(TensorEntry(n, tuple(t.shape), str(t.dtype)[6:]) for n, t in tensors.items()))
    steps = plan(tensors, BUCKET)
    assert steps == plan(manifest, BUCKET)
    assert plan_digest(steps) == plan_digest(plan(skeleton_like(tensors), BUCKET))
    assert plan_digest(steps) != plan_digest(plan(tensors, BUCKET // 2))
    direct = sorted({s.slots[0].name for s in steps if s.direct})
    assert direct == ["a.weight", "f.big_transposed", "f.uint8"]
    names = {x.name for s in steps for x in s.slots}
    assert names == {n for n in tensors if n != "d.empty"}
    for s in steps:
        assert s.nbytes <= BUCKET
        if not s.direct:
            assert all(x.offset % ALIGN == 0 for x in s.slots)
    # A large tensor travels in chunks of at most a bucket that cover it exactly once.
    for name in direct:
        chunks = [s.slots[0] for s in steps if s.direct and s.slots[0].name == name]
        assert [c.offset for c in chunks] == list(range(0, sum(c.nbytes for c in chunks), BUCKET))
        assert sum(c.nbytes for c in chunks) == tensors[name].numel() * tensors[name].element_size()


def test_tensors_of_direct_size_travel_in_place_below_the_bucket() -> None:
    """A tensor of DIRECT_BYTES or more gets its own in-place steps even in a larger bucket;
    smaller ones still share packed buckets."""
    mib = 1 << 20
    shapes = {"a.big": (3 * mib,), "b.two": (DIRECT_BYTES,), "c.small": (DIRECT_BYTES - 1,), "d.tiny": (8,)}
    manifest = Manifest(tuple(TensorEntry(n, s, "uint8") for n, s in shapes.items()))
    steps = plan(manifest, 8 * mib)
    assert [(s.direct, [x.name for x in s.slots]) for s in steps] == [
        (True, ["a.big"]), (True, ["b.two"]), (False, ["c.small", "d.tiny"])]
    # At or below DIRECT_BYTES the bucket is the threshold.
    assert [s.direct for s in plan(manifest, mib)] == [True] * (3 + 2 + 2) + [False]


@pytest.mark.timeout(60)
def test_two_processes_transfer_bit_identical_tensors(spawn_sender: Callable[..., tuple[subprocess.Popen[str], str]]) -> None:
    """Every tensor (bf16, bool, int64, scalar, non-contiguous...) arrives bit for bit."""
    tid = uuid.uuid4().hex
    proc, address = spawn_sender(tid)
    want = model_tensors()
    got = skeleton_like(want)
    stats = receive(address, tid, got, timeout=30)
    assert mismatches(got, want) == []
    assert not got["e.transposed"].is_contiguous()
    assert stats.bytes == sum(t.numel() * t.element_size() for t in want.values())  # type: ignore[attr-defined]
    assert results(proc) == [{"transfer": tid, "ok": True}]


@pytest.mark.timeout(60)
def test_sender_killed_mid_transfer_fails_the_receiver_fast(spawn_sender: Callable[..., tuple[subprocess.Popen[str], str]]) -> None:
    """SIGKILL of the sender after a few broadcasts: TransferError long before the deadline."""
    tid = uuid.uuid4().hex
    proc, address = spawn_sender(tid, fault="die", at=4)
    start = time.monotonic()
    with pytest.raises(TransferError, match="gloo transfer .* failed"):
        receive(address, tid, skeleton_like(model_tensors()), timeout=40)
    assert time.monotonic() - start < 20
    assert proc.wait(10) == -signal.SIGKILL


@pytest.mark.timeout(90)
def test_stalled_sender_times_out_then_the_next_transfer_works(spawn_sender: Callable[..., tuple[subprocess.Popen[str], str]]) -> None:
    """A stall hits the watchdog deadline; a new transfer between the same processes works
    and no thread is left behind."""
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    proc, address = spawn_sender(first, second, fault="stall", at=4, timeout=4.0)
    baseline = threading.active_count()
    with pytest.raises(TransferTimeoutError, match="gloo transfer"):
        receive(address, first, skeleton_like(model_tensors()), timeout=2.0)
    assert threading.active_count() == baseline
    want = model_tensors()
    got = skeleton_like(want)
    receive(address, second, got, timeout=40)
    assert mismatches(got, want) == []
    assert threading.active_count() == baseline
    assert results(proc) == [
        {"transfer": first, "error": "TransferTimeoutError"},
        {"transfer": second, "ok": True},
    ]


def in_process_pair(
    send: Callable[[Transport], object], recv: Callable[[Transport], object], timeout: float = 20.0
) -> tuple[BaseException | None, BaseException | None]:
    """Both ranks in this process (two threads): cheap for behaviour that needs no crash."""
    s = settings()
    tid = uuid.uuid4().hex
    errors: list[BaseException | None] = [None, None]
    reg = registry(s)
    with open_rendezvous(s, "gloo", device=CPU, registry=reg) as rdv:
        deadline = time.monotonic() + timeout

        def side(i: int, transport: Transport, fn: Callable[[Transport], object]) -> None:
            try:
                run_guarded(transport, fn, deadline)
            except NcclBackError as e:
                errors[i] = e

        threads = [
            threading.Thread(target=side, args=(0, rdv.sender(tid), send)),
            threading.Thread(target=side, args=(1, receiver_transport(
                s, "gloo", rdv.address, tid, device=CPU, registry=reg), recv)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 10)
    return errors[0], errors[1]


@pytest.mark.timeout(60)
def test_different_bucket_sizes_are_refused_before_any_data(spawn_sender: object) -> None:
    """Sender and receiver that would issue different broadcasts both raise ManifestMismatchError."""
    want = model_tensors()
    got = skeleton_like(want)
    before = {n: t.clone() for n, t in got.items()}
    s_err, r_err = in_process_pair(
        lambda t: send_tensors(t, want, BUCKET), lambda t: recv_tensors(t, got, BUCKET // 2)
    )
    assert isinstance(s_err, ManifestMismatchError) and isinstance(r_err, ManifestMismatchError)
    assert mismatches(got, before) == []


@pytest.mark.timeout(60)
def test_corrupting_wrapper_damages_one_element_in_transit_only() -> None:
    """The tests' fault wrapper changes the first element of the first step on the wire, not at the sender."""
    from faults import CorruptingTransport

    want = model_tensors()
    pristine = {n: t.clone() for n, t in want.items()}
    got = skeleton_like(want)
    first_slot = plan(want, BUCKET)[0].slots[0]
    msb = first_slot.offset + want[first_slot.name].element_size() - 1
    errors = in_process_pair(
        lambda t: send_tensors(CorruptingTransport(t, byte=msb), want, BUCKET),  # type: ignore[arg-type]
        lambda t: recv_tensors(t, got, BUCKET),
    )
    assert errors == (None, None)
    assert mismatches(want, pristine) == []
    first = first_slot.name
    assert mismatches(got, want) == [first]
    assert not torch.equal(got[first].reshape(-1)[:1], want[first].reshape(-1)[:1])
    assert torch.equal(got[first].reshape(-1)[1:], want[first].reshape(-1)[1:])


def test_tensors_on_the_wrong_device_are_refused() -> None:
    """A meta tensor cannot be sent by gloo: TransferError naming it, before any broadcast."""
    errors = in_process_pair(
        lambda t: send_tensors(t, {"x": torch.empty(3, device="meta")}, BUCKET),
        lambda t: recv_tensors(t, {"x": torch.empty(3)}, BUCKET),
        timeout=5,
    )
    assert isinstance(errors[0], TransferError) and "x is on meta" in str(errors[0])
    assert isinstance(errors[1], TransferError)


class WatchdogOnly(Transport):
    """A real gloo transport that never sees the stall bound: like NCCL's, its waits know
    only the deadline, so only the watchdog (the shared code path) can enforce the bound."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner.rank, inner.transfer_id, inner.device)
        self.kind = inner.kind
        self.inner = inner

    def connect(self, deadline: float) -> None:
        self.inner.connect(deadline)

    def extend_deadline(self, deadline: float) -> None:
        super().extend_deadline(deadline)
        self.inner.extend_deadline(deadline)

    def copy(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        return self.inner.copy(tensor, src)

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> None:
        self.inner.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("watchdog_only", [False, True], ids=["gloo", "watchdog-only"])
def test_sender_stopped_silently_mid_transfer_aborts_at_the_stall_bound(
    spawn_sender: Callable[..., tuple[subprocess.Popen[str], str]], watchdog_only: bool
) -> None:
    """SIGSTOP of the sending process after the first step (no reset, no error: a dead
    node or a partition): TransferStalledError at the stall bound, far before the deadline,
    whether the transport enforces the bound itself (gloo) or only the watchdog does (NCCL)."""
    tid = uuid.uuid4().hex
    proc, address = spawn_sender(tid, timeout=100.0, gbps=0.0002)  # ~3 s for the whole model
    stopped = threading.Event()

    def stop_sender(step: int) -> None:
        if not stopped.is_set():
            os.kill(proc.pid, signal.SIGSTOP)
            stopped.set()

    s = settings()
    transport: Transport = receiver_transport(s, "gloo", address, tid, device=CPU, registry=registry(s))
    if watchdog_only:
        transport = WatchdogOnly(transport)
    t0 = time.monotonic()
    with pytest.raises(TransferStalledError, match="stalled"):
        run_guarded(transport, lambda t: recv_tensors(t, skeleton_like(model_tensors()), BUCKET,
                                                      on_step=stop_sender),
                    t0 + 100.0, stall=3.0)
    assert stopped.is_set()
    assert time.monotonic() - t0 < 50  # the deadline was 100 s away
    if watchdog_only:
        assert transport.call_timeout == 3.0 and transport.inner.call_timeout == float("inf")  # type: ignore[attr-defined]
    proc.kill()  # a stopped process is still killable; the fixture reaps it


@pytest.mark.timeout(60)
def test_a_sender_that_gives_the_transfer_up_is_seen_at_once_by_its_notice(
    spawn_sender: Callable[..., tuple[subprocess.Popen[str], str]]
) -> None:
    """A sender stopped mid-transfer (its sockets stay open) that left the notice that it
    gave the transfer up (handshake.abandon, as a closing worker does): the receiver's
    guarded transfer reads it once quiet and ends with TransferAbandonedError within
    moments, far before its 30 s stall bound."""
    tid = uuid.uuid4().hex
    proc, address = spawn_sender(tid, timeout=100.0, gbps=0.0002)  # ~3 s for the whole model
    reg = registry()
    stopped = threading.Event()

    def stop_sender(step: int) -> None:
        if not stopped.is_set():
            os.kill(proc.pid, signal.SIGSTOP)
            handshake.abandon(reg, tid)
            stopped.set()

    s = settings()
    transport = receiver_transport(s, "gloo", address, tid, device=CPU, registry=registry(s))
    t0 = time.monotonic()
    with pytest.raises(TransferAbandonedError, match="gave it up"):
        run_guarded(transport, lambda t: recv_tensors(t, skeleton_like(model_tensors()), BUCKET,
                                                      on_step=stop_sender),
                    t0 + 100.0, stall=30.0, abandoned=lambda: handshake.abandoned(reg, tid))
    assert stopped.is_set()
    assert time.monotonic() - t0 < 5.0
    proc.kill()  # a stopped process is still killable; the fixture reaps it


@pytest.mark.parametrize("wording", [
    "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation to complete",
    "[../gloo/transport/tcp/pair.cc:598] Connection closed by peer: Application timeout caused pair closure",
    "Wait timeout after 3000 ms",
])
def test_every_gloo_wording_of_a_timeout_before_the_deadline_is_a_stall(wording: str) -> None:
    """gloo words a per-call timeout in several ways (seen under load); each one, before
    the deadline, is a stall, and a reset is a plain TransferError."""
    s = settings()
    tr = GlooTransport.receiver(s, registry(s), "127.0.0.1:0", "t", device=torch.device("cpu"))
    tr.call_timeout, tr._deadline = 3.0, time.monotonic() + 60  # as run_guarded leaves them
    assert isinstance(tr._error("broadcast", RuntimeError(wording)), TransferStalledError)
    reset = tr._error("broadcast", RuntimeError("Connection reset by peer"))
    assert type(reset) is TransferError


def test_nccl_on_a_cpu_tensor_is_refused_clearly() -> None:
    """The nccl transport on a CPU device: a TransferError naming the device, nothing built."""
    with pytest.raises(TransferError, match="needs a CUDA device, got cpu"):
        NcclTransport.receiver(settings(), registry(), "127.0.0.1:1", "t", device=torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_nccl_without_cuda_says_what_is_missing() -> None:
    """A CUDA device named on a machine without one: a clear TransferError, no CUDA call."""
    with pytest.raises(TransferError, match="needs torch built with CUDA and NCCL"):
        check_available(torch.device("cuda", 0))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("transfers", nargs="+")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--bucket", type=int, default=BUCKET)
    parser.add_argument("--fault", default="")
    parser.add_argument("--at", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gbps", type=float, default=0.0)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--namespace", required=True)
    parsed = parser.parse_args()
    REDIS.update(url=parsed.redis_url, namespace=parsed.namespace)
    serve(parsed)


@pytest.mark.timeout(120)
def test_a_receiver_that_gave_up_frees_its_sender_at_once_though_its_error_is_kept() -> None:
    """A receiver that gives up mid-transfer, its error (and so its traceback) kept as a
    load keeps its last error, closes its connection: the sender fails at its next step,
    not after its own per-call timeout (a holder's send slot held for the stall bound)."""
    want = {f"w{i:02d}": torch.full((1 << 20,), float(i)) for i in range(16)}  # 64 MiB: past the socket buffers
    got = {n: torch.empty_like(t) for n, t in want.items()}
    ended: dict[str, float] = {}

    def send(t: Transport) -> None:
        try:
            send_tensors(t, want, BUCKET)
        finally:
            ended["sender"] = time.monotonic()

    def recv(t: Transport) -> None:
        def on_step(k: int) -> None:
            if k == 1:
                ended["receiver"] = time.monotonic()
                raise TransferError("given up after two steps")
        recv_tensors(t, got, BUCKET, on_step=on_step)

    s_err, r_err = in_process_pair(send, recv, timeout=60)
    assert isinstance(r_err, TransferError) and "given up" in str(r_err)
    assert isinstance(s_err, TransferError), s_err
    assert ended["sender"] - ended["receiver"] < 5.0, ended
