"""One tensor-parallel rank of ``test_vllm_layout``: vLLM's layers, loaded by vLLM's own
weight loaders from checkpoint tensors, described by :mod:`nccl_back.engines.vllm_layout`.

``python layout_worker.py --rank R --world W --port P --model DIR --out FILE`` joins a
real gloo group of ``W`` processes (vLLM's ``init_distributed_environment``), builds
each layer kind and the tiny Llama, and writes per case either ``"ok"`` (the pieces the
description names, cut from the checkpoint tensors and concatenated with zeros for
padding, equal what vLLM's loader put in the parameter, byte for byte) or the error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

DT = torch.bfloat16


def assemble(t: Any, ckpt: Mapping[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor a description says: slices of checkpoint tensors and zeros, concatenated."""
    from nccl_back.model.layout import Padding

    parts = []
    for p in t.parts:
        if isinstance(p, Padding):
            size = list(shape)
            size[t.dim] = p.size
            parts.append(torch.zeros(size, dtype=DT))
        else:
            parts.append(ckpt[p.source].narrow(p.dim, p.start, p.stop - p.start))
    return torch.cat(parts, dim=t.dim)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_layer(layer: nn.Module, prefix: str, ckpt: Mapping[str, torch.Tensor],
                loads: list[tuple[str, str, Any]]) -> dict[str, Any]:
    """Load ``loads`` ``(param, checkpoint name, shard id)`` with the layer's own weight
    loaders, describe each parameter, compare. Returns the descriptions (JSON)."""
    from nccl_back.engines.vllm_layout import describe_tensor

    sources: dict[str, list[tuple[str, Any]]] = {}
    for leaf, src, shard in loads:
        param = getattr(layer, leaf)
        loader = param.weight_loader
        if shard is None:
            loader(param, ckpt[src])
        else:
            loader(param, ckpt[src], shard)
        sources.setdefault(leaf, []).append((src, shard))
    out = {}
    for leaf, srcs in sources.items():
        param = getattr(layer, leaf)
        t = describe_tensor(layer, f"{prefix}.{leaf}", leaf, tuple(param.shape), srcs)
        got = assemble(t, ckpt, tuple(param.shape))
        if not same_bytes(got, param.data):
            raise AssertionError(f"{prefix}.{leaf}: description {t} differs from what vLLM loaded")
        out[leaf] = [t.dim, [list(vars(p).values()) for p in t.parts]]
    return out


def layer_cases(rank: int) -> dict[str, Callable[[], Any]]:
    from vllm.model_executor.layers import layernorm
    from vllm.model_executor.layers import linear as L
    from vllm.model_executor.layers import vocab_parallel_embedding as V

    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(DT)

    H = 128
    ck = {
        "q": rnd(128, H), "k1": rnd(32, H), "v1": rnd(32, H), "k2": rnd(64, H), "v2": rnd(64, H),
        "qb": rnd(128), "kb1": rnd(32), "vb1": rnd(32), "qkv": rnd(192, H),
        "gate": rnd(256, H), "up": rnd(256, H), "col": rnd(256, H), "colb": rnd(256),
        "row": rnd(H, 256), "rowb": rnd(H), "rep": rnd(64, H), "repb": rnd(64),
        "emb": rnd(500, H), "head": rnd(500, H), "headb": rnd(500), "norm": rnd(H),
    }

    def qkv(kv: int, bias: bool) -> L.QKVParallelLinear:
        return L.QKVParallelLinear(H, 32, 4, kv, bias=bias, params_dtype=DT)

    class MyQKV(L.QKVParallelLinear):
        """A subclass: its loader may cut otherwise, so it is not described."""

    class Unknown(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, dtype=DT), requires_grad=False)

    return {
        # One KV head, TP=2: both ranks hold a replica of it.
        "qkv_replicated_kv": lambda: check_layer(qkv(1, True), "qkv1", ck, [
            ("weight", "q", "q"), ("weight", "k1", "k"), ("weight", "v1", "v"),
            ("bias", "qb", "q"), ("bias", "kb1", "k"), ("bias", "vb1", "v")]),
        "qkv_gqa": lambda: check_layer(qkv(2, False), "qkv2", ck, [
            ("weight", "q", "q"), ("weight", "k2", "k"), ("weight", "v2", "v")]),
        # The fused tensor on disk (as Phi-3): vLLM splits it at q, k, v offsets.
        "qkv_fused_on_disk": lambda: check_layer(qkv(1, False), "qkvf", ck, [("weight", "qkv", None)]),
        "merged_column": lambda: check_layer(
            L.MergedColumnParallelLinear(H, [256, 256], bias=False, params_dtype=DT), "gate_up", ck,
            [("weight", "gate", 0), ("weight", "up", 1)]),
        "column": lambda: check_layer(L.ColumnParallelLinear(H, 256, bias=True, params_dtype=DT),
                                      "col", ck, [("weight", "col", None), ("bias", "colb", None)]),
        "row": lambda: check_layer(L.RowParallelLinear(256, H, bias=True, params_dtype=DT), "row", ck,
                                   [("weight", "row", None), ("bias", "rowb", None)]),
        "replicated": lambda: check_layer(L.ReplicatedLinear(H, 64, bias=True, params_dtype=DT), "rep",
                                          ck, [("weight", "rep", None), ("bias", "repb", None)]),
        # 500 rows: padded to 512, the last rank ends in 12 rows of padding.
        "vocab_padded": lambda: check_layer(V.VocabParallelEmbedding(500, H, params_dtype=DT), "emb",
                                            ck, [("weight", "emb", None)]),
        "lm_head_padded": lambda: check_layer(
            V.ParallelLMHead(500, H, bias=True, params_dtype=DT), "head", ck,
            [("weight", "head", None), ("bias", "headb", None)]),
        "rmsnorm": lambda: check_layer(_norm(layernorm, H), "norm", ck, [("weight", "norm", None)]),
        "refuse_subclass": lambda: check_layer(
            MyQKV(H, 32, 4, 1, bias=False, params_dtype=DT), "my", ck,
            [("weight", "q", "q"), ("weight", "k1", "k"), ("weight", "v1", "v")]),
        "refuse_unknown": lambda: _describe_unknown(Unknown()),
    }


def _norm(layernorm: Any, h: int) -> nn.Module:
    norm = layernorm.RMSNorm(h).to(DT)
    norm.weight.weight_loader = lambda p, w: p.data.copy_(w)
    return norm


def _describe_unknown(mod: nn.Module) -> Any:
    from nccl_back.engines.vllm_layout import describe_tensor

    return describe_tensor(mod, "x.weight", "weight", (4,), [("x.weight", None)])


def model_case(model_dir: str, world: int, rank: int, port: int) -> dict[str, Any]:
    """The tiny Llama as vLLM builds and loads it; every served tensor described."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from nccl_back.engines.vllm_layout import describe_engine
    from nccl_back.model.skeleton import named_tensors

    cfg = EngineArgs(model=model_dir, tensor_parallel_size=world, dtype="bfloat16",
                     skip_tokenizer_init=True, max_model_len=128, enforce_eager=True,
                     load_format="dummy").create_engine_config()
    ckpt = load_file(os.path.join(model_dir, "model.safetensors"))
    with set_current_vllm_config(cfg):
        model = LlamaForCausalLM(vllm_config=cfg).to(DT)
        model.load_weights(iter(ckpt.items()))
        described = describe_engine(model, cfg, sorted(ckpt))
        # What no layer shows: the engine's config (set on the real config, then put back).
        refused = {}
        for obj, field, value in [(cfg.parallel_config, "pipeline_parallel_size", 2),
                                  (cfg.parallel_config, "data_parallel_size", 2),
                                  (cfg.parallel_config, "enable_expert_parallel", True),
                                  (cfg.model_config, "quantization", "fp8")]:
            before = getattr(obj, field)
            object.__setattr__(obj, field, value)
            try:
                describe_engine(model, cfg, sorted(ckpt))
                refused[field] = "described"
            except Exception as e:
                refused[field] = f"{type(e).__name__}: {e}"
            finally:
                object.__setattr__(obj, field, before)
    tensors, aliases = named_tensors(model)
    bad = [n for n, t in described.items() if t is not None
           and not same_bytes(assemble(t, ckpt, tuple(tensors[n].shape)), tensors[n])]
    if bad or set(described) != set(tensors):
        raise AssertionError(f"differ: {bad}; undescribed: {sorted(set(tensors) - set(described))}")
    return {"tensors": len(described), "aliases": aliases,
            "own": sorted(n for n, t in described.items() if t is None), "refused": refused,
            "qkv": repr(described["model.layers.0.self_attn.qkv_proj.weight"]),
            "lm_head": repr(described.get("lm_head.weight"))}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    results: dict[str, Any] = {}
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=a.world, rank=a.rank, local_rank=a.rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{a.port}",
                                     backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=a.world)
        cases = layer_cases(a.rank)
        for name, run in cases.items():
            try:
                results[name] = {"ok": run()}
            except Exception as e:  # the test reads which cases fail, and why
                results[name] = {"error": f"{type(e).__name__}: {e}"}
    try:
        results["model"] = {"ok": model_case(a.model, a.world, a.rank, a.port)}
    except Exception as e:
        results["model"] = {"error": f"{type(e).__name__}: {e}"}
    with open(a.out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
