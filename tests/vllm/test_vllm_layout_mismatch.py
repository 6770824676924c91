"""An engine with a layer the adapter cannot describe never reshards: real engines (CPU
build), real Redis, separate processes.

OPT's learned positional embedding is a plain ``nn.Embedding``, not a vLLM parallel
layer, so its engines say ``layout_mismatch`` and keep their TP size in the version: a
TP=2 engine beside a live TP=1 engine of the same checkpoint loads from storage.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import Engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def make_opt_model(path: str) -> str:
    """A tiny bf16 OPT (head size 64, as the CPU attention kernel needs)."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(2)
    config = OPTConfig(hidden_size=256, ffn_dim=512, num_hidden_layers=2, num_attention_heads=4,
                       vocab_size=512, max_position_embeddings=256, word_embed_proj_dim=256,
                       torch_dtype="bfloat16")
    OPTForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def test_an_engine_it_cannot_describe_says_layout_mismatch_and_loads_from_storage(
        engine_env: dict[str, str], workdir: Path, tmp_path: Path) -> None:
    """OPT at TP=1 serves; OPT at TP=2 logs layout_mismatch and loads from storage, not from it."""
    model = make_opt_model(str(tmp_path / "opt"))
    h1 = Engine("opt1", workdir).start(model, engine_env, hold=True)
    try:
        h1.wait_ready()
        assert h1.loaded()["source"] == "storage", h1.tail()
        assert "does not reshard (layout_mismatch: " in h1.log(), h1.tail()
        r2 = Engine("opt2", workdir).start(model, engine_env, tp=2)
        r2.wait_ready()
        ranks = r2.loaded_ranks()
        assert [r["source"] for r in ranks] == ["storage", "storage"], r2.tail()
        assert "does not reshard (layout_mismatch: " in r2.log(), r2.tail()
        # Its TP size is part of its version: another version than the TP=1 engine's.
        assert {r["version"] for r in ranks} != {h1.loaded()["version"]}
        assert r2.wait_exit() == 0
    finally:
        assert h1.release() == 0
