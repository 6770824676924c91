"""Per-layer integrity hashes: what they catch, what they tolerate, how they report."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nccl_back.errors import ConfigError, WeightVerificationError
from nccl_back.model.integrity import compare, layer_hashes, layer_of, sample_indices


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
    from nccl_back.model.skeleton import build, consolidate

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


# Every dtype a checkpoint may hold; torch.take has no kernel for several of them.
ALL_DTYPES = [
    torch.float64, torch.float32, torch.bfloat16, torch.float16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.uint16, torch.uint32, torch.uint64, torch.bool,
]
ODD_SIZES = (1, 7, 101, 1001)


def _random_of(
    dtype: torch.dtype, numel: int, gen: torch.Generator, raw: bool = True
) -> torch.Tensor:
    """Random raw bytes as ``dtype`` (NaNs and infinities included), bools as 0/1;
    ``raw=False``: normal values for the float16-hashed floating dtypes."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    if not raw and (dtype.is_floating_point or dtype.is_complex) and dtype != torch.float8_e8m0fnu:
        return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def _every_dtype(seed: int = 0, raw: bool = True) -> nn.Module:
    """One buffer per dtype and odd size, each its own layer (see ``_random_of``)."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Module()
    for dtype in ALL_DTYPES:
        for size in ODD_SIZES:
            name = f"{str(dtype).removeprefix('torch.')}_{size}"
            model.register_buffer(name, _random_of(dtype, size, gen, raw))
    return model


def _consolidated(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose buffers share one allocation, each at an aligned offset."""
    buffers = dict(model.named_buffers())
    sizes = [t.numel() * t.element_size() for t in buffers.values()]
    storage = torch.empty(sum(sizes) + 16 * len(sizes), dtype=torch.uint8).untyped_storage()
    out, offset = nn.Module(), 0
    for (name, t), size in zip(buffers.items(), sizes, strict=True):
        offset = -(-offset // 16) * 16
        view = torch.empty(0, dtype=t.dtype).set_(
            storage, offset // t.element_size(), t.shape, t.stride()
        )
        view.view(torch.uint8).copy_(t.view(torch.uint8))
        out.register_buffer(name, view)
        offset += size
    return out


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_every_dtype_and_odd_size_is_hashed_and_changes_are_caught(mode: str) -> None:
    """Each dtype hashes in both modes; changing a sampled element changes only its layer."""
    model = _every_dtype(raw=False)
    before = layer_hashes(model, mode)  # type: ignore[arg-type]
    assert len(before) == len(ALL_DTYPES) * len(ODD_SIZES)
    assert layer_hashes(_every_dtype(raw=False), mode) == before  # type: ignore[arg-type]
    for name, buf in model.named_buffers():
        i = int(sample_indices(name, buf.numel())[0])
        if buf.dtype in (torch.bool, torch.float8_e8m0fnu) or not (
            buf.is_floating_point() or buf.is_complex()
        ):
            byte = buf.view(torch.uint8).view(-1)[i * buf.element_size()]
            byte ^= 1 if buf.dtype != torch.float8_e8m0fnu else 0x10  # 0xff is e8m0's NaN
        else:
            wide = buf.view(-1)[i].to(torch.complex128 if buf.is_complex() else torch.float64)
            buf.view(-1)[i] = (wide + 1).to(buf.dtype)
        after = layer_hashes(model, mode)  # type: ignore[arg-type]
        assert after[name] != before[name], name
        assert {k for k in before if before[k] != after[k]} == {name}
        before = after


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_every_dtype_consolidated_and_separate_hash_alike(mode: str) -> None:
    """One take per dtype over a shared allocation reads the bytes per-tensor takes read."""
    model = _every_dtype()
    flat = _consolidated(model)
    first = next(iter(flat.buffers())).untyped_storage().data_ptr()
    assert all(b.untyped_storage().data_ptr() == first for b in flat.buffers())
    assert layer_hashes(flat, mode) == layer_hashes(model, mode)  # type: ignore[arg-type]


def test_non_contiguous_tensors_of_every_dtype_hash_like_their_copies() -> None:
    """A strided view (no whole copy taken) hashes like its contiguous copy, every dtype."""
    gen = torch.Generator().manual_seed(3)
    strided, copies = nn.Module(), nn.Module()
    for dtype in ALL_DTYPES:
        name = "t_" + str(dtype).removeprefix("torch.")
        view = _random_of(dtype, 2 * 333, gen).reshape(333, 2)[:, 1]
        assert not view.is_contiguous()
        strided.register_buffer(name, view)
        copies.register_buffer(name, view.contiguous())
    assert layer_hashes(strided) == layer_hashes(copies)
    assert layer_hashes(strided, "full") == layer_hashes(copies, "full")


def _nan_payloads() -> dict[torch.dtype, list[int]]:
    """Bit patterns of distinct NaNs (quiet, signalling, negative, with payloads)."""
    return {
        torch.float32: [0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001, 0x7FFFFFFF],
        torch.float64: [0x7FF8000000000000, 0x7FF8000000000001, 0xFFF8000000000000, 0x7FF0000000000001],
        torch.bfloat16: [0x7FC0, 0x7FC1, 0xFFC0, 0x7F81],
        torch.float16: [0x7E00, 0x7E01, 0xFE00, 0x7C01],
        torch.float8_e5m2: [0x7D, 0x7E, 0x7F, 0xFD, 0xFF],
        torch.float8_e4m3fn: [0x7F, 0xFF],
    }


def _bits_as(dtype: torch.dtype, bits: list[int]) -> torch.Tensor:
    raw = b"".join(b.to_bytes(dtype.itemsize, "little") for b in bits)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)


def _with_nans(dtype: torch.dtype, nan_bits: int) -> nn.Module:
    """101 values of ``dtype``, three of them the NaN ``nan_bits``."""
    values = torch.linspace(-2, 2, 101).to(dtype)
    nan = _bits_as(dtype, [nan_bits])
    assert torch.isnan(nan.float()).all()
    for i in (0, 50, 100):
        values[i] = nan[0]
    model = nn.Module()
    model.register_buffer("w", values)
    return model


@pytest.mark.parametrize("dtype", list(_nan_payloads()))
def test_every_nan_payload_samples_alike_and_full_mode_sees_the_bits(dtype: torch.dtype) -> None:
    """Sampled mode hashes all NaNs as one; full mode is bit-exact, so payloads count."""
    patterns = _nan_payloads()[dtype]
    models = [_with_nans(dtype, bits) for bits in patterns]
    sampled = {layer_hashes(m)["w"] for m in models}
    full = {layer_hashes(m, "full")["w"] for m in models}
    assert len(sampled) == 1
    assert len(full) == len(patterns)


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_narrow_floats_and_their_upcasts_sample_alike_nans_included(narrow: torch.dtype) -> None:
    """A bf16/fp8 tensor (NaNs included) and its float16/32/64 upcasts hash alike."""
    gen = torch.Generator().manual_seed(1)
    model = nn.Module()
    model.register_buffer("w", _random_of(narrow, 1001, gen))
    assert torch.isnan(model.get_buffer("w").float()).any()
    expected = layer_hashes(model)
    for wide in (torch.float16, torch.float32, torch.float64):
        if narrow == torch.bfloat16 and wide == torch.float16:
            continue  # bfloat16's range exceeds float16's: both overflow alike only sometimes
        up = nn.Module()
        up.register_buffer("w", model.get_buffer("w").to(wide))
        assert layer_hashes(up) == expected, wide


@pytest.mark.gpu
@pytest.mark.parametrize("key", [None, b"k" * 32], ids=["unkeyed", "keyed"])
@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_cpu_and_cuda_hashes_agree_for_every_dtype(mode: str, key: bytes | None) -> None:
    """The same bytes of every dtype and odd size hash alike on CPU and CUDA, both layouts."""
    model = _every_dtype()
    on_cpu = layer_hashes(model, mode, key=key)  # type: ignore[arg-type]
    assert layer_hashes(_consolidated(model).cuda(), mode, key=key) == on_cpu  # type: ignore[arg-type]
    model.cuda()
    assert next(model.buffers()).is_cuda
    assert layer_hashes(model, mode, key=key) == on_cpu  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("key", [None, b"k" * 32], ids=["unkeyed", "keyed"])
def test_cuda_hashes_go_through_the_fused_kernels(key: bytes | None) -> None:
    """On a GPU the hashes take the fused Triton kernels (no silent torch fallback), and
    equal the CPU's for a model of tensors across several chunks."""
    from nccl_back.model import fused_hash

    gen = torch.Generator().manual_seed(2)
    model = nn.Module()
    model.register_buffer("big", torch.randint(-(2**62), 2**62, ((1 << 20) + 4097,), generator=gen))
    model.register_buffer("half", torch.randn(3 << 19, generator=gen).to(torch.bfloat16))
    on_cpu = {m: layer_hashes(model, m, key=key) for m in ("sampled", "full")}
    model.cuda()
    assert fused_hash.prepare(torch.device("cuda", 0)).wait(120)  # compiled in the background
    assert fused_hash.usable(torch.device("cuda", 0)), fused_hash._failed
    assert {m: layer_hashes(model, m, key=key) for m in ("sampled", "full")} == on_cpu
    assert fused_hash._failed == []


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(_nan_payloads()))
def test_cpu_and_cuda_agree_on_nan_payloads(dtype: torch.dtype) -> None:
    """NaNs with any payload hash alike on CPU and CUDA in both modes."""
    for bits in _nan_payloads()[dtype]:
        model = _with_nans(dtype, bits)
        on_cpu = layer_hashes(model), layer_hashes(model, "full")
        model.cuda()
        assert (layer_hashes(model), layer_hashes(model, "full")) == on_cpu, hex(bits)


KEY = bytes(range(32))


def test_keyed_hashes_depend_on_the_key() -> None:
    """Keyed digests differ from unkeyed ones and between keys, in both modes."""
    model = _lm()
    for mode in ("sampled", "full"):
        plain = layer_hashes(model, mode)  # type: ignore[arg-type]
        a = layer_hashes(model, mode, key=KEY)  # type: ignore[arg-type]
        b = layer_hashes(model, mode, key=KEY[::-1])  # type: ignore[arg-type]
        assert a == layer_hashes(_lm(), mode, key=KEY)  # type: ignore[arg-type]
        assert set(a) == set(plain) == set(b)
        assert all(a[k] != plain[k] and a[k] != b[k] for k in a)
    assert sample_indices("w", 10_000, key=KEY).tolist() != sample_indices("w", 10_000).tolist()
    with pytest.raises(ConfigError, match="key: 8 bytes; use 16 to 64"):
        layer_hashes(model, key=b"x" * 8)


def test_a_copy_changed_outside_public_positions_is_caught_with_a_key() -> None:
    """95% of a tensor replaced outside the unkeyed sample positions: only keyed catches it."""
    model = nn.Module()
    model.register_buffer("w", torch.randn(4000))
    plain, keyed = layer_hashes(model), layer_hashes(model, key=KEY)
    w = model.get_buffer("w")
    public = sample_indices("w", w.numel())
    forged = torch.full_like(w, 7.0)
    forged[public] = w[public]
    w.copy_(forged)
    assert layer_hashes(model) == plain  # the attack on unkeyed positions works
    assert layer_hashes(model, key=KEY) != keyed


def test_a_cancelling_change_fools_the_unkeyed_checksum_not_the_keyed_one() -> None:
    """Top bits flipped in two words cancel in the public linear sum, not in the keyed hash."""
    model = nn.Module()
    model.register_buffer("w", torch.randn(1000, dtype=torch.float64))
    plain, keyed = layer_hashes(model, "full"), layer_hashes(model, "full", key=KEY)
    words = model.get_buffer("w").view(torch.int64)
    words[10] ^= -(1 << 63)  # sign bits: the values change
    words[500] ^= -(1 << 63)
    assert layer_hashes(model, "full") == plain
    assert layer_hashes(model, "full", key=KEY) != keyed


def test_keyed_full_catches_single_changes_at_any_position_and_size() -> None:
    """Keyed full mode: one changed byte anywhere, odd sizes, chunk order all change the hash."""
    gen = torch.Generator().manual_seed(5)
    model = nn.Module()
    model.register_buffer("big", torch.randn(2, 1 << 20, generator=gen))
    model.register_buffer("odd", torch.randint(0, 255, (13,), dtype=torch.uint8, generator=gen))
    before = layer_hashes(model, "full", key=KEY)
    for name, index in (("big", 123_457), ("big", (1 << 21) - 1), ("odd", 12)):
        raw = model.get_buffer(name).view(torch.uint8).view(-1)
        raw[index] ^= 0x80
        after = layer_hashes(model, "full", key=KEY)
        assert {k for k in before if before[k] != after[k]} == {name}
        raw[index] ^= 0x80
    big = model.get_buffer("big")
    big.copy_(big.flip(0))
    assert layer_hashes(model, "full", key=KEY)["big"] != before["big"]


def test_keyed_hashes_keep_layout_and_upcast_semantics() -> None:
    """With a key: consolidated equals separate, strided equals copy, bf16 equals its upcast."""
    model = _every_dtype()
    for mode in ("sampled", "full"):
        assert layer_hashes(_consolidated(model), mode, key=KEY) == layer_hashes(  # type: ignore[arg-type]
            model, mode, key=KEY  # type: ignore[arg-type]
        )
    bf16 = _lm(dtype=torch.bfloat16)
    assert layer_hashes(bf16, key=KEY) == layer_hashes(bf16.to(torch.float32), key=KEY)
