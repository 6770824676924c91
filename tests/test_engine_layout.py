"""An engine's layout and identity (engines/common.py): a described engine leaves its
parallel fields out of the version; one that cannot be described keeps them and says
``layout_mismatch``. An adapter here is a plain class over a torch module (no engine)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nccl_back.config import Settings
from nccl_back.engines import common
from nccl_back.errors import FALLBACK_REASONS, LayoutMismatchError, fallback_reason
from nccl_back.model.layout import LayoutError, TensorLayout, column

from models import write_checkpoint


class Whole(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.arange(32.0).reshape(8, 4), requires_grad=False)
        self.norm = nn.Parameter(torch.ones(4), requires_grad=False)


class Rank(nn.Module):
    """One of two column-parallel ranks of :class:`Whole`, plus a constant of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.norm = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.register_buffer("scale", torch.ones(()))


class Adapter:
    name, title, version = "toy", "Toy", "1.0"
    parallel_fields: tuple[str, ...] = ("tp_size", "tp_rank")

    def __init__(self, ckpt: Path, rank: int, refuse: str | None = None) -> None:
        self.ckpt, self.rank, self.refuse = ckpt, rank, refuse
        self.log = logging.getLogger("toy.engine")

    def checkpoint_dir(self) -> str:
        return str(self.ckpt)

    def layout(self) -> dict[str, Any]:
        return {"dtype": "float32", "tp_size": 2, "tp_rank": self.rank}

    def default_load(self, model: nn.Module) -> None:  # pragma: no cover - not loaded here
        raise AssertionError("no load in these tests")

    def group(self) -> Any:
        return None

    def describe(self, model: nn.Module, checkpoint: Sequence[str]) -> Mapping[str, TensorLayout | None]:
        if self.refuse:
            raise LayoutError(self.refuse)
        assert sorted(checkpoint) == ["norm", "up"]
        return {"up": column("up", self.rank, 2, 8), "scale": None}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(Whole(), tmp_path / "ckpt", n_shards=1)


def _settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=str(tmp_path / "crc"))


def test_described_engines_of_any_rank_share_one_version(ckpt: Path, tmp_path: Path) -> None:
    """With a description both ranks get the same version, without tp fields; the layout keeps them apart."""
    s = _settings(tmp_path)
    out = []
    for rank in (0, 1):
        a = Adapter(ckpt, rank)
        spec = common.checkpoint_spec(a, s)
        sh = common.engine_sharding(a, s, Rank(), common.loaded_state(Rank()), spec)
        assert sh is not None
        out.append((common.adapter_spec(a, spec, described=True), sh))
    (v0, sh0), (v1, sh1) = out
    assert v0.version == v1.version
    assert "tp_rank" not in v0.config["engine"] and v0.config["engine"]["layout"] == "described"
    assert sh0.layout.digest != sh1.layout.digest
    # The engine's own constant is not part of the layout (a receiver keeps its own).
    assert [t[0] for t in sh0.layout.tensors] == ["norm", "up"]
    assert sh1.layout.tensor("up").parts[0].start == 4  # type: ignore[union-attr]


def test_undescribed_engine_keeps_its_identity_and_says_layout_mismatch(
        ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A layout the adapter cannot describe: no sharding, the tp fields stay in the version, the reason is logged."""
    s = _settings(tmp_path)
    a = Adapter(ckpt, 1, refuse="model.layers.0.mlp.experts: FusedMoE is not a layer this adapter describes")
    spec = common.checkpoint_spec(a, s)
    with caplog.at_level(logging.INFO, logger="toy.engine"):
        assert common.engine_sharding(a, s, Rank(), common.loaded_state(Rank()), spec) is None
    assert "does not reshard (layout_mismatch: model.layers.0.mlp.experts: FusedMoE" in caplog.text
    plain = common.adapter_spec(a, spec, described=False)
    assert plain.config["engine"]["tp_rank"] == 1
    assert plain.version != common.adapter_spec(a, spec, described=True).version


def test_a_description_that_does_not_fit_is_a_layout_mismatch(ckpt: Path, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A description whose pieces do not tile the tensor (8 rows for 4) is refused by the shape check."""
    s = _settings(tmp_path)
    a = Adapter(ckpt, 1)
    a.describe = lambda model, names: {"up": column("up", 0, 1, 8)}  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="toy.engine"):
        assert common.engine_sharding(a, s, Rank(), common.loaded_state(Rank()), common.checkpoint_spec(a, s)) is None
    assert "layout_mismatch" in caplog.text


def test_layout_mismatch_is_a_fallback_reason() -> None:
    """layout_mismatch is one of the stable fallback codes."""
    assert "layout_mismatch" in FALLBACK_REASONS
    assert fallback_reason(LayoutMismatchError("x")) == "layout_mismatch"
