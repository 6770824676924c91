"""vLLM's layers described as pieces of the checkpoint (:mod:`nccl_back.engines.vllm_layout`),
bit-exact against what vLLM's own weight loaders put in them, on a real TP=2 gloo group of
two processes (``layout_worker.py``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import HERE, ROOT

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]


def make_gqa_model(path: str) -> str:
    """A tiny bf16 Llama with one KV head (replicated at TP=2), a vocabulary of 500 (padded
    to 512) and tied embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=500, max_position_embeddings=256,
        tie_word_embeddings=True, torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results: per case the description or the error."""
    tmp = tmp_path_factory.mktemp("layout")
    model = make_gqa_model(str(tmp / "model"))
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_OMP_THREADS_BIND="nobind")
    procs = []
    for r in range(2):
        with open(tmp / f"{r}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "layout_worker.py"), "--rank", str(r), "--world", "2",
                 "--port", str(port), "--model", model, "--out", str(tmp / f"{r}.json")],
                env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for r, p in enumerate(procs):
            assert p.wait(300) == 0, (tmp / f"{r}.log").read_text()[-3000:]
    finally:
        for p in procs:
            p.kill()
    return [json.loads(Path(tmp / f"{r}.json").read_text()) for r in range(2)]


KINDS = ["qkv_replicated_kv", "qkv_gqa", "qkv_fused_on_disk", "merged_column", "column", "row",
         "replicated", "vocab_padded", "lm_head_padded", "rmsnorm"]


@pytest.mark.parametrize("case", KINDS)
def test_layer_description_is_what_vllm_loaded(ranks: list[dict[str, Any]], case: str) -> None:
    """On both TP ranks the described pieces, cut from the checkpoint, equal vLLM's loaded bytes."""
    for r in ranks:
        assert "ok" in r[case], r[case]


def test_kv_heads_replicate_and_queries_split(ranks: list[dict[str, Any]]) -> None:
    """One KV head at TP=2: both ranks hold all of k and v, and their own half of q."""
    parts = [r["qkv_replicated_kv"]["ok"]["weight"][1] for r in ranks]
    assert parts == [[["q", 0, 0, 64], ["k1", 0, 0, 32], ["v1", 0, 0, 32]],
                     [["q", 0, 64, 128], ["k1", 0, 0, 32], ["v1", 0, 0, 32]]]
    fused = [r["qkv_fused_on_disk"]["ok"]["weight"][1] for r in ranks]
    assert fused[1] == [["qkv", 0, 64, 128], ["qkv", 0, 128, 160], ["qkv", 0, 160, 192]]


def test_vocab_padding_maps_to_nothing(ranks: list[dict[str, Any]]) -> None:
    """500 rows at TP=2: rank 1 holds rows 256..500, then 12 rows of padding (vLLM zeroes them)."""
    assert ranks[0]["vocab_padded"]["ok"]["weight"][1] == [["emb", 0, 0, 256]]
    assert ranks[1]["vocab_padded"]["ok"]["weight"][1] == [["emb", 0, 256, 500], [12]]
    assert ranks[1]["lm_head_padded"]["ok"]["bias"][1] == [["headb", 0, 256, 500], [12]]
    assert ranks[1]["row"]["ok"] == {"weight": [1, [["row", 1, 128, 256]]],
                                     "bias": [0, [["rowb", 0, 0, 128]]]}


@pytest.mark.parametrize(("case", "match"), [
    ("refuse_subclass", "MyQKV is not a layer this adapter describes"),
    ("refuse_unknown", "Unknown is not a layer this adapter describes"),
])
def test_layers_it_cannot_describe_are_refused(ranks: list[dict[str, Any]], case: str,
                                               match: str) -> None:
    """A subclass of a known layer or an unknown layer is a LayoutError naming it, never a guess."""
    for r in ranks:
        assert r[case].get("error", "").startswith("LayoutError:") and match in r[case]["error"]


def test_engine_configs_it_cannot_describe_are_refused(ranks: list[dict[str, Any]]) -> None:
    """Pipeline, data or expert parallelism and quantization make the engine's layout a LayoutError."""
    assert ranks[0]["model"]["ok"]["refused"] == {
        "pipeline_parallel_size": "LayoutError: pipeline parallel (size 2)",
        "data_parallel_size": "LayoutError: data parallel (size 2)",
        "enable_expert_parallel": "LayoutError: expert parallel",
        "quantization": "LayoutError: quantized (fp8)",
    }


def test_whole_model_is_described_bit_exact(ranks: list[dict[str, Any]]) -> None:
    """vLLM's tiny Llama (GQA, padded vocabulary, tied head) as vLLM loads it, every tensor
    described by vLLM's own name mapping; the attention scales are the engine's own."""
    for n, r in enumerate(ranks):
        got = r["model"].get("ok")
        assert got is not None, r["model"]
        assert got["aliases"] == {"model.embed_tokens.weight": "lm_head.weight"}
        assert got["own"] == [f"model.layers.{i}.self_attn.attn._{s}_scale"
                              for i in range(2) for s in ("k", "prob", "q", "v")]
        assert "model.embed_tokens.weight" in got["lm_head"]  # the tied head: the embedding's rows
        assert f"q_proj.weight', dim=0, start={128 * n}, stop={128 * (n + 1)}" in got["qkv"]
        assert "k_proj.weight', dim=0, start=0, stop=64" in got["qkv"]
    assert "Padding(size=12)" in ranks[1]["model"]["ok"]["lm_head"]
