"""The demo's and benchmarks' example checkpoint: Llama-shaped, random, reproducible."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from nccl_back.errors import ConfigError
from nccl_back.model.checkpoint import INDEX_NAME

#: Transformer layers of the example model: 9 tensors each, so ~220 tensors in all.
EXAMPLE_LAYERS = 24
HEAD_DIM = 64


def example_shapes(model_mb: float, layers: int = EXAMPLE_LAYERS) -> dict[str, tuple[int, ...]]:
    """Llama-style tensor names and shapes totalling about ``model_mb`` MiB in bfloat16
    (GQA with 4 query heads per KV head, an 8/3·d gated MLP, untied embeddings); the
    vocabulary (~32·d) absorbs the rounding of ``d``."""
    if not (model_mb > 0 and math.isfinite(model_mb)):
        raise ConfigError(f"model size {model_mb!r} MB: must be a positive number")
    # Parameters: ~layers·10.5·d² in the layers plus 2·32·d² in the embeddings.
    params = model_mb * (1 << 20) / 2
    # Rounding d down leaves the vocabulary room to make up the difference.
    d = max(HEAD_DIM, int(math.sqrt(params / (layers * 10.5 + 64)) // HEAD_DIM) * HEAD_DIM)
    kv = max(HEAD_DIM, d // 4)
    ff = -(-(8 * d // 3) // HEAD_DIM) * HEAD_DIM
    per_layer = 2 * d * d + 2 * kv * d + 3 * ff * d + 2 * d
    vocab = max(256, round((params - layers * per_layer - d) / (2 * d)))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (d, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, d),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
        })
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (vocab, d)
    return shapes


def write_example_model(
    directory: str | Path, model_mb: float, *, shards: int = 4, seed: int = 0
) -> Path:
    """Write an example checkpoint (``config.json``, safetensors shards, their index) of
    random values from ``seed``: equal arguments write identical bytes."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    shapes = example_shapes(model_mb)
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02)
        .to(torch.bfloat16)
        for name, shape in shapes.items()
    }
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    # Contiguous groups of about equal bytes, in name order, as HF's sharding does.
    per_shard = total / shards
    groups: list[list[str]] = [[] for _ in range(shards)]
    weight_map: dict[str, str] = {}
    done = 0
    for name in sorted(tensors):
        groups[min(shards - 1, int(done // per_shard))].append(name)
        done += tensors[name].numel() * tensors[name].element_size()
    groups = [g for g in groups if g]
    for i, group in enumerate(groups):
        filename = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(out / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, filename))
    d = shapes["model.norm.weight"][0]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": d,
        "intermediate_size": shapes["model.layers.0.mlp.up_proj.weight"][0],
        "num_hidden_layers": EXAMPLE_LAYERS,
        "num_attention_heads": d // HEAD_DIM,
        "num_key_value_heads": shapes["model.layers.0.self_attn.k_proj.weight"][0] // HEAD_DIM,
        "vocab_size": shapes["model.embed_tokens.weight"][0],
        "torch_dtype": "bfloat16",
        "nccl_back_example_seed": seed,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return out
