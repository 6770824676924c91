"""Skeletons and manifests: sorted names, tied tensors once, real non-persistent buffers."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nccl_back.errors import SkeletonError
from nccl_back.model.skeleton import Manifest, build, flat_layout, manifest, named_tensors, no_init


class Rotary(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.proj = nn.Linear(dim, dim)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.head = nn.Linear(4, 16, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(4)


def test_manifest_sorted_and_tied_once() -> None:
    """Manifest entries are in sorted name order and a tied weight is listed once."""
    m = manifest(Tied())
    assert m.names == sorted(m.names)
    assert m.names == ["embed.weight", "norm.bias", "norm.weight"]
    assert m.aliases == {"head.weight": "embed.weight"}


def test_manifest_for_pipeline_prefixes_names() -> None:
    """A mapping of sub-modules prefixes each tensor name with the sub-module's name."""
    m = manifest({"vae": nn.Linear(2, 3), "transformer": nn.Linear(3, 4, bias=False)})
    assert m.names == ["transformer.weight", "vae.bias", "vae.weight"]


def test_digest_changes_with_dtype_and_shape() -> None:
    """The digest differs when a dtype or shape differs, and is stable otherwise."""
    a = manifest(nn.Linear(4, 4))
    assert a.digest == manifest(nn.Linear(4, 4)).digest
    assert a.digest != manifest(nn.Linear(4, 5)).digest
    assert a.digest != manifest(nn.Linear(4, 4).to(torch.bfloat16)).digest
    assert "float32 vs" in a.diff(manifest(nn.Linear(4, 4).to(torch.bfloat16)))


def test_manifest_json_round_trip() -> None:
    """A manifest survives JSON encoding with the same digest."""
    m = manifest(Tied())
    assert Manifest.from_json(m.to_json()).digest == m.digest
    with pytest.raises(SkeletonError, match="malformed manifest JSON"):
        Manifest.from_json({"entries": [["x"]]})


def test_non_persistent_buffer_is_real_in_skeleton() -> None:
    """build() skips weight init yet computes constructor buffers such as inv_freq."""
    ref = Rotary()
    sk = build(Rotary)
    assert torch.equal(sk.inv_freq, ref.inv_freq)  # type: ignore[union-attr]
    # inv_freq is not transferred: it is not in the state dict, so not in the manifest.
    assert "inv_freq" not in manifest(sk).names


def test_no_init_skips_initialisers() -> None:
    """Inside no_init, nn.init functions leave tensors untouched (no random init cost)."""
    t = torch.full((4, 4), 7.0)
    with no_init():
        nn.init.kaiming_uniform_(t, a=math.sqrt(5))
        nn.init.zeros_(t)
    assert torch.all(t == 7.0)
    nn.init.zeros_(t)
    assert torch.all(t == 0.0)


def test_build_reports_factory_failure() -> None:
    """A failing factory raises SkeletonError naming the factory."""

    def broken() -> nn.Module:
        raise RuntimeError("boom")

    with pytest.raises(SkeletonError, match="skeleton factory 'broken' failed: boom"):
        build(broken)


def test_build_rejects_meta_tensors() -> None:
    """An unconsolidated skeleton with meta tensors is refused: a broadcast needs real buffers."""
    with pytest.raises(SkeletonError, match="meta device"):
        build(lambda: nn.Linear(2, 2, device="meta"), flat=False)


def test_flat_build_allocates_parameters_once() -> None:
    """While the factory runs, parameters live on meta; afterwards all share one allocation."""
    seen: list[bool] = []

    def factory() -> nn.Module:
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        seen.extend(p.is_meta for p in m.parameters())
        m.register_buffer("table", torch.arange(5.0))  # computed in the constructor: real
        return m

    model = build(factory)
    assert seen and all(seen)
    tensors, _ = named_tensors(model)
    assert {t.untyped_storage().data_ptr() for t in tensors.values()} == {
        tensors["0.weight"].untyped_storage().data_ptr()
    }
    assert torch.equal(model.table, torch.arange(5.0))
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in model.parameters())


def test_flat_build_keeps_ties_and_parameter_attributes() -> None:
    """A tied meta parameter becomes one real parameter; attributes hung on it survive."""

    def factory() -> nn.Module:
        m = nn.Module()
        m.emb = nn.Embedding(10, 4)
        m.head = nn.Linear(4, 10, bias=False)
        m.head.weight = m.emb.weight
        m.emb.weight.weight_loader = "custom"  # type: ignore[attr-defined]
        return m

    model = build(factory)
    assert model.head.weight is model.emb.weight
    assert not model.emb.weight.is_meta
    assert model.emb.weight.weight_loader == "custom"
    assert manifest(model).aliases == {"head.weight": "emb.weight"}


def test_bad_model_type() -> None:
    """Something that is neither a module nor a mapping of modules is rejected clearly."""
    with pytest.raises(SkeletonError, match="expected an nn.Module or a mapping"):
        named_tensors([nn.Linear(1, 1)])  # type: ignore[arg-type]
    with pytest.raises(SkeletonError, match=r"model\['a'\] is a int"):
        named_tensors({"a": 1})  # type: ignore[dict-item]


def test_consolidate_puts_tensors_in_one_allocation() -> None:
    """build() lays every state tensor out in one buffer, tied weights still tied."""
    sk = build(Tied)
    tensors, aliases = named_tensors(sk)
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(storages) == 1
    assert sk.head.weight is sk.embed.weight  # type: ignore[union-attr]
    offsets, total = flat_layout(manifest(sk))
    base = min(t.data_ptr() for t in tensors.values())
    assert {n: t.data_ptr() - base for n, t in tensors.items()} == offsets
    assert all(off % 64 == 0 for off in offsets.values())


def test_consolidate_keeps_non_persistent_buffers() -> None:
    """Consolidation moves only transferred tensors; inv_freq keeps its computed values."""
    sk = build(Rotary)
    assert torch.equal(sk.inv_freq, Rotary().inv_freq)  # type: ignore[union-attr]
    assert sk.inv_freq.untyped_storage().data_ptr() != sk.proj.weight.untyped_storage().data_ptr()  # type: ignore[union-attr]


def test_unconsolidated_build_is_available() -> None:
    """build(flat=False) keeps one allocation per tensor."""
    sk = build(Tied, flat=False)
    tensors, _ = named_tensors(sk)
    assert len({t.untyped_storage().data_ptr() for t in tensors.values()}) == len(tensors)


def test_bucket_goes_in_place_only_when_laid_out() -> None:
    """A consolidated skeleton's buckets are broadcast from its own memory, no staging copy."""
    from nccl_back.transport.broadcast import _in_place, plan

    flat, _ = named_tensors(build(Tied))
    steps = plan(flat, 1 << 20)
    view = _in_place(steps[0], flat)
    assert view is not None and view.data_ptr() == flat["embed.weight"].data_ptr()
    separate, _ = named_tensors(build(Tied, flat=False))
    assert _in_place(plan(separate, 1 << 20)[0], separate) is None


def test_skeletons_built_in_threads_at_once_leave_other_modules_real() -> None:
    """Builds racing in several threads neither leave nn.Module or nn.init patched nor
    put another thread's parameters on meta: a module made afterwards, or beside them,
    is real and initialised."""
    import threading

    from nccl_back.model.skeleton import build

    from models import TinyTransformer

    original = torch.nn.Module.register_parameter
    zeros = torch.nn.init.zeros_
    stop = threading.Event()
    beside: list[str] = []

    def plain() -> None:
        while not stop.is_set():
            beside.append(torch.nn.Linear(2, 2).weight.device.type)

    def builds() -> None:
        for _ in range(20):
            build(TinyTransformer)

    threads = [threading.Thread(target=builds) for _ in range(4)]
    watcher = threading.Thread(target=plain)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    watcher.join(10)
    assert torch.nn.Module.register_parameter is original
    assert torch.nn.init.zeros_ is zeros
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    assert torch.all(torch.nn.init.zeros_(torch.ones(3)) == 0)
    assert beside and set(beside) == {"cpu"}

def test_consolidate_into_uses_the_given_bytes_and_keeps_ties_and_buffers() -> None:
    """consolidate_into lays a skeleton out in the given buffer, ties and buffer values kept."""
    from nccl_back.model.skeleton import consolidate_into

    class WithBuffer(Tied):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("steps", torch.arange(5))

    model = build(WithBuffer)
    offsets, total = flat_layout(manifest(model))
    flat = torch.full((total + 64,), 0xAB, dtype=torch.uint8)
    consolidate_into(model, flat)
    tensors, _ = named_tensors(model)
    for name, t in tensors.items():
        assert t.data_ptr() == flat.data_ptr() + offsets[name], name
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.steps, torch.arange(5))
    skipped = build(WithBuffer)
    consolidate_into(skipped, torch.zeros(total, dtype=torch.uint8), keep_buffers=False)
    assert torch.equal(skipped.steps, torch.zeros(5, dtype=torch.int64))


def test_consolidate_into_refuses_a_buffer_that_cannot_hold_the_model() -> None:
    """Too few bytes or not a flat uint8 tensor is a SkeletonError naming the problem."""
    from nccl_back.model.skeleton import consolidate_into

    _, total = flat_layout(manifest(Tied()))
    with pytest.raises(SkeletonError, match=f"{total - 1} bytes given, the model needs {total}"):
        consolidate_into(build(Tied), torch.empty(total - 1, dtype=torch.uint8))
    with pytest.raises(SkeletonError, match="flat contiguous uint8 tensor, got torch.float32"):
        consolidate_into(build(Tied), torch.empty(total, dtype=torch.float32))
