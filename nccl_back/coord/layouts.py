"""Resharding's record families: layout descriptions, reshard groups and truth in
checkpoint coordinates.

Layouts and groups are content-addressed (a record not hashing to its key is rejected,
whoever signed it); a resharding receiver stores its layout before it asks, so a sender
can compute the same plan. Position truth (:mod:`nccl_back.model.position_truth`) is
stored ``SET NX`` like ground truth and re-stored by its holder's heartbeat.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from nccl_back.coord import records, schema
from nccl_back.coord.content import PositionTruth, encode_macs, encode_marginals
from nccl_back.coord.keys import ANY
from nccl_back.coord.signed_store import SignedStore
from nccl_back.errors import UntrustedRecordError

if TYPE_CHECKING:
    # position_truth imports torch; the registry must not (``nccl-back status``).
    from nccl_back.model.layout import Layout

#: Index keys read when listing the world sizes that hold a version: each names a
#: (rank, world) pair a reshard may look up, so it bounds the work a flood of fake
#: index keys (no secret needed to write key names) can cause.
MAX_WORLD_KEYS = 64


class LayoutRecords(SignedStore):
    """Layout descriptions, reshard groups and position truth."""

    def put_layout(self, layout: Layout) -> None:
        """Store ``layout`` under its digest (refreshing its TTL)."""
        key = self.keys.of(schema.LAYOUT_RECORD, layout.digest)
        self.set_signed(key, {"layout": layout.dumps()}, schema.LAYOUT_RECORD)

    def get_layout(self, digest: str) -> Layout | None:
        """The layout stored under ``digest``; None if absent or untrusted."""
        return self.record(self.keys.of(schema.LAYOUT_RECORD, digest), schema.LAYOUT_RECORD)

    def put_group(self, digests: list[str]) -> str:
        """Store the list of holder layouts a plan is computed over; returns its digest."""
        text = ",".join(digests)
        digest = hashlib.sha256(text.encode()).hexdigest()
        self.set_signed(self.keys.of(schema.GROUP, digest), {"group": text}, schema.GROUP)
        return digest

    def get_group(self, digest: str) -> list[str] | None:
        """That list, or None if absent or not to be trusted."""
        return self.record(self.keys.of(schema.GROUP, digest), schema.GROUP)

    def worlds(self, version: str) -> list[tuple[int, int]]:
        """``(rank, world size)`` pairs named by ``version``'s index keys (a hint)."""
        out = set()
        for key in self._scan(self.keys.of(schema.INDEX, version, ANY, ANY), limit=MAX_WORLD_KEYS):
            *_, rank, world = key.rsplit(":", 2)
            if rank.isdigit() and world.isdigit() and int(rank) < int(world) <= records.MAX_WORLD:
                out.add((int(rank), int(world)))
        return sorted(out)

    def put_position_truth(self, version: str, rank: int, world: int, truth: PositionTruth) -> bool:
        """Store what a rank of ``truth.layout`` holds unless a record is stored."""
        key = self.keys.of(schema.POSITION_TRUTH, version, rank, world, truth.layout, truth.scheme)
        value: dict[str, object] = {"layout": truth.layout, "scheme": truth.scheme,
                                    "macs": encode_macs(truth.macs)}
        if truth.marginals:
            value["marginals"] = encode_marginals(truth.marginals)
        return self.set_signed(key, value, schema.POSITION_TRUTH, nx=True)

    def keep_positions(self, version: str, rank: int, world: int, layout: Layout,
                       truth: PositionTruth | None, *, store_layout: bool) -> None:
        """A holder's heartbeat: its position truth and layout stay in Redis (an untrusted
        record replaced, a trusted one never)."""
        if truth is not None and not self.put_position_truth(version, rank, world, truth):
            key = self.keys.of(schema.POSITION_TRUTH, version, rank, world, layout.digest,
                               truth.scheme)
            try:
                self.read(key, schema.POSITION_TRUTH)
            except UntrustedRecordError:  # forged or garbage: this holder's verified one wins
                self.delete(key)
                self.put_position_truth(version, rank, world, truth)
            self.extend(key, schema.POSITION_TRUTH.ttl(self.settings), what="heartbeat")
        if store_layout:
            self.put_layout(layout)

    def get_position_truth(self, version: str, rank: int, world: int, layout_digest: str,
                           scheme: str) -> PositionTruth | None:
        """That record, or None if absent; :class:`UntrustedRecordError` if untrusted."""
        key = self.keys.of(schema.POSITION_TRUTH, version, rank, world, layout_digest, scheme)
        got = self.read(key, schema.POSITION_TRUTH)
        return None if got is None else got[0]
