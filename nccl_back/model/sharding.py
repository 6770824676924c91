"""A tensor-parallel library model's sharding: its :class:`~.layout.Layout` and the
checkpoint it is cut from, and the whole-checkpoint storage load that cuts it.

``nccl_back.sharding(model, spec, {name: column(...), ...})`` gives the :class:`Sharding`
a user passes to ``WeightService.load(..., sharding=...)``; the helpers that describe
one tensor (:func:`~.layout.column`, :func:`~.layout.row`, :func:`~.layout.concat`,
:func:`~.layout.shard`, :class:`~.layout.Padding`) live in :mod:`.layout`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from nccl_back.config import Settings
from nccl_back.model.checkpoint import flat_skeleton, locate, manifest_of, model_headers
from nccl_back.model.identity import ModelSpec
from nccl_back.model.layout import Layout, TensorLayout, layout_of, trivial_layout
from nccl_back.model.loader import load_from_storage
from nccl_back.model.reshard_plan import apply_local, plan, zero_padding
from nccl_back.model.skeleton import (
    Manifest,
    Model,
    manifest,
    named_tensors,
)
from nccl_back.model.storage import Storage
from nccl_back.result import LoadResult


@dataclass(frozen=True)
class Sharding:
    """What one rank holds of the checkpoint (``layout``) and the whole checkpoint's
    manifest (``checkpoint``: every tensor whole, as a plain holder holds it)."""

    layout: Layout
    checkpoint: Manifest

    @property
    def whole(self) -> Layout:
        """The layout of a plain holder of the whole checkpoint."""
        return trivial_layout(self.checkpoint)


def sharding(model: Model, spec: ModelSpec, described: Mapping[str, TensorLayout],
             settings: Settings | None = None, *, own: Collection[str] = ()) -> Sharding:
    """The sharding of ``model`` (this rank's skeleton): ``described`` says which pieces of
    which checkpoint tensors each of its tensors holds (the rest are whole checkpoint
    tensors of their names). Raises :class:`~.layout.LayoutError` if it does not fit.

    ``own``: tensors that hold no checkpoint element and that every worker of the
    version makes alike itself (an engine's constants): left out of the layout, so a
    resharding receiver keeps its own and no holder sends them."""
    ckpt = manifest_of(locate(model_headers(Storage(settings or Settings.from_env()), spec)))
    shapes = {e.name: e.shape for e in ckpt.entries}
    held = manifest(model)
    if own:
        held = Manifest(tuple(e for e in held.entries if e.name not in own))
    return Sharding(layout_of(held, described, shapes), ckpt)


def load_sharded(model: Model, spec: ModelSpec, settings: Settings, sharding: Sharding) -> LoadResult:
    """The whole-checkpoint storage load of a sharded skeleton: the checkpoint into a
    whole-checkpoint buffer (CRC32C-checked, as any load), then this rank's pieces cut
    from it by the plan a receiver of a whole-checkpoint holder would use. Reads the
    whole checkpoint on every rank: the reference the ranged load
    (:mod:`nccl_back.load.ranged_group`, what a worker runs) is compared against."""
    whole = flat_skeleton(spec, "cpu", settings=settings)
    result = load_from_storage(whole, spec, settings=settings)
    tensors = named_tensors(model)[0]
    apply_local(plan(sharding.layout, [sharding.whole]).moves, named_tensors(whole)[0], tensors)
    zero_padding(sharding.layout, tensors)
    return result
