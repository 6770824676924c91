"""Resharding's record families: layout descriptions and truth in checkpoint coordinates.

- ``ns:layout:{l}``: a layout's canonical JSON, content-addressed (a record whose
  layout does not hash to ``l`` is rejected, whoever signed it). A holder with a layout
  stores it when it publishes; a resharding receiver stores its own before it asks, so
  a sender can compute the same plan.
- ``ns:ct:{v}:{r}:{w}:{l}``: the MACs at sampled checkpoint positions that one rank of
  layout ``l`` holds (:mod:`nccl_back.model.position_truth`), stored ``SET NX`` by a
  storage loader (or, for positions it verified, by a worker that resharded), signed
  without an expiry inside like ground truth. A receiver reads the records of the
  holders it receives from: together they hold every position it does.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

from nccl_back.coord import records
from nccl_back.coord.keys import ANY
from nccl_back.coord.store import WRONG_TYPE, SignedStore, ms
from nccl_back.coord.truth import GROUND_TRUTH_TTL_FACTOR
from nccl_back.errors import RecordKind, UntrustedRecordError
from nccl_back.model import layout as layouts

if TYPE_CHECKING:
    # position_truth imports torch; the registry must not (``nccl-back status``).
    from nccl_back.model.layout import Layout
    from nccl_back.model.position_truth import Macs


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _absent() -> str:
    """A MAC slot for a position nobody sampled (``.`` x its hex width)."""
    from nccl_back.model.position_truth import MAC_BYTES

    return "." * (2 * MAC_BYTES)


def encode_macs(macs: Macs) -> dict[str, str]:
    absent = _absent()
    return {name: "".join(absent if m is None else m for m in ms) for name, ms in macs.items()}


def decode_macs(data: object, what: str = "position truth") -> Macs:
    if not isinstance(data, dict) or len(data) > layouts.MAX_TENSORS:
        raise UntrustedRecordError(f"{what}: macs must be a bounded object")
    out: Macs = {}
    absent = _absent()
    width = len(absent)
    # Whole MACs of lowercase hex, or whole absent slots: one regex pass (C speed) per
    # tensor, as a TP=1 receiver parses ~28 000 of them for a 24-layer model.
    valid = re.compile(rf"(?:[0-9a-f]{{{width}}}|\.{{{width}}})*")
    for name, text in data.items():
        if not isinstance(name, str) or not isinstance(text, str) \
                or len(text) > width * 4096 or not valid.fullmatch(text):
            raise UntrustedRecordError(f"{what}: bad MACs for {str(name)[:40]!r}")
        out[name] = [None if c == absent else c for c in
                     (text[i:i + width] for i in range(0, len(text), width))]
    return out


def _text(value: dict[str, object], field: str) -> str:
    text = value.get(field)
    if not isinstance(text, str):
        raise UntrustedRecordError(f"{field} must be a string")
    return text


def parse_group(value: dict[str, object], digest: str) -> list[str]:
    """A group record's holder layouts: at most :data:`records.MAX_WORLD` layout digests
    (sha256, hex), joined by commas, hashing to ``digest`` (the key it is stored under)."""
    text = _text(value, "group")
    if len(text) > 65 * records.MAX_WORLD or hashlib.sha256(text.encode()).hexdigest() != digest:
        raise UntrustedRecordError("a group that does not hash to its key")
    digests = text.split(",")
    if not all(_SHA256.fullmatch(d) for d in digests):
        raise UntrustedRecordError("a group must list layout digests")
    return digests


class LayoutRecords(SignedStore):
    """Layout descriptions and position truth."""

    @property
    def _layout_ttl(self) -> float:
        return self.settings.peer_ttl * GROUND_TRUTH_TTL_FACTOR

    def put_layout(self, layout: Layout) -> None:
        """Store ``layout`` under its digest (refreshing its TTL)."""
        key = self.keys.layout(layout.digest)
        self.set_signed(key, {"layout": layout.dumps()}, self._layout_ttl, expires=False)

    def get_layout(self, digest: str) -> Layout | None:
        """The layout stored under ``digest``; None if absent or not to be trusted
        (rejected: logged, counted)."""
        key = self.keys.layout(digest)
        got = self.get_signed(key, RecordKind.LAYOUT, max_bytes=layouts.MAX_LAYOUT_BYTES)
        if got is None:
            return None
        try:
            return layouts.parse(_text(got[0], "layout"), digest)
        except UntrustedRecordError as e:
            self.reject(RecordKind.LAYOUT, key, str(e))
            return None

    def put_group(self, digests: list[str]) -> str:
        """Store the list of holder layouts a plan is computed over; returns its digest."""
        text = ",".join(digests)
        digest = hashlib.sha256(text.encode()).hexdigest()
        self.set_signed(self.keys.layout(digest), {"group": text}, self._layout_ttl, expires=False)
        return digest

    def get_group(self, digest: str) -> list[str] | None:
        """That list, or None if absent or not to be trusted."""
        key = self.keys.layout(digest)
        got = self.get_signed(key, RecordKind.LAYOUT)
        if got is None:
            return None
        try:
            return parse_group(got[0], digest)
        except UntrustedRecordError as e:
            self.reject(RecordKind.LAYOUT, key, str(e))
            return None

    def worlds(self, version: str) -> list[tuple[int, int]]:
        """Every ``(rank, world size)`` some live holder of ``version`` publishes."""
        out = set()
        for key in self._scan(self.keys.peer_index(version, ANY, ANY)):
            *_, rank, world = key.rsplit(":", 2)
            if rank.isdigit() and world.isdigit() and int(rank) < int(world) <= records.MAX_WORLD:
                out.add((int(rank), int(world)))
        return sorted(out)

    def put_position_truth(self, version: str, rank: int, world: int, layout_digest: str,
                           macs: Macs) -> bool:
        """Store the MACs a rank of ``layout_digest`` holds unless some are stored."""
        key = self.keys.position_truth(version, rank, world, layout_digest)
        value = {"layout": layout_digest, "macs": encode_macs(macs)}
        return self.set_signed(key, value, self._layout_ttl, nx=True, expires=False)

    def keep_positions(self, version: str, rank: int, world: int, layout: Layout,
                       macs: Macs | None, *, store_layout: bool) -> None:
        """A holder's heartbeat: its position truth and layout stay in Redis (re-stored
        after Redis lost them, ``SET NX``: a stored record is never replaced here)."""
        key = self.keys.position_truth(version, rank, world, layout.digest)
        if macs is not None:
            self.put_position_truth(version, rank, world, layout.digest, macs)
        self._call("heartbeat", lambda: self.client.pexpire(key, ms(self._layout_ttl)))
        if store_layout:
            self.put_layout(layout)

    def get_position_truth(self, version: str, rank: int, world: int,
                           layout_digest: str) -> Macs | None:
        """That record, or None if absent; :class:`UntrustedRecordError` (logged,
        counted) if it is not to be trusted."""
        key = self.keys.position_truth(version, rank, world, layout_digest)
        raw, ttl_ms = self._get_with_ttl(key)
        if raw is None:
            return None
        try:
            if raw is WRONG_TYPE:
                raise UntrustedRecordError("wrong Redis type")
            value = self.verify(key, raw, RecordKind.POSITION_TRUTH, ttl_ms,
                                records.MAX_GROUND_TRUTH_BYTES)
            if value.get("layout") != layout_digest:
                raise UntrustedRecordError(f"{key}: another layout's truth")
            return decode_macs(value.get("macs"))
        except UntrustedRecordError as e:
            self.reject(RecordKind.POSITION_TRUTH, key, str(e))
            raise
