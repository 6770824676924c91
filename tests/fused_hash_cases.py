"""The fused hash kernels (Triton) in Triton's interpreter on CPU tensors: the same
kernels a GPU compiles, bit-identical to the torch path in every mode.

Not collected by the suite: ``tests/test_fused_hash.py`` runs this file in a process of
its own started with ``TRITON_INTERPRET=1``, because Triton reads the setting when it is
first imported (its own library functions are built then), and the suite's process has
imported it long before. The interpreter is the one stand-in: it executes each
kernel's programs with numpy instead of compiling them for a GPU, so these tests prove
the kernels' arithmetic and addressing; speed and the compiled code are the device
check's (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_integrity import _consolidated, _every_dtype, _nan_payloads, _with_nans
from torch import nn

from nccl_back.model import fused_hash
from nccl_back.model.integrity import _CHUNK_WORDS, layer_hashes

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.exit("run by tests/test_fused_hash.py, with TRITON_INTERPRET=1 from the start", 2)

KEY = b"fused-hash-key-" + b"k" * 17
MODES = [("sampled", None), ("sampled", KEY), ("full", None), ("full", KEY)]
IDS = ["sampled", "sampled-keyed", "full", "full-keyed"]


@pytest.fixture
def interpreted() -> Iterator[None]:
    """The hashes of CPU tensors go through the interpreted kernels; none failed before."""
    fused_hash._failed.clear()
    assert fused_hash.usable(torch.device("cpu"))
    yield
    fused_hash._failed.clear()


def _torch_path(model: nn.Module, mode: str, key: bytes | None,
                monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    with monkeypatch.context() as m:
        m.delenv("TRITON_INTERPRET")
        assert not fused_hash.usable(torch.device("cpu"))
        return layer_hashes(model, mode, key=key)  # type: ignore[arg-type]


def _big() -> nn.Module:
    """Tensors across chunk boundaries in both word sizes, one not word-sized."""
    gen = torch.Generator().manual_seed(3)
    model = nn.Module()
    words = 2 * _CHUNK_WORDS + 4097  # int64 words: three plain chunks, five keyed ones
    model.register_buffer("big", torch.randint(-(2**62), 2**62, (words,), generator=gen))
    model.register_buffer("bytes_", torch.randint(0, 256, (_CHUNK_WORDS * 4 + 3,),
                                                  dtype=torch.uint8, generator=gen))
    return model


@pytest.mark.parametrize(("mode", "key"), MODES, ids=IDS)
def test_every_dtype_hashes_as_on_the_torch_path(
    interpreted: None, monkeypatch: pytest.MonkeyPatch, mode: str, key: bytes | None
) -> None:
    """Every dtype and odd size, separate and in one allocation: the fused hashes are the
    torch path's, and no kernel launch failed."""
    for model in (_every_dtype(), _consolidated(_every_dtype(seed=1))):
        assert layer_hashes(model, mode, key=key) == _torch_path(model, mode, key, monkeypatch)  # type: ignore[arg-type]
    assert fused_hash._failed == []


@pytest.mark.parametrize(("mode", "key"), [m for m in MODES if m[0] == "full"], ids=IDS[2:])
def test_tensors_across_chunks_hash_as_on_the_torch_path(
    interpreted: None, monkeypatch: pytest.MonkeyPatch, mode: str, key: bytes | None
) -> None:
    """Several chunks per tensor (pieces summed per chunk, chunks chained in order)."""
    model = _big()
    assert layer_hashes(model, mode, key=key) == _torch_path(model, mode, key, monkeypatch)  # type: ignore[arg-type]
    assert fused_hash._failed == []


@pytest.mark.parametrize("dtype", list(_nan_payloads()))
def test_nan_payloads_hash_as_on_the_torch_path(
    interpreted: None, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """NaNs of any payload: one canonical NaN sampled, every bit in full, as before."""
    for bits in _nan_payloads()[dtype]:
        model = _with_nans(dtype, bits)
        for mode in ("sampled", "full"):
            assert layer_hashes(model, mode) == _torch_path(model, mode, None, monkeypatch)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=0, max_size=4096), start=st.integers(0, 64),
       dtype=st.sampled_from([torch.uint8, torch.int16, torch.bfloat16, torch.float32,
                              torch.int64, torch.float64, torch.float8_e5m2]),
       mode=st.sampled_from(MODES))
def test_any_bytes_at_any_offset_hash_as_on_the_torch_path(
    interpreted: None, monkeypatch: pytest.MonkeyPatch, data: bytes, start: int,
    dtype: torch.dtype, mode: tuple[str, bytes | None]
) -> None:
    """Any bytes, viewed as any dtype from any element offset of a shared buffer."""
    size = dtype.itemsize
    raw = torch.frombuffer(bytearray(bytes(start * size) + data + bytes(size)), dtype=torch.uint8)
    usable_len = (len(raw) // size) * size
    tensor = raw[:usable_len].view(dtype)[start: start + len(data) // size]
    model = nn.Module()
    model.register_buffer("w", tensor)
    assert (layer_hashes(model, mode[0], key=mode[1])  # type: ignore[arg-type]
            == _torch_path(model, mode[0], mode[1], monkeypatch))


def test_a_failed_launch_hashes_on_the_torch_path_alike(
    interpreted: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel launch that raises (a broken Triton, a driver that cannot compile)
    costs speed, not the hash: the torch path takes over for good, logged once."""
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("cannot compile")

    model = _every_dtype()
    expected = {mode: _torch_path(model, mode, KEY, monkeypatch) for mode in ("sampled", "full")}
    kernels = SimpleNamespace(weighted_sums={(1,): None}, gather=fused_hash._kernels().gather)  # type: ignore[union-attr]
    kernels.weighted_sums = _Launch(broken)
    monkeypatch.setattr(fused_hash, "_kernels", lambda: kernels)
    assert layer_hashes(model, "full", key=KEY) == expected["full"]
    assert fused_hash._failed and "cannot compile" in fused_hash._failed[0]
    assert not fused_hash.usable(torch.device("cpu"))
    assert layer_hashes(model, "sampled", key=KEY) == expected["sampled"]


class _Launch:
    """A kernel stand-in: ``kernel[grid](...)`` calls ``fn``."""

    def __init__(self, fn: object) -> None:
        self.fn = fn

    def __getitem__(self, grid: object) -> object:
        return self.fn
