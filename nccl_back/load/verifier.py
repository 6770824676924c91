"""The Verifier: the one owner of what "verified" means, on every path.

Every path that ends with bytes in a model (a same-layout receive, a relay member, a
streamed download, a reshard, the sidecar's hand-off, an engine's served state) checks
them here, and asks :meth:`Verifier.publishable` what it may publish as truth.
``verify`` (``Settings.verify``) means the same everywhere:

- ``sampled``: a keyed sample of every tensor is compared with truth a storage load
  computed: layer hashes (:mod:`.integrity`) for a skeleton of the truth's own layout,
  MACs at sampled checkpoint positions (:mod:`.position_truth`) for any other layout.
- ``full``: every byte: the keyed full layer hash, or per-index sums in checkpoint
  coordinates (:mod:`.marginals`) for any other layout. A path that cannot read every
  byte against storage-rooted truth does not report ``verified``: it loads elsewhere.
- ``none``: nothing is checked, and nothing is published as truth.

:data:`SCHEME` names the algorithms and is part of every truth record's key, so during
a rolling upgrade two schemes keep two truths and never replace each other's.

Bytes from storage (CRC32C-checked) or checked in full give every kind of truth; bytes
checked by a sample give only the truth that was checked; unchecked bytes give none: a
worker never publishes truth computed from bytes it did not check.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from nccl_back.coord.content import PositionTruth
from nccl_back.coord.truth import encode_truth, truth_for_mode
from nccl_back.errors import ConfigError, WeightVerificationError
from nccl_back.model import fused_hash, integrity, marginals, position_truth
from nccl_back.model.layout import Layout
from nccl_back.model.scheme import SCHEME
from nccl_back.model.skeleton import Model, named_tensors

__all__ = ["MODES", "SCHEME", "Basis", "PositionCheck", "Publishable", "Verifier"]

MODES = ("none", "sampled", "full")


class Basis(enum.Enum):
    """How a worker knows its bytes are the checkpoint's."""

    STORAGE = "storage"
    """Read from storage, CRC32C-checked."""
    FULL = "full"
    """Every byte checked against storage-rooted truth."""
    SAMPLED = "sampled"
    """A keyed sample checked against storage-rooted truth."""
    NONE = "none"
    """Not checked."""


@dataclass(frozen=True)
class Publishable:
    """What a worker may publish as truth (:meth:`Verifier.publishable`)."""

    layer_modes: tuple[str, ...] = ()
    """Layer-hash modes it may compute from its own bytes."""
    layer_copy: bool = False
    """It may re-publish the layer truth it was checked against (the same hashes)."""
    positions: bool = False
    """It may compute MACs at sampled positions from its own bytes."""
    position_copy: bool = False
    """It may re-publish the MACs it was checked against (exactly those)."""
    marginal_sums: bool = False
    """It may compute per-index sums from its own bytes."""


@dataclass
class PositionCheck:
    """What one check of positions covered."""

    positions: int = 0
    elements: int = 0
    macs: position_truth.Macs = field(default_factory=dict)
    """This worker's MACs at the positions it checked (what it may re-publish)."""


class Verifier:
    """Computes, encodes and compares truth under one mode and key."""

    scheme = SCHEME

    def __init__(self, mode: str, key: bytes | None) -> None:
        if mode not in MODES:
            raise ConfigError(f"verify={mode!r}: choose one of {', '.join(MODES)}")
        self.mode = mode
        self.key = key

    def prepare(self, model: Model) -> None:
        """Ready what checking ``model`` will use, without waiting: on a GPU, the fused
        hash kernels compile in the background while its weights arrive."""
        device = next((t.device for t in named_tensors(model)[0].values()), None)
        if device is not None and device.type == "cuda":
            fused_hash.prepare(device)

    # -- truth a storage load computes -------------------------------------------------

    def layer_truth(self, model: Model) -> dict[str, str]:
        """Layer hashes for the ground-truth record: ``sampled`` always (every receiver
        may check it), ``full`` too when this worker verifies in full."""
        return encode_truth({m: integrity.layer_hashes(model, mode=m, key=self.key)  # type: ignore[arg-type]
                             for m in self.publishable(Basis.STORAGE).layer_modes})

    def position_truth(self, layout: Layout, tensors: Mapping[str, torch.Tensor], *,
                       sums: bool | None = None) -> PositionTruth:
        """MACs at the sampled positions ``layout``'s tensors hold, and (``full``) the
        per-index sums of every piece."""
        sums = self.mode == "full" if sums is None else sums
        return PositionTruth(
            layout.digest, SCHEME, position_truth.held_macs(layout, tensors, self.key),
            marginals.held(layout, tensors, self.key) if sums else {})

    # -- checks ------------------------------------------------------------------------

    def expected(self, stored: dict[str, str]) -> dict[str, str]:
        """This mode's part of a stored ground-truth record (empty: nothing to check)."""
        return truth_for_mode(stored, self.mode)

    def fingerprint(self, model: Model, mode: str | None = None) -> dict[str, str]:
        """Layer hashes of ``model`` under ``mode`` (None: this verifier's; ``none``
        reads as sampled): what a local consumer checks a hand-off against, and what an
        engine compares after its own post-processing to see whether it rewrote served
        tensors."""
        mode = mode or ("sampled" if self.mode == "none" else self.mode)
        return integrity.layer_hashes(model, mode=mode, key=self.key)  # type: ignore[arg-type]

    def check_layers(self, model: Model, expected: Mapping[str, str]) -> None:
        """Compare the model's layer hashes with ``expected``; :class:`WeightVerificationError` naming
        the layers that differ."""
        actual = integrity.layer_hashes(model, mode=self.mode, key=self.key)  # type: ignore[arg-type]
        integrity.compare(expected, actual)

    def check_positions(self, layout: Layout, tensors: Mapping[str, torch.Tensor],
                        truths: Mapping[str, PositionTruth]) -> PositionCheck:
        """Compare what ``layout`` holds with the truth of its sources' publishers
        (``truths``: publisher -> record). ``sampled``: every sampled position held;
        ``full``: every byte, through the per-index sums. :class:`WeightVerificationError` naming the
        checkpoint tensors that differ; :class:`marginals.TruthConflict` when two
        publishers disagree; :class:`position_truth.NoPositionTruth` or
        :class:`marginals.NotCheckable` when the truth lacks some position or piece."""
        macs = merge_macs(truths)
        mine = position_truth.held_macs(layout, tensors, self.key)
        out = PositionCheck(macs=mine)
        out.positions = position_truth.compare(mine, macs)
        if self.mode == "full":
            truth = marginals.Truth()
            for publisher, record in sorted(truths.items()):
                truth.add(record.marginals, publisher)
            out.elements, bad = marginals.check(layout, tensors, truth, self.key)
            if bad:
                raise WeightVerificationError(f"checkpoint bytes differ in {len(bad)} tensors: {bad[:5]}",
                                              set(bad))
        return out

    # -- publication ----------------------------------------------------------------------

    def publishable(self, basis: Basis) -> Publishable:
        """What a worker whose bytes stand on ``basis`` may publish as truth."""
        if basis in (Basis.STORAGE, Basis.FULL):
            modes = ("sampled", "full") if self.mode == "full" else ("sampled",)
            return Publishable(layer_modes=modes, positions=True,
                               marginal_sums=self.mode == "full")
        if basis is Basis.SAMPLED:
            return Publishable(layer_copy=True, position_copy=True)
        return Publishable()

    def basis(self) -> Basis:
        """The basis a successful check under this verifier's mode gives."""
        return {"full": Basis.FULL, "sampled": Basis.SAMPLED}.get(self.mode, Basis.NONE)


def merge_macs(truths: Mapping[str, PositionTruth]) -> position_truth.Macs:
    """One view of several publishers' MACs; :class:`marginals.TruthConflict` (naming
    the publishers) where two of them disagree on a position."""
    out: position_truth.Macs = {}
    owner: dict[tuple[str, int], str] = {}
    for publisher, record in sorted(truths.items()):
        for name, macs in record.macs.items():
            have = out.setdefault(name, [None] * len(macs))
            if len(have) != len(macs):
                raise marginals.TruthConflict(
                    f"truth for {name}: {publisher} has {len(macs)} positions, another {len(have)}")
            for j, m in enumerate(macs):
                if m is None:
                    continue
                if have[j] is not None and have[j] != m:
                    raise marginals.TruthConflict(
                        f"two truth records disagree on {name}[{j}]: {publisher}'s and"
                        f" {owner[(name, j)]}'s", publishers={publisher, owner[(name, j)]})
                have[j] = m
                owner[(name, j)] = publisher
    return out
