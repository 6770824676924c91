"""Ground truth: the integrity hashes a storage load stored, per skeleton flavour.

One record per manifest digest and verification scheme (a rolling upgrade's two schemes
keep two truths). Written ``SET NX``, overwritten only by a storage loader that
disagrees, and re-published by every holder at each heartbeat (after a ``FLUSHALL``, a
failover to an empty replica, or over a forged record).
"""

from __future__ import annotations

import hashlib

import redis

from nccl_back.config import Settings
from nccl_back.coord import schema
from nccl_back.coord.keys import ANY
from nccl_back.coord.records import PeerInfo
from nccl_back.coord.signed_store import WRONG_TYPE, SignedStore, log, ms
from nccl_back.errors import UntrustedRecordError

__all__ = ["TruthRecords", "encode_truth", "truth_for_mode"]

#: Separates the hash mode from the layer name in stored ground truth ("sampled|layer0").
TRUTH_SEP = "|"


def encode_truth(by_mode: dict[str, dict[str, str]]) -> dict[str, str]:
    """``{mode: {layer: hash}}`` -> the flat ``{"mode|layer": hash}`` stored in Redis."""
    return {f"{mode}{TRUTH_SEP}{layer}": h for mode, hashes in by_mode.items()
            for layer, h in hashes.items()}


def truth_for_mode(hashes: dict[str, str], mode: str) -> dict[str, str]:
    """The ``mode`` part of stored ground truth, keyed by layer (inverse of :func:`encode_truth`)."""
    prefix = mode + TRUTH_SEP
    return {k[len(prefix):]: v for k, v in hashes.items() if k.startswith(prefix)}


class TruthRecords(SignedStore):
    """The ground-truth record family."""

    def __init__(self, settings: Settings, client: redis.Redis | None = None) -> None:
        super().__init__(settings, client)
        self._good_truth: dict[str, str] = {}
        """SHA-1 of the ground-truth value a heartbeat last verified, by key."""

    @staticmethod
    def _value(manifest_digest: str, scheme: str, hashes: dict[str, str]) -> dict[str, object]:
        return {"manifest_digest": manifest_digest, "scheme": scheme, "hashes": hashes}

    def put_ground_truth(self, version: str, rank: int, world_size: int, manifest_digest: str,
                         scheme: str, hashes: dict[str, str]) -> bool:
        """Store the integrity hashes of a storage load unless some exist (a peer load must
        not replace what storage said); whether this call stored them."""
        key = self.keys.of(schema.GROUND_TRUTH, version, rank, world_size, manifest_digest,
                           scheme)
        return self.set_signed(key, self._value(manifest_digest, scheme, hashes),
                               schema.GROUND_TRUTH, nx=True)

    def replace_ground_truth(self, version: str, rank: int, world_size: int, manifest_digest: str,
                             scheme: str, hashes: dict[str, str]) -> None:
        """Overwrite the ground truth: a storage loader holds CRC32C-checked bytes, so
        its view wins over a stored record that is untrusted or disagrees with it."""
        key = self.keys.of(schema.GROUND_TRUTH, version, rank, world_size, manifest_digest,
                           scheme)
        self.set_signed(key, self._value(manifest_digest, scheme, hashes), schema.GROUND_TRUTH)

    def get_ground_truth(self, version: str, rank: int, world_size: int, manifest_digest: str,
                         scheme: str) -> dict[str, str] | None:
        """The hashes a storage load stored for this skeleton flavour, or None;
        :class:`UntrustedRecordError` (logged, counted) for an untrusted record."""
        key = self.keys.of(schema.GROUND_TRUTH, version, rank, world_size, manifest_digest,
                           scheme)
        got = self.read(key, schema.GROUND_TRUTH)
        return None if got is None else got[0].hashes

    def has_ground_truth(self, version: str, rank: int, world_size: int, scheme: str) -> bool:
        """Whether ground truth of any skeleton flavour exists for this rank (``status``)."""
        glob = self.keys.of(schema.GROUND_TRUTH, version, rank, world_size, ANY, scheme)
        return any(True for _ in self._scan(glob, limit=1))

    def keep_ground_truth(self, info: PeerInfo, scheme: str, truth: dict[str, str]) -> None:
        """Keep the ground truth of ``info``'s flavour alive: extend it while it is the value
        last verified; write ``truth`` if absent, of another type or untrusted; leave a
        trusted record that says otherwise."""
        key = self.keys.of(schema.GROUND_TRUTH, info.version, info.rank, info.world_size,
                           info.manifest_digest, scheme)
        ttl = schema.GROUND_TRUTH.ttl(self.settings)
        state = int(self._call("keep_truth", lambda: self.lua.keep_truth(
            keys=[key], args=[self._good_truth.get(key, ""), ms(ttl), schema.GROUND_TRUTH.max_bytes])))
        if state == 1:
            return
        value = self._value(info.manifest_digest, scheme, truth)
        if state in (0, -1):  # SET NX drops another type first
            if self.set_signed(key, value, schema.GROUND_TRUTH, nx=True):
                log.info("ground_truth_republished", key=key, was="absent" if state == 0 else "wrong type")
            self._good_truth.pop(key, None)
            return
        raw, ttl_ms = self._get_with_ttl(key, schema.GROUND_TRUTH)
        if raw is None or raw is WRONG_TYPE:
            return  # changed again meanwhile: the next beat sees it
        try:
            self._trusted(key, raw, schema.GROUND_TRUTH, ttl_ms)
        except UntrustedRecordError as e:
            self.reject(schema.GROUND_TRUTH.kind, key, f"{e}; replaced by a holder")
            if self._take(key, raw, self.signed(key, value, schema.GROUND_TRUTH), ttl):
                log.info("ground_truth_republished", key=key, was="untrusted")
            return
        self._good_truth[key] = hashlib.sha1(raw).hexdigest()
        self.extend(key, ttl)

    def _extend_ground_truth(self, info: PeerInfo, scheme: str) -> None:
        """A heartbeat without the truth in hand: extend whatever record is there."""
        key = self.keys.of(schema.GROUND_TRUTH, info.version, info.rank, info.world_size,
                           info.manifest_digest, scheme)
        self.extend(key, schema.GROUND_TRUTH.ttl(self.settings), what="heartbeat")
