"""Probe how torch's ProcessGroupNCCL behaves on this GPU machine (two ranks, one GPU).

Runs every variant at once (each a pair of processes with its own store and NCCL
host ids), each a 1 MiB broadcast rank 0 -> 1 under a 25 s limit, and prints one JSON
line per variant. Raw variants use torch alone; ``ours`` goes through nccl_back's
NcclTransport (non-blocking, the communicator made by the first collective).

    python scripts/nccl_probe.py
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

LIMIT = 25.0
VARIANTS = {
    # name: (nonblocking, eager, extra env, poll with is_completed (else wait()))
    "raw_blocking": (False, False, {}, False),
    "raw_blocking_eager": (False, True, {}, True),
    "raw_nonblocking_eager_poll": (True, True, {}, True),
    "raw_nonblocking_lazy_poll": (True, False, {}, True),
    "raw_nonblocking_eager_wait": (True, True, {}, False),
    "raw_nonblocking_eager_connect0": (True, True, {"NCCL_RUNTIME_CONNECT": "0"}, True),
    "ours": (True, False, {}, True),
}


def child(name: str, rank: int, port: int, q: Any) -> None:
    nonblocking, eager, extra, poll = VARIANTS[name]
    os.environ.update({"NCCL_HOSTID": f"probe-{name}-{rank}", "NCCL_SOCKET_IFNAME": "lo",
                       "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN",
                       "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
                       "TORCH_NCCL_NONBLOCKING_TIMEOUT": "15", **extra})
    import faulthandler

    faulthandler.dump_traceback_later(LIMIT - 4, exit=False)  # where a stuck thread sits
    info: dict[str, Any] = {"variant": name, "rank": rank}
    start = time.monotonic()
    try:
        import torch
        import torch.distributed as dist

        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        x = torch.full((1 << 20,), 7 if rank == 0 else 0, dtype=torch.uint8, device=dev)
        if name.startswith("ours"):
            from nccl_back.config import Settings
            from nccl_back.coord.registry import Registry
            from nccl_back.transport import open_rendezvous, receiver_transport, run_guarded

            # Our transport bootstraps through Redis (the parent's, see main()).
            s = Settings(advertise_host="127.0.0.1",
                         redis_url=os.environ["PROBE_REDIS_URL"], namespace=f"probe{port}")
            reg = Registry(s)
            tr = (open_rendezvous(s, "nccl", device=dev, registry=reg).sender("p") if rank == 0
                  else receiver_transport(s, "nccl", "127.0.0.1:0", "p", device=dev, registry=reg))
            run_guarded(tr, lambda t: t.copy(x, 0).wait(), time.monotonic() + LIMIT - 3)
        else:
            store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=LIMIT))
            opts = dist.ProcessGroupNCCL.Options()
            if nonblocking:
                cfg = opts.config
                cfg.blocking = 0
                opts.config = cfg
            opts._timeout = timedelta(seconds=60)
            pg = dist.ProcessGroupNCCL(dist.PrefixStore("p/", store), rank, 2, opts)
            info["has_is_initialized"] = hasattr(pg, "_is_initialized")
            if eager:
                t = time.monotonic()
                pg.eager_connect_single_device(dev)
                info["eager_s"] = round(time.monotonic() - t, 3)
                if hasattr(pg, "_is_initialized"):
                    end = time.monotonic() + 10
                    while not pg._is_initialized() and time.monotonic() < end:
                        time.sleep(0.001)
                    info["initialized_s"] = round(time.monotonic() - t, 3)
            opt = dist.BroadcastOptions()
            opt.rootRank, opt.rootTensor = 0, 0
            t = time.monotonic()
            work = pg.broadcast([x], opt)
            info["issue_s"] = round(time.monotonic() - t, 3)
            if poll:
                end = time.monotonic() + LIMIT - 5
                while not work.is_completed() and time.monotonic() < end:
                    time.sleep(0.001)
                info["completed"] = bool(work.is_completed())
            work.wait()
            torch.cuda.synchronize()
            pg.abort()
        info["ok"] = bool((x == 7).all().item())
    except BaseException:  # noqa: BLE001 - reported
        info["error"] = traceback.format_exc()[-600:]
    info["seconds"] = round(time.monotonic() - start, 2)
    info["threads"] = [t.name for t in threading.enumerate() if t.name.startswith("nccl-back")]
    q.put(info)


def main() -> int:
    sys.path.insert(0, os.getcwd())
    from nccl_back.dev.servers import LocalRedis, free_port

    with LocalRedis() as redis:
        os.environ["PROBE_REDIS_URL"] = redis.url  # inherited by the spawned children
        return _probe(free_port)


def _probe(free_port: Any) -> int:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for name in [n for n in VARIANTS if not sys.argv[1:] or n in sys.argv[1:]]:
        port = free_port()
        for rank in (0, 1):
            p = ctx.Process(target=child, args=(name, rank, port, q), daemon=True)
            p.start()
            procs.append(p)
    results: dict[str, list[dict[str, Any]]] = {
        n: [] for n in VARIANTS if not sys.argv[1:] or n in sys.argv[1:]}
    end = time.monotonic() + LIMIT + 40
    while sum(map(len, results.values())) < len(procs) and time.monotonic() < end:
        try:
            r = q.get(timeout=1)
            results[r["variant"]].append(r)
        except Exception:  # noqa: BLE001 - queue.Empty
            pass
    for p in procs:
        if p.is_alive():
            p.kill()
    for name, rs in results.items():
        ok = len(rs) == 2 and all(r.get("ok") for r in rs)
        print(json.dumps({"variant": name, "pass": ok, "ranks": sorted(rs, key=lambda r: r["rank"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
