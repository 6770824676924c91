"""Worker processes for the multi-process tests (run via multiprocessing 'spawn').

Each function is a real worker: it builds a skeleton, opens a WeightService against a
real Redis, loads, and reports what happened through a queue. Nothing is mocked.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Any

import torch
from safetensors.torch import load_file

from nccl_back.config import Settings
from nccl_back.load.service import WeightService
from nccl_back.model.identity import ModelSpec
from nccl_back.model.skeleton import build, named_tensors
from nccl_back.timing import CAPPABLE

from models import TinyTransformer  # type: ignore[import-not-found]


def settings_for(redis_url: str, namespace: str, cache_dir: str, **overrides: Any) -> Settings:
    """Loopback-only settings for a test worker."""
    base: dict[str, Any] = {
        "redis_url": redis_url,
        "namespace": namespace,
        "advertise_host": "127.0.0.1",
        "cache_dir": cache_dir,
        "peer_ttl": 3.0,
        "transfer_timeout": 20.0,
        "handshake_timeout": 5.0,
    }
    base.update(overrides)
    # Derived bounds (claim_ttl, busy_wait, ...) are no settings: a test carves them shorter.
    caps = {k: base.pop(k) for k in list(base) if k in CAPPABLE}
    settings = Settings(**base)
    for name, seconds in caps.items():
        if seconds >= getattr(settings, name):
            raise ValueError(f"{name}={seconds}: a cap must lower the derived {getattr(settings, name)}")
    return settings.capped(**caps) if caps else settings


def matches_checkpoint(model: Any, ckpt: str) -> bool:
    """Every tensor bit-identical to the checkpoint's files."""
    files = sorted(p for p in os.listdir(ckpt) if p.endswith(".safetensors"))
    expected: dict[str, torch.Tensor] = {}
    for f in files:
        expected.update(load_file(os.path.join(ckpt, f)))
    tensors, aliases = named_tensors(model)
    for name, t in tensors.items():
        if name not in expected or not torch.equal(expected[name], t.cpu()):
            return False
    return len(tensors) == len(expected)


def make_model(model_kwargs: dict[str, Any] | None, device: str = "cpu") -> Any:
    kwargs = dict(model_kwargs or {})
    return build(lambda: TinyTransformer(**kwargs), device)


def worker_main(
    role: str,
    ckpt: str,
    settings_kwargs: dict[str, Any],
    out: Any,
    stop: Any,
    *,
    model_kwargs: dict[str, Any] | None = None,
    serve_for: float = 60.0,
    fault: str | None = None,
    adopt_as: dict[str, Any] | None = None,
    go: Any = None,
    ready: Any = None,
    device: str = "cpu",
    env: dict[str, str] | None = None,
) -> None:
    """Load (peer first), report, then keep serving until ``stop`` is set or time runs out.

    ``fault``: ``kill_member_1_on_share`` SIGKILLs member 1 of a cooperative download
    as the first step of its part lands, before it serves; ``corrupt_member_1_share``
    makes it serve one wrong byte of its part; ``kill_member_1_mid_share`` / ``stop_member_1_mid_share`` SIGKILL /
    SIGSTOP it at the third step of its part's send; ``kill_member_1_before_announce`` /
    ``stop_member_1_before_announce`` as it is named, before it announces its endpoint;
    ``kill_member_1_on_request`` / ``stop_member_1_on_request`` as the elected worker's
    request for its part reaches its endpoint, before the handshake is answered;
    ``slow_member_1_share`` has member 1 take 1 s per step of its share;
    ``kill_first_elected_in_gather=PATH``
    SIGKILLs the first worker to gather a cooperative download (the one that creates
    PATH). ``kill_mid_send`` / ``kill_mid_recv`` SIGKILL this process after a few
    broadcasts of a transfer (a real crash mid-transfer); ``corrupt_send`` flips one
    byte of the first step of every send on the wire, ``corrupt_send_last`` of the last
    step (tests/faults.py); ``corrupt_relay_seat=N``: the member seated at cohort
    position N flips every byte of every step its relay endpoint forwards. ``adopt_as``: instead of
    loading, publish a model built with these kwargs under the checkpoint's version
    (to stage a peer whose manifest differs). ``go``: an Event to wait for before
    loading (everything else is ready, so the load starts the moment it is set);
    ``ready``: a Semaphore released once, just before that wait. ``slow_download`` fills
    each tensor in 50 ms; ``kill_mid_stream`` SIGKILLs halfway through, and
    ``kill_before_truth`` once every byte streamed, before its ground truth is written.
    ``device``: where the model lives ("cuda": its transfers go over NCCL); ``env``:
    set first (NCCL reads its own at its first communicator).
    """
    os.environ.update(env or {})
    import faulthandler
    import sys

    if os.environ.get("NB_TEST_LOG"):  # a worker's log lines on stderr, for debugging a test
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"{role} %(name)s %(message)s")

    # If a worker ever hangs, its stacks reach the test's captured stderr.
    faulthandler.dump_traceback_later(40, exit=True)
    try:
        settings = settings_for(**settings_kwargs)
        if fault:
            _install_fault(fault)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        model = make_model(model_kwargs, device)
        spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
        with WeightService(settings, worker_id=f"{role}-{os.getpid()}") as svc:
            if adopt_as is not None:
                info = svc.serve(make_model(adopt_as), spec)
                out.send({"role": role, "pid": os.getpid(), "peer_id": info.peer_id})
                while not stop.is_set():
                    time.sleep(0.05)
                return
            if go is not None:
                faulthandler.cancel_dump_traceback_later()
                if ready is not None:
                    ready.release()
                go.wait(120)
                faulthandler.dump_traceback_later(40, exit=True)
            t0 = time.monotonic()
            blamed = _Blamed()
            logging.getLogger("nccl_back").addHandler(blamed)
            result = svc.load(model, spec)
            out.send({
                "role": role, "load_seconds": time.monotonic() - t0, "pid": os.getpid(), "source": result.source,
                "peer_id": result.peer_id, "fallback_reason": result.fallback_reason,
                "verified": result.verified, "identical": matches_checkpoint(model, ckpt),
                "seconds": result.seconds, "bytes": result.bytes,
                "storage_bytes": result.storage_bytes, "peer_bytes": result.peer_bytes,
                "worker_id": svc.worker_id, "timings": result.timings,
                "blamed": sorted(blamed.peers),
            })
            faulthandler.cancel_dump_traceback_later()
            deadline = time.monotonic() + serve_for
            while time.monotonic() < deadline and not stop.is_set():
                time.sleep(0.05)
    except BaseException as e:  # report, don't hang the parent
        out.send({"role": role, "pid": os.getpid(), "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc()})


class _Blamed(logging.Handler):
    """The sources a load blamed for bytes that failed its verification (its events)."""

    def __init__(self) -> None:
        super().__init__()
        self.peers: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        e = getattr(record, "nccl_back", {})
        if (e.get("event") in ("peer_attempt_failed", "relay_upstream_failed")
                and e.get("reason") == "verification_failed"):
            self.peers.add(str(e.get("peer")))


class _KillAfter:
    """Wraps a transport: send ``sig`` (SIGKILL: a crash; SIGSTOP: a silent stop, as a
    dead node or a partition looks, no reset) to the process at the ``n``-th broadcast."""

    def __init__(self, inner: Any, n: int, sig: int = signal.SIGKILL) -> None:
        self._inner, self._n, self._sig = inner, n, sig

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # The watchdog sets the stall bound (call_timeout) on what it was handed.
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def copy(self, tensor: torch.Tensor, src: int = 0) -> Any:
        self._n -= 1
        if self._n <= 0:
            os.kill(os.getpid(), self._sig)
        return self._inner.copy(tensor, src)


def _install_fault(fault: str) -> None:
    from nccl_back.load import asking
    from nccl_back.load import storage_phase as storage
    from nccl_back.transport import send as sender  # the send path holders (and relays) share

    if fault.startswith("kill_first_elected_in_gather="):
        from nccl_back.load import storage_phase as storage_path

        orig_gather = storage_path.gather_parts
        mark = fault.partition("=")[2]

        def gather(*a: Any, **k: Any) -> Any:
            try:  # the first worker to gather dies as it starts; any later one gathers
                os.close(os.open(mark, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return orig_gather(*a, **k)
            time.sleep(0.3)  # the members are reading their shares
            os.kill(os.getpid(), signal.SIGKILL)
            return None

        storage_path.gather_parts = gather  # type: ignore[assignment]
    elif fault in ("kill_member_1_before_announce", "stop_member_1_before_announce"):
        from nccl_back.transport.relay.seating import Cohorts

        orig_open = Cohorts.open_share

        def open_share(self: Any, replica: Any, log: Any, member: int) -> Any:
            if member == 1:
                os.kill(os.getpid(), signal.SIGKILL if fault.startswith("kill") else signal.SIGSTOP)
            return orig_open(self, replica, log, member)

        Cohorts.open_share = open_share  # type: ignore[method-assign]
    elif fault in ("kill_member_1_on_request", "stop_member_1_on_request"):
        from nccl_back.transport.relay import seating as relay_receive
        from nccl_back.transport.relay.forwarder import RelayServer

        orig_start, orig_admit = relay_receive.share, RelayServer._admit
        member_1: list[Any] = []

        def start_share(p: Any, member: int) -> Any:
            got = orig_start(p, member)
            if member == 1:
                member_1.append(got.server)
            return got

        def admit(self: Any, request: Any) -> None:
            if self in member_1:  # the elected worker asks for the part: never answered
                os.kill(os.getpid(), signal.SIGKILL if fault.startswith("kill") else signal.SIGSTOP)
            orig_admit(self, request)

        relay_receive.share = start_share  # type: ignore[assignment]
        RelayServer._admit = admit  # type: ignore[method-assign]
    elif fault in ("kill_member_1_mid_share", "stop_member_1_mid_share"):
        from nccl_back.transport.relay.seating import Cohorts as ShareCohorts

        orig_part, orig_share = sender.send_tensors, ShareCohorts.open_share
        fired: list[bool] = []
        named_1: list[bool] = []

        def named(self: Any, replica: Any, log: Any, member: int) -> Any:
            named_1.append(member == 1)
            return orig_share(self, replica, log, member)

        def send_part(transport: Any, *a: Any, **k: Any) -> Any:
            # Member 1's send of its whole part (i, n) to the elected worker: stop at step 3.
            # Known by the part it sends (in the process named member 1: a holder sends a
            # tree's part (1, 2) too), not by the order of its share read and the elected
            # worker's request (which a loaded machine swaps).
            part = k.get("part")
            if not fired and any(named_1) and part is not None and len(part) == 2 and part[0] == 1:
                fired.append(True)
                sig = signal.SIGKILL if fault == "kill_member_1_mid_share" else signal.SIGSTOP
                return orig_part(_KillAfter(transport, 3, sig), *a, **k)
            return orig_part(transport, *a, **k)

        sender.send_tensors = send_part  # type: ignore[assignment]
        ShareCohorts.open_share = named  # type: ignore[method-assign]
    elif fault == "slow_member_1_share":
        from nccl_back.load import cooperative as slow_coop

        orig_slow = slow_coop.read_share

        def slow(*a: Any, **k: Any) -> Any:
            if a[5] == 1 and k.get("on_step") is not None:
                release = k["on_step"]

                def on_step(j: int) -> None:
                    time.sleep(1.0)  # a slow link: the share takes longer than the stall bound
                    release(j)

                k["on_step"] = on_step
            return orig_slow(*a, **k)

        slow_coop.read_share = slow  # type: ignore[assignment]
    elif fault in ("kill_member_1_on_share", "corrupt_member_1_share"):
        from nccl_back.load import cooperative
        from nccl_back.transport.parts import parts

        orig_share = cooperative.read_share

        def share(*a: Any, **k: Any) -> Any:
            if a[5] == 1 and k.get("on_step") is not None:  # member 1 (the elected worker is 0)
                steps, tensors, release = a[3], a[6], k["on_step"]
                first_k = parts(steps, a[4])[1][0]  # the first step of its own part

                def on_step(j: int) -> None:
                    if j == first_k:  # landed, not yet gone out
                        if fault == "kill_member_1_on_share":
                            os.kill(os.getpid(), signal.SIGKILL)
                        slot = steps[j].slots[0]
                        at = slot.offset if steps[j].direct else 0
                        tensors[slot.name].view(-1).view(torch.uint8)[at] ^= 0xFF  # one wrong byte
                    release(j)

                k["on_step"] = on_step
            return orig_share(*a, **k)

        cooperative.read_share = share  # type: ignore[assignment]
    elif fault == "kill_mid_send":
        orig_send = sender.send_tensors

        def send(transport: Any, *a: Any, **k: Any) -> Any:
            return orig_send(_KillAfter(transport, 3), *a, **k)

        sender.send_tensors = send  # type: ignore[assignment]
    elif fault == "stop_mid_send":
        orig_stop = sender.send_tensors

        def stop(transport: Any, *a: Any, **k: Any) -> Any:
            return orig_stop(_KillAfter(transport, 3, signal.SIGSTOP), *a, **k)

        sender.send_tensors = stop  # type: ignore[assignment]
    elif fault == "stop_mid_recv":
        orig_stop_recv = asking.recv_tensors

        def stop_recv(transport: Any, *a: Any, **k: Any) -> Any:
            return orig_stop_recv(_KillAfter(transport, 3, signal.SIGSTOP), *a, **k)

        asking.recv_tensors = stop_recv  # type: ignore[assignment]
    elif fault == "kill_mid_recv":
        orig_recv = asking.recv_tensors

        def recv(transport: Any, *a: Any, **k: Any) -> Any:
            return orig_recv(_KillAfter(transport, 3), *a, **k)

        asking.recv_tensors = recv  # type: ignore[assignment]
    elif fault == "corrupt_send":
        from faults import CorruptingTransport  # type: ignore[import-not-found]

        orig_corrupt = sender.send_tensors

        def corrupt(transport: Any, *a: Any, **k: Any) -> Any:
            # Byte 3: the most significant byte of a float32 first element.
            return orig_corrupt(CorruptingTransport(transport, byte=3), *a, **k)

        sender.send_tensors = corrupt  # type: ignore[assignment]
    elif fault == "corrupt_send_last":
        from faults import CorruptingTransport  # type: ignore[import-not-found]

        from nccl_back.transport import parts, plan

        orig_last = sender.send_tensors

        def corrupt_last(transport: Any, tensors: Any, bucket: int, **k: Any) -> Any:
            steps, start, part = plan(tensors, bucket), k.get("start", 0), k.get("part")
            todo = range(len(steps)) if part is None else parts(steps, part[1])[part[0]]
            last = sum(1 for j in todo if j >= start)  # the last step sent
            return orig_last(CorruptingTransport(transport, byte=3, step=last), tensors, bucket, **k)

        sender.send_tensors = corrupt_last  # type: ignore[assignment]
    elif fault.startswith("corrupt_relay_seat="):
        from faults import garble_relay_sends  # type: ignore[import-not-found]

        garble_relay_sends(int(fault.partition("=")[2]))
    elif fault == "slow_send":
        orig_slow = sender.send_tensors

        def slow(transport: Any, *a: Any, **k: Any) -> Any:
            time.sleep(1.0)
            return orig_slow(transport, *a, **k)

        sender.send_tensors = slow  # type: ignore[assignment]
    elif fault == "kill_mid_download":
        def die(*a: Any, **k: Any) -> Any:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)

        storage.load_from_storage = die  # type: ignore[assignment]
    elif fault in ("slow_download", "kill_mid_stream", "kill_before_truth"):
        # Each tensor's fill takes 50 ms (a slow storage link); kill_mid_stream: SIGKILL
        # once half of them are in place, while waiters receive the download's stream;
        # kill_before_truth: SIGKILL once every byte streamed, before the ground truth
        # its waiters check them against is written.
        from nccl_back.model import loader

        if fault == "kill_before_truth":
            from nccl_back.load import publish

            def no_truth(*a: Any, **k: Any) -> None:
                time.sleep(1.0)  # the stream's last sends land first
                os.kill(os.getpid(), signal.SIGKILL)

            publish.claim_ground_truth = no_truth  # type: ignore[assignment]

        orig_copied = loader._Tracker.copied

        def copied(self: Any, c: Any) -> None:
            time.sleep(0.05)
            orig_copied(self, c)
            if fault == "kill_mid_stream" and self.done >= self.total // 2:
                os.kill(os.getpid(), signal.SIGKILL)

        loader._Tracker.copied = copied  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown fault {fault!r}")


PIPELINE = {"transformer": {"n_layers": 2, "d": 32}, "vae": {"n_layers": 1, "d": 16}}


def make_part(rank: int) -> dict[str, Any]:
    """Rank 0 holds the transformer, rank 1 the VAE (a 2-stage pipeline)."""
    name = "transformer" if rank == 0 else "vae"
    kwargs = PIPELINE[name]
    return {name: build(lambda: TinyTransformer(**kwargs))}


def group_worker(
    rank: int, port: int, ckpt: str, settings_kwargs: dict[str, Any], out: Any, stop: Any,
    withdraw_rank: int | None = None,
) -> None:
    """One rank of a 2-rank worker (its own gloo group); loads its stage, then serves."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=60))
        settings = settings_for(**settings_kwargs)
        model = make_part(rank)
        spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
        with WeightService(settings, worker_id=f"g{port}-{rank}") as svc:
            result = svc.load(model, spec, group=dist.group.WORLD)
            if withdraw_rank == rank:
                svc.withdraw()
            tensors, _ = named_tensors(model)
            files = sorted(p for p in os.listdir(ckpt) if p.endswith(".safetensors"))
            expected: dict[str, torch.Tensor] = {}
            for f in files:
                expected.update(load_file(os.path.join(ckpt, f)))
            identical = all(torch.equal(expected[n], t) for n, t in tensors.items())
            out.send({"rank": rank, "source": result.source, "identical": identical,
                      "verified": result.verified, "fallback_reason": result.fallback_reason})
            while not stop.is_set():
                time.sleep(0.05)
        dist.destroy_process_group()
    except BaseException as e:
        out.send({"rank": rank, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()})


def rank_main(
    env: dict[str, str], ckpt: str, settings_kwargs: dict[str, Any], out: Any, stop: Any,
    *, fault: str | None = None, withdraw: bool = False, timeout: float = 60.0,
    delay: float = 0.0,
) -> None:
    """One rank of a multi-rank worker, started as ``torchrun`` would start it.

    ``env`` carries ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``; the rank
    joins its own gloo group through ``env://`` (the default group, as a TP/PP worker
    would), loads its pipeline stage (:func:`make_part`), reports, then serves until
    ``stop``. ``fault``: see :func:`_install_fault`; ``raise_in_verify`` makes the
    integrity check raise a non-library error (as a CUDA error while hashing would).
    ``delay``: seconds this rank waits before ``load`` (a rank whose skeleton builds slower).
    """
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(env)
    rank = int(env["RANK"])
    report: dict[str, Any] = {"rank": rank, "group": env["MASTER_PORT"], "pid": os.getpid()}
    try:
        if fault == "raise_in_verify":
            from nccl_back.model import integrity

            def broken(*a: Any, **k: Any) -> None:
                raise RuntimeError("simulated CUDA error while hashing")

            integrity.compare = broken  # type: ignore[assignment]
        elif fault:
            _install_fault(fault)
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
        settings = settings_for(**settings_kwargs)
        model = make_part(rank)
        spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
        with WeightService(settings, worker_id=f"g{env['MASTER_PORT']}-{rank}") as svc:
            time.sleep(delay)
            t0 = time.monotonic()
            try:
                result = svc.load(model, spec, group=dist.group.WORLD)
            except Exception as e:
                report.update(error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0,
                              failed_rank=getattr(e, "failed_rank", None))
                out.send(report)
                return
            if withdraw:
                svc.withdraw()
            report.update(source=result.source, identical=matches_part(model, ckpt),
                          verified=result.verified, fallback_reason=result.fallback_reason,
                          peer_id=result.peer_id, worker_id=svc.worker_id,
                          seconds=time.monotonic() - t0)
            out.send(report)
            while not stop.is_set():
                time.sleep(0.05)
    except BaseException as e:  # report, don't hang the parent
        report.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        out.send(report)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def matches_part(model: dict[str, Any], ckpt: str) -> bool:
    """Every tensor of a pipeline stage bit-identical to the checkpoint's."""
    expected: dict[str, torch.Tensor] = {}
    for f in sorted(p for p in os.listdir(ckpt) if p.endswith(".safetensors")):
        expected.update(load_file(os.path.join(ckpt, f)))
    tensors, _ = named_tensors(model)
    return all(n in expected and torch.equal(expected[n], t) for n, t in tensors.items())
