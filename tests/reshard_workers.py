"""Worker processes of the reshard tests: a plain transformer-shaped model (one layer:
q/k/v, o, gate/up, down, a norm, a vocabulary) and its tensor-parallel skeletons in two
schemes, each loaded by a real WeightService against real Redis, gloo between
processes. Reports go back through a pipe; the process then serves until told to stop."""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

import nccl_back
from nccl_back.config import Settings
from nccl_back.load.service import WeightService
from nccl_back.model.identity import ModelSpec
from nccl_back.model.skeleton import build, named_tensors

# Hidden, vocabulary, MLP width (benchmarks/reshard.py scales them through the environment).
D, V, F = (int(os.environ.get(f"RESHARD_{n}", d)) for n, d in (("D", 32), ("V", 64), ("F", 64)))


def checkpoint_shapes() -> dict[str, tuple[int, ...]]:
    return {"embed": (V, D), "q": (D, D), "k": (D // 2, D), "v": (D // 2, D), "o": (D, D),
            "gate": (F, D), "up": (F, D), "down": (D, F), "norm": (D,)}


class Flat(nn.Module):
    """A module whose state_dict names are exactly ``shapes``' names."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for n, s in shapes.items():
            self.register_parameter(n, nn.Parameter(torch.empty(s)))


def tp_shapes(world: int, scheme: str) -> dict[str, tuple[int, ...]]:
    """Scheme "megatron": fused qkv and gate_up column-parallel, o/down row-parallel, the
    vocabulary split by rows; scheme "cols": separate q/k/v split by input columns
    (row-parallel everywhere), the vocabulary split by columns; scheme "rows": every
    matrix split by rows (column-parallel everywhere: each rank's pieces are contiguous
    spans of the files)."""
    w = world
    if scheme == "rows":
        return {n: (s[0] // w, s[1]) if len(s) == 2 else s for n, s in checkpoint_shapes().items()}
    if scheme == "megatron":
        return {"qkv": ((D + D) // w, D), "o": (D, D // w), "gate_up": (2 * F // w, D),
                "down": (D, F // w), "norm": (D,), "embed": (V // w, D)}
    return {n: (s[0], s[1] // w) if len(s) == 2 else s for n, s in checkpoint_shapes().items()}


def describe(rank: int, world: int, scheme: str) -> dict[str, nccl_back.model.layout.TensorLayout]:
    from nccl_back.model.layout import TensorLayout, column, concat, row, shard
    out: dict[str, TensorLayout] = {}
    if scheme == "whole":
        return out
    if scheme == "megatron":
        out["qkv"] = concat(0, shard("q", 0, rank, world, D), shard("k", 0, rank, world, D // 2),
                            shard("v", 0, rank, world, D // 2))
        out["gate_up"] = concat(0, shard("gate", 0, rank, world, F), shard("up", 0, rank, world, F))
        out["o"] = row("o", rank, world, D)
        out["down"] = row("down", rank, world, F)
        out["embed"] = column("embed", rank, world, V)
    else:
        for n, s in checkpoint_shapes().items():
            if len(s) == 2:
                out[n] = column(n, rank, world, s[0]) if scheme == "rows" else row(n, rank, world, s[1])
    return out


def expected(ckpt: str, rank: int, world: int, scheme: str) -> dict[str, torch.Tensor]:
    """This rank's tensors, cut from the checkpoint files by hand."""
    full: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            full.update(load_file(os.path.join(ckpt, f)))
    if scheme in ("plain", "whole"):
        return full
    out = {}
    for n, lay in describe(rank, world, scheme).items():
        parts = [full[p.source].narrow(p.dim, p.start, p.stop - p.start) for p in lay.parts]
        out[n] = torch.cat(parts, lay.dim)
    for n, t in full.items():
        if n not in out and n in tp_shapes(world, scheme):
            out[n] = t
    return out


def _fail_shared_reads() -> None:
    """This rank's reads of its blocks of shared tensors fail (the ranged load)."""
    from nccl_back.errors import StorageError
    from nccl_back.model.ranged import RangedLoad

    def fail(self: RangedLoad, c: Any) -> Any:
        raise StorageError(f"injected: reading {c.need.name} rows {c.rows}")

    RangedLoad.read_chunk = fail  # type: ignore[method-assign]


def rank_main(env: dict[str, str], ckpt: str, settings: dict[str, Any], scheme: str,
              conn: Any, stop: Any, fault: str | None = None, spec: ModelSpec | None = None,
              device: str = "cpu") -> None:
    """One rank of a library group; ``device`` "cuda": its model on the GPU (its
    transfers over NCCL; the group's own agreement stays on gloo)."""
    os.environ.update(env)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    report: dict[str, Any] = {"group": env["MASTER_PORT"], "rank": rank}
    try:
        group = None
        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world)
            group = dist.group.WORLD
        s = Settings(**settings)
        if fault == "fail_shared_read" and rank == 1:
            _fail_shared_reads()
        if fault == "corrupt_send" or (fault == "corrupt_send_rank1" and rank == 1):
            from workers import _install_fault  # type: ignore[import-not-found]

            _install_fault("corrupt_send")  # what this rank serves has a byte changed
        # ``spec``: listed by the test (then the files may change before the load).
        spec = spec or ModelSpec.from_dir(ckpt, cache_dir=s.cache_dir)
        shapes = checkpoint_shapes() if scheme in ("plain", "whole") else tp_shapes(world, scheme)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        model = build(lambda: Flat(shapes), device)
        sh = None if scheme == "plain" else nccl_back.sharding(model, spec, describe(rank, world, scheme), s)
        with WeightService(s, worker_id=f"g{env['MASTER_PORT']}-{rank}") as svc:
            result = svc.load(model, spec, group, sharding=sh)
            got = {n: t.cpu() for n, t in named_tensors(model)[0].items()}
            want = expected(ckpt, rank, world, scheme)
            report.update(source=result.source, bytes=result.bytes, peer_id=result.peer_id,
                          fallback_reason=result.fallback_reason, seconds=result.seconds,
                          own_bytes=sum(t.numel() * t.element_size() for t in got.values()),
                          identical=sorted(got) == sorted(want) and all(
                              got[n].contiguous().view(torch.uint8).tolist()
                              == want[n].contiguous().view(torch.uint8).tolist() for n in want),
                          timings=dict(result.timings))
            conn.send(report)
            if fault == "exit_after_load":
                os._exit(0)
            stop.wait(120)
    except Exception as e:
        report.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        conn.send(report)
