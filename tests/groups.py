"""Multi-rank workers for the tests: each worker is N separate processes joined in its
own gloo group, started the way ``torchrun`` starts them (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` in the environment; ``env://`` rendezvous)."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import time
from typing import Any

from nccl_back.dev.servers import free_port

import workers

# Forked from a server that imported torch and nccl_back once: a spawned process pays
# that import again (tens of seconds each on a loaded 2-core machine). The fork server
# itself runs no threads, so its children start clean.
CTX = mp.get_context("forkserver")
#: What the one fork server of a pytest process imports, for every test module's children
#: (tests/conftest.py sets it again once collection ends: the last module to set a preload
#: wins). A name that does not import (diffusers missing) is skipped by multiprocessing.
PRELOAD = ["torch", "torch.distributed", "nccl_back.load.service", "models", "workers",
           "reshard_workers", "pipelines", "diffusers", "diffusers.models.unets.unet_2d",
           "diffusers.models.autoencoders.vq_model", "diffusers.schedulers.scheduling_ddim"]
CTX.set_forkserver_preload(PRELOAD)


class Groups:
    """Starts multi-rank workers and collects one report per rank; kills leftovers."""

    def __init__(self, ckpt: str, settings: dict[str, Any]) -> None:
        self.ckpt = ckpt
        self.settings = dict(settings)
        self.stop = CTX.Event()
        self.readers: list[Any] = []
        self.procs: list[Any] = []

    def start(
        self, world: int = 2, *, settings: dict[str, Any] | None = None,
        faults: dict[int, str] | None = None, withdraw: tuple[int, ...] = (),
        delays: dict[int, float] | None = None,
    ) -> str:
        """Start one worker of ``world`` ranks; returns its id (the group's port).

        ``faults``/``delays``: per rank, see :func:`workers.rank_main`.
        """
        port = str(free_port())
        for rank in range(world):
            env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            reader, writer = CTX.Pipe(duplex=False)
            self.readers.append(reader)
            p = CTX.Process(
                target=workers.rank_main, daemon=True,
                args=(env, self.ckpt, {**self.settings, **(settings or {})}, writer, self.stop),
                kwargs={"fault": (faults or {}).get(rank), "withdraw": rank in withdraw,
                        "delay": (delays or {}).get(rank, 0.0)},
            )
            p.start()
            self.procs.append(p)
        return port

    def reports(self, n: int, timeout: float = 60) -> list[dict[str, Any]]:
        """The next ``n`` reports (any worker, any rank), sorted by (group, rank)."""
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"only {len(got)} of {n} ranks reported in {timeout:g} s: {got}")
            for conn in mp.connection.wait(self.readers, timeout=left):
                try:
                    got.append(conn.recv())  # type: ignore[union-attr]
                except EOFError:
                    self.readers.remove(conn)
        return sorted(got, key=lambda r: (r["group"], r["rank"]))

    def by_group(self, reports: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for r in reports:
            out.setdefault(r["group"], []).append(r)
        return out

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
