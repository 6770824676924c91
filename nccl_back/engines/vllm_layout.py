"""vLLM's layout: which pieces of which checkpoint tensors each loaded parameter holds.

:func:`describe` reads vLLM's own layer metadata on the module as ``create_model`` built
it (vLLM's fused names) and returns one :class:`~nccl_back.model.layout.TensorLayout`
per served tensor, as each layer's ``weight_loader`` cuts it (the table in
docs/vllm.md); checkpoint names come from the model's ``hf_to_vllm_mapper`` or its
``packed_modules_mapping``. Anything else (quantization, MoE, a subclass of a known
layer, pipeline parallelism...) raises :class:`~nccl_back.model.layout.LayoutError`
with the reason, and the description is checked against the checkpoint's shapes
(:func:`~nccl_back.model.layout.layout_of`): a misfit is a refusal, never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from vllm.model_executor.layers import layernorm
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)

from nccl_back.model.layout import LayoutError, Padding, Piece, TensorLayout, concat, whole
from nccl_back.model.skeleton import named_tensors

#: Modules whose tensors are whole checkpoint tensors (no tensor-parallel split).
_WHOLE: tuple[type, ...] = (ReplicatedLinear, layernorm.RMSNorm, layernorm.GemmaRMSNorm,
                            layernorm.LayerNorm, nn.LayerNorm)
_ATTENTION_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
_LINEAR = (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)
_VOCAB = (VocabParallelEmbedding, ParallelLMHead)

def describe_engine(model: nn.Module, vllm_config: Any,
                    checkpoint: Sequence[str]) -> dict[str, TensorLayout | None]:
    """:func:`describe` for an engine of ``vllm_config``, refusing what no layer shows:
    pipeline parallelism (each stage holds other layers), expert and data parallelism,
    and quantization (its loaders cut and pack otherwise)."""
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size > 1:
        raise LayoutError(f"pipeline parallel (size {par.pipeline_parallel_size})")
    if par.enable_expert_parallel:
        raise LayoutError("expert parallel")
    if par.data_parallel_size > 1:
        # vLLM's world group then spans the data-parallel replicas: its ranks are not
        # tensor-parallel ranks, and the peer index keys ranks of that group.
        raise LayoutError(f"data parallel (size {par.data_parallel_size})")
    if vllm_config.model_config.quantization is not None:
        raise LayoutError(f"quantized ({vllm_config.model_config.quantization})")
    return describe(model, checkpoint)


def describe(model: nn.Module, checkpoint: Sequence[str]) -> dict[str, TensorLayout | None]:
    """Every tensor ``model`` serves (canonical names, :func:`named_tensors`) as pieces
    of the checkpoint tensors named ``checkpoint``, or None for one the engine makes
    itself (an unquantized attention layer's KV scales: 1.0, no checkpoint tensor);
    :class:`LayoutError` with the reason for anything this adapter cannot describe."""
    sources = checkpoint_sources(model, checkpoint)
    owners: dict[str, tuple[str, nn.Module]] = {}
    for prefix, mod in model.named_modules():
        for leaf, _ in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            owners[f"{prefix}.{leaf}" if prefix else leaf] = (leaf, mod)
    tensors, aliases = named_tensors(model)
    names: dict[str, list[str]] = {n: [n] for n in tensors}
    for alias, canonical in aliases.items():
        names[canonical].append(alias)
    out: dict[str, TensorLayout | None] = {}
    for canonical, all_names in names.items():
        name = _owner(all_names, owners)
        leaf, mod = owners[name]
        if _engine_constant(mod, leaf, tensors[canonical], sources.get(name)):
            out[canonical] = None
            continue
        out[canonical] = describe_tensor(mod, name, leaf, tuple(tensors[canonical].shape),
                                         sources.get(name, ()))
    return out


def _engine_constant(mod: Any, leaf: str, t: Any, sources: object) -> bool:
    """An unquantized attention layer's scale buffer: vLLM sets it to 1.0 when it builds
    the layer and loads nothing into it (``set_default_quant_scales``)."""
    return (type(mod) is Attention and leaf in _ATTENTION_SCALES and not sources
            and getattr(mod, "quant_method", None) is None and t.numel() == 1
            and float(t.float().item()) == 1.0)


def _owner(names: list[str], owners: Mapping[str, tuple[str, nn.Module]]) -> str:
    """The name a tensor is loaded under: itself, or for a tied LM head the embedding
    (vLLM loads the embedding's checkpoint tensor and skips the head's)."""
    unknown = [n for n in names if n not in owners]
    if unknown:
        raise LayoutError(f"{unknown[0]}: not a parameter or buffer of a module")
    if len(names) == 1:
        return names[0]
    embeddings = [n for n in names if type(owners[n][1]) is VocabParallelEmbedding]
    if len(embeddings) != 1 or any(type(owners[n][1]) not in (ParallelLMHead, VocabParallelEmbedding)
                                   for n in names):
        raise LayoutError(f"tied tensors {sorted(names)[:3]} other than an LM head tied to its embedding")
    return embeddings[0]


def checkpoint_sources(model: nn.Module, checkpoint: Sequence[str]) -> dict[str, list[tuple[str, Any]]]:
    """For each vLLM parameter name, the checkpoint tensors loaded into it and their
    shard ids, by the model's own name mapping."""
    out: dict[str, list[tuple[str, Any]]] = {}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        map_one = getattr(mapper, "_map_name_with_shard", None)
        if map_one is None:
            raise LayoutError(f"{type(mapper).__name__}: this vLLM's name mapper has no shard ids")
        for name in checkpoint:
            got = map_one(name)
            if got is None:
                continue
            new, shard = got
            if isinstance(shard, list):
                raise LayoutError(f"{name}: loaded into several shards of {new}")
            out.setdefault(new, []).append((name, shard))
        return out
    packed: Mapping[str, Sequence[str]] = getattr(model, "packed_modules_mapping", None) or {}
    for name in checkpoint:
        *path, module, leaf = ["", *name.split(".")]
        fused = [(f, list(parts).index(module)) for f, parts in packed.items() if module in parts]
        if len(fused) == 1:  # vLLM's convention: the parts in shard order
            out.setdefault(".".join([*path, fused[0][0], leaf])[1:], []).append((name, fused[0][1]))
        else:
            out.setdefault(name, []).append((name, None))
    return out


def describe_tensor(mod: Any, name: str, leaf: str, shape: tuple[int, ...],
                    sources: Sequence[tuple[str, Any]]) -> TensorLayout:
    """One tensor ``leaf`` of layer ``mod`` (loaded as ``name``) from its ``sources``
    (``mod``: a vLLM layer; its attributes are read as vLLM documents them)."""
    kind = type(mod)
    if not sources:
        raise LayoutError(f"{name}: no checkpoint tensor is loaded into it")
    if kind in _LINEAR or kind is ReplicatedLinear:
        if type(mod.quant_method) is not UnquantizedLinearMethod:
            raise LayoutError(f"{name}: quantized ({type(mod.quant_method).__name__})")
    elif kind in _VOCAB:
        if type(mod.quant_method) is not UnquantizedEmbeddingMethod:
            raise LayoutError(f"{name}: quantized ({type(mod.quant_method).__name__})")
    elif kind not in _WHOLE:
        raise LayoutError(f"{name}: {kind.__module__}.{kind.__name__} is not a layer this"
                          " adapter describes")
    if leaf not in ("weight", "bias"):
        raise LayoutError(f"{name}: tensor {leaf!r} of {kind.__name__}")
    if kind in _WHOLE or (kind is RowParallelLinear and leaf == "bias"):
        return whole(_single(name, sources), shape)
    if kind in _VOCAB:
        return _vocab(mod, name, _single(name, sources))
    if kind is RowParallelLinear:
        n = mod.input_size_per_partition
        return TensorLayout(1, (Piece(_single(name, sources), 1, mod.tp_rank * n, (mod.tp_rank + 1) * n),))
    if kind is ColumnParallelLinear:
        n = mod.output_size_per_partition
        return TensorLayout(0, (Piece(_single(name, sources), 0, mod.tp_rank * n, (mod.tp_rank + 1) * n),))
    if kind is MergedColumnParallelLinear:
        shards = [(i, size // mod.tp_size, mod.tp_rank, sum(mod.output_sizes[:i]))
                  for i, size in enumerate(mod.output_sizes)]
        return _fused(name, sources, shards)
    q, k, v = (mod.num_heads * mod.head_size, mod.num_kv_heads * mod.head_size,
               mod.num_kv_heads * mod.v_head_size)
    kv_rank = mod.tp_rank // mod.num_kv_head_replicas
    # packed_modules_mapping numbers the parts; vLLM's loader names them q, k, v.
    sources = [(s, "qkv"[i] if isinstance(i, int) and 0 <= i < 3 else i) for s, i in sources]
    total_q, total_k = mod.total_num_heads * mod.head_size, mod.total_num_kv_heads * mod.head_size
    return _fused(name, sources, [("q", q, mod.tp_rank, 0), ("k", k, kv_rank, total_q),
                                  ("v", v, kv_rank, total_q + total_k)])


def _single(name: str, sources: Sequence[tuple[str, Any]]) -> str:
    if len(sources) != 1 or sources[0][1] is not None:
        raise LayoutError(f"{name}: loaded from {[s for s, _ in sources][:4]}, not one whole tensor")
    return str(sources[0][0])


def _fused(name: str, sources: Sequence[tuple[str, Any]],
           shards: list[tuple[Any, int, int, int]]) -> TensorLayout:
    """Shards ``(id, size, rank of the slice, offset in a fused checkpoint tensor)``,
    concatenated along dim 0 in order: from one checkpoint tensor per shard id, or, when
    the checkpoint holds the fused tensor (shard id None), from it at each offset."""
    by_id = {shard: src for src, shard in sources}
    if len(sources) == 1 and None in by_id:
        src = by_id[None]
        return concat(0, *(Piece(src, 0, off + r * n, off + (r + 1) * n) for _, n, r, off in shards))
    if len(by_id) != len(sources) or set(by_id) != {s[0] for s in shards}:
        raise LayoutError(f"{name}: shard ids {sorted(map(str, by_id))} are not"
                          f" {[str(s[0]) for s in shards]}")
    return concat(0, *(Piece(by_id[i], 0, r * n, (r + 1) * n) for i, n, r, _ in shards))


def _vocab(mod: Any, name: str, src: str) -> TensorLayout:
    idx = mod.shard_indices
    if mod.num_added_embeddings or idx.num_added_elements:
        raise LayoutError(f"{name}: added vocabulary (LoRA) entries")
    rows = mod.num_embeddings_per_partition
    parts: list[Piece | Padding] = []
    if idx.num_org_elements:
        parts.append(Piece(src, 0, idx.org_vocab_start_index, idx.org_vocab_end_index))
    if rows > idx.num_org_elements:
        parts.append(Padding(rows - idx.num_org_elements))
    return TensorLayout(0, tuple(parts))
