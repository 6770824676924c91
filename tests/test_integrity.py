"""Per-layer integrity hashes: what they catch, what they tolerate, how they report."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nccl_back.errors import ConfigError, WeightVerificationError
from nccl_back.integrity import compare, layer_hashes, layer_of, sample_indices


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)


class TinyLM(nn.Module):
    """Embedding, numbered blocks, a tied head and an integer buffer."""

    def __init__(self, dim: int = 64, depth: int = 3, vocab: int = 300) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        self.register_buffer("position_ids", torch.arange(16, dtype=torch.int64) << 40)


def _lm(seed: int = 0, dtype: torch.dtype = torch.float32) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().to(dtype)


def _not_sampled(name: str, numel: int) -> int:
    """An index that sampled mode does not look at."""
    taken = set(sample_indices(name, numel).tolist())
    return next(i for i in range(numel) if i not in taken)


@pytest.mark.parametrize(
    ("name", "layer"),
    [
        ("model.layers.3.mlp.up.weight", "model.layers.3"),
        ("model.embed.weight", "model.embed"),
        ("bias", "bias"),
        ("0.weight", "0"),
        ("blocks.12", "blocks.12"),
        ("transformer.blocks.0.attn.qkv.weight", "transformer.blocks.0"),
    ],
)
def test_layer_of(name: str, layer: str) -> None:
    """A layer is the prefix through the first numeric component, else the parent path."""
    assert layer_of(name) == layer


def test_same_weights_same_hashes_one_per_layer() -> None:
    """Two models with the same weights hash alike, one entry per layer, tied head once."""
    a, b = layer_hashes(_lm()), layer_hashes(_lm())
    assert a == b
    assert sorted(a) == ["embed", "layers.0", "layers.1", "layers.2", "norm", "position_ids"]
    assert all(len(h) == 32 for h in a.values())
    compare(a, b)


def test_different_weights_differ() -> None:
    """Different weights give different hashes in every layer that holds them."""
    a, b = layer_hashes(_lm(0)), layer_hashes(_lm(1))
    assert {k for k in a if a[k] != b[k]} == {"embed", "layers.0", "layers.1", "layers.2"}


def test_sample_indices_are_a_pure_function_of_name_and_numel() -> None:
    """Indices depend on name and numel only, in any call order, within range."""
    first = [sample_indices(n, 10_000).tolist() for n in ("a.weight", "b.weight")]
    second = [sample_indices(n, 10_000).tolist() for n in ("b.weight", "a.weight")][::-1]
    assert first == second
    assert first[0] != first[1]
    assert sample_indices("a.weight", 10_001).tolist() != first[0]
    assert all(0 <= i < 10_000 for i in first[0]) and len(first[0]) == 100
    assert sample_indices("tiny", 7).tolist() == list(range(7))


def test_registration_order_does_not_matter() -> None:
    """Modules registered in another order, same weights: same hashes."""
    torch.manual_seed(0)
    x, y = nn.Linear(8, 8), nn.Linear(8, 3)
    ab = nn.Module()
    ab.x, ab.y = x, y
    ba = nn.Module()
    ba.y, ba.x = y, x
    assert layer_hashes(ab) == layer_hashes(ba)
    assert layer_hashes(ab, "full") == layer_hashes(ba, "full")


def test_change_at_a_sampled_index_is_caught_and_named() -> None:
    """One element changed at a sampled index changes exactly that layer's hash."""
    model = _lm()
    expected = layer_hashes(model)
    w = model.get_parameter("layers.1.up.weight").data
    i = int(sample_indices("layers.1.up.weight", w.numel())[0])
    w.view(-1)[i] += 1.0
    actual = layer_hashes(model)
    assert {k for k in expected if expected[k] != actual[k]} == {"layers.1"}
    with pytest.raises(WeightVerificationError, match=r"1 mismatching \[layers\.1\]"):
        compare(expected, actual)


def test_bfloat16_weights_and_their_float32_upcast_agree() -> None:
    """float16 normalisation: a bfloat16 model and its exact float32 upcast hash alike."""
    bf16 = _lm(dtype=torch.bfloat16)
    assert layer_hashes(bf16) == layer_hashes(bf16.to(torch.float32))


def test_float32_weights_and_their_bfloat16_downcast_differ() -> None:
    """A bfloat16 downcast lost information, so its floating layers hash differently."""
    fp32 = _lm()
    a, b = layer_hashes(fp32), layer_hashes(_lm().to(torch.bfloat16))
    assert {k for k in a if a[k] != b[k]} == {"embed", "layers.0", "layers.1", "layers.2"}


def test_difference_below_float16_precision_is_tolerated() -> None:
    """A float32 change in the last mantissa bit vanishes in float16: not an alarm."""
    model = _lm()
    expected = layer_hashes(model)
    w = model.norm.weight.data  # 64 elements: hashed whole
    w[0] = torch.nextafter(w[0], torch.tensor(math.inf))
    assert w[0] != 1.0
    assert layer_hashes(model) == expected
    full_before, full_after = layer_hashes(_lm(), "full"), layer_hashes(model, "full")
    assert {k for k in full_before if full_before[k] != full_after[k]} == {"norm"}


def test_integers_are_hashed_raw_not_through_float16() -> None:
    """A change of 1 in a large integer (invisible in float16) is caught."""
    model = _lm()
    expected = layer_hashes(model)
    model.get_buffer("position_ids")[3] += 1
    actual = layer_hashes(model)
    assert {k for k in expected if expected[k] != actual[k]} == {"position_ids"}


def test_full_mode_catches_a_single_element_sampling_misses() -> None:
    """Full mode catches one changed element at an index sampled mode never reads."""
    model = nn.Module()
    model.big = nn.Linear(1024, 1024)
    sampled, full = layer_hashes(model), layer_hashes(model, "full")
    w = model.big.weight.data
    w.view(-1)[_not_sampled("big.weight", w.numel())] += 1e-3
    assert layer_hashes(model) == sampled
    with pytest.raises(WeightVerificationError, match=r"1 mismatching \[big\]"):
        compare(full, layer_hashes(model, "full"))


def test_full_mode_is_position_sensitive_across_chunks() -> None:
    """Swapping two 4 MiB halves of one tensor changes its full hash."""
    model = nn.Module()
    model.register_buffer("buf", torch.randn(2, 1 << 20))
    before = layer_hashes(model, "full")
    buf = model.get_buffer("buf")
    buf.copy_(buf.flip(0))
    assert layer_hashes(model, "full") != before


def test_full_mode_reads_content_not_alignment() -> None:
    """A tensor at a misaligned offset, or of an odd byte size, hashes like its copy."""
    backing = torch.randn(4097)
    odd = nn.Module()
    odd.register_buffer("x", backing[1:])  # 4-byte offset: not int64-aligned
    odd.register_buffer("y", torch.randn(3, dtype=torch.float16))  # 6 bytes: bytewise
    copy = nn.Module()
    copy.register_buffer("x", backing[1:].clone())
    copy.register_buffer("y", odd.get_buffer("y").clone())
    assert layer_hashes(odd, "full") == layer_hashes(copy, "full")
    copy.get_buffer("y")[1] += 1
    assert layer_hashes(odd, "full")["y"] != layer_hashes(copy, "full")["y"]


def test_pipeline_mapping_hashes_prefixed_layers() -> None:
    """A mapping of sub-modules hashes each under its prefixed layer names."""
    torch.manual_seed(0)
    hashes = layer_hashes({"vae": nn.Linear(4, 4), "text": nn.Sequential(nn.Linear(4, 4))})
    assert sorted(hashes) == ["text.0", "vae"]


def test_compare_names_mismatching_missing_and_unexpected_layers() -> None:
    """compare lists each kind of difference with counts, the first few names only."""
    expected = {f"layers.{i}": "a" for i in range(8)} | {"embed": "e"}
    actual = {f"layers.{i}": "b" for i in range(8)} | {"extra": "x"}
    pattern = (
        r"8 mismatching \[layers\.0, layers\.1, layers\.2, layers\.3, layers\.4, "
        r"\.\.\. \(\+3 more\)\]; 1 missing \[embed\]; 1 unexpected \[extra\]"
    )
    with pytest.raises(WeightVerificationError, match=pattern):
        compare(expected, actual)


def test_bad_arguments_raise_config_error() -> None:
    """An unknown mode or a non-positive sample count is a ConfigError."""
    with pytest.raises(ConfigError, match="mode='crc'"):
        layer_hashes(_lm(), "crc")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="samples=0"):
        layer_hashes(_lm(), samples=0)


@pytest.mark.gpu
def test_cpu_and_cuda_hashes_agree() -> None:
    """The same weights hash alike on CPU and on a GPU, in both modes."""
    model = _lm()
    on_cpu = layer_hashes(model), layer_hashes(model, "full")
    model.cuda()
    assert (layer_hashes(model), layer_hashes(model, "full")) == on_cpu


def test_consolidated_and_separate_layouts_hash_alike() -> None:
    """The one-take path for a consolidated skeleton gives the per-tensor path's hashes."""
    from nccl_back.skeleton import build, consolidate

    def make() -> nn.Module:
        m = nn.ModuleDict({
            "emb": nn.Embedding(50, 8),
            "layers": nn.ModuleList(nn.Linear(8, 8) for _ in range(3)),
            "fp16": nn.Linear(4, 4).to(torch.float16),
        })
        m.register_buffer("steps", torch.arange(7))
        return m

    separate = build(make, flat=False)
    torch.manual_seed(0)
    for t in separate.state_dict().values():
        t.copy_(torch.randn(t.shape).to(t.dtype) if t.is_floating_point() else t)
    flat = consolidate(build(make, flat=False))
    flat.load_state_dict(separate.state_dict())
    assert flat["emb"].weight.untyped_storage().data_ptr() == flat["fp16"].weight.untyped_storage().data_ptr()
    assert layer_hashes(flat) == layer_hashes(separate)
