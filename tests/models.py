"""Small test models and checkpoint helpers shared by the test files.

``TinyTransformer`` has what real checkpoints have and loaders get wrong: layers named
``model.layers.{i}...``, an embedding tied to the LM head (``lm_head.weight`` aliases
``embed.weight``), and a rotary ``inv_freq`` buffer that the constructor computes and
the checkpoint does not carry (non-persistent).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from nccl_back.model.checkpoint import INDEX_NAME
from nccl_back.model.skeleton import Model, dtype_name, named_tensors


class Rotary(nn.Module):
    """Rotary position embedding; ``inv_freq`` is derived state, not a weight."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, heads, seq, head_dim); rotate pairs by position-dependent angles.
        pos = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = nn.LayerNorm(d, dtype=dtype)
        self.qkv = nn.Linear(d, 3 * d, bias=False, dtype=dtype)
        self.o = nn.Linear(d, d, bias=False, dtype=dtype)
        self.mlp_norm = nn.LayerNorm(d, dtype=dtype)
        self.up = nn.Linear(d, 4 * d, dtype=dtype)
        self.down = nn.Linear(4 * d, d, dtype=dtype)

    def forward(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.down(nn.functional.gelu(self.up(self.mlp_norm(x))))


class TinyTransformer(nn.Module):
    """A decoder-only transformer small enough for unit tests."""

    def __init__(
        self, n_layers: int = 2, d: int = 32, vocab: int = 64, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        n_heads = 2
        self.config: dict[str, Any] = {
            "model_type": "tiny_transformer",
            "n_layers": n_layers,
            "d": d,
            "vocab": vocab,
            "n_heads": n_heads,
            "dtype": dtype_name(dtype),
        }
        self.embed = nn.Embedding(vocab, d, dtype=dtype)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Block(d, n_heads, dtype) for _ in range(n_layers))
        self.model.norm = nn.LayerNorm(d, dtype=dtype)
        self.rotary = Rotary(d // n_heads)
        self.lm_head = nn.Linear(d, vocab, bias=False, dtype=dtype)
        self.lm_head.weight = self.embed.weight  # tied: one tensor, two names

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.model.layers:
            x = layer(x, self.rotary)
        return self.lm_head(self.model.norm(x))


@torch.no_grad()
def fill_random(model: Model, seed: int) -> Model:
    """Overwrite every state-dict tensor in place with values drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    tensors, _ = named_tensors(model)
    for t in tensors.values():
        if t.dtype.is_floating_point:
            values = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        else:
            values = torch.randint(0, 2 if t.dtype == torch.bool else 100, t.shape, generator=gen)
        t.copy_(values.to(t.dtype))
    return model


def write_checkpoint(
    model: Model, directory: str | Path, n_shards: int = 2, with_index: bool = True
) -> Path:
    """Write ``config.json`` and ``model-XXXXX-of-YYYYY.safetensors`` shards (+ index).

    Tensors are split in sorted-name order into ``n_shards`` contiguous groups; a tied
    tensor is written once, under its canonical name, as ``safetensors`` requires.
    The config is ``model.config`` when the model has one.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors, _ = named_tensors(model)
    names = list(tensors)
    per_shard = -(-len(names) // n_shards)
    weight_map: dict[str, str] = {}
    for i in range(n_shards):
        filename = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        group = names[i * per_shard : (i + 1) * per_shard]
        save_file({n: tensors[n].detach().cpu().contiguous() for n in group}, str(out / filename))
        weight_map.update(dict.fromkeys(group, filename))
    config = getattr(model, "config", None) or {"model_type": type(model).__name__}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if with_index:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return out
