"""Ground truth: the integrity hashes a storage load stored, per skeleton flavour.

Keyed by version, rank, world size and manifest digest (each flavour, equally valid
with another layout, has its own), signed without an expiry inside (heartbeats keep it
alive with ``PEXPIRE``). Written ``SET NX`` by a storage loader (a worker that loaded
from a peer must never replace what storage said), overwritten only by a storage
loader that disagrees (:meth:`TruthRecords.replace_ground_truth`), and re-published by
every holder at each heartbeat: after a ``FLUSHALL``, a failover to an empty replica,
or over a forged record (:meth:`TruthRecords.keep_ground_truth`).
"""

from __future__ import annotations

import hashlib

import redis

from nccl_back.config import Settings
from nccl_back.coord import records
from nccl_back.coord.keys import ANY
from nccl_back.coord.records import PeerInfo
from nccl_back.coord.store import WRONG_TYPE, SignedStore, log, ms
from nccl_back.errors import RecordKind, UntrustedRecordError

#: Ground truth outlives a few missed heartbeats and the gap between a storage load and
#: the loader's first publish; once nobody relying on it is alive it may expire, and the
#: next storage loader writes it again.
GROUND_TRUTH_TTL_FACTOR = 6

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

    def ground_truth_key(self, version: str, rank: int, world_size: int, manifest_digest: str) -> str:
        """Ground truth of one rank's skeleton flavour (keyed by its manifest digest)."""
        return self.keys.ground_truth(version, rank, world_size, manifest_digest)

    @property
    def _ground_truth_ttl(self) -> float:
        return self.settings.peer_ttl * GROUND_TRUTH_TTL_FACTOR

    def put_ground_truth(
        self, version: str, rank: int, world_size: int, manifest_digest: str, hashes: dict[str, str]
    ) -> bool:
        """Store the integrity hashes of a storage load, unless some already exist.

        Keyed by the manifest digest too, so each skeleton flavour (equally valid, with
        another layout) has its own. SET NX: ground truth is never overwritten (a worker
        that loaded from a peer must not replace what storage said). Returns True if this
        call stored it.
        """
        value = {"manifest_digest": manifest_digest, "hashes": hashes}
        key = self.ground_truth_key(version, rank, world_size, manifest_digest)
        # No expiry inside the signature: heartbeats keep it alive with PEXPIRE.
        return self.set_signed(key, value, self._ground_truth_ttl, nx=True, expires=False)

    def replace_ground_truth(
        self, version: str, rank: int, world_size: int, manifest_digest: str, hashes: dict[str, str]
    ) -> None:
        """Overwrite the ground truth: a storage loader holds CRC32C-checked bytes, so
        its view wins over a stored record that is untrusted or disagrees with it."""
        value = {"manifest_digest": manifest_digest, "hashes": hashes}
        key = self.ground_truth_key(version, rank, world_size, manifest_digest)
        self.set_signed(key, value, self._ground_truth_ttl, expires=False)

    def get_ground_truth(
        self, version: str, rank: int, world_size: int, manifest_digest: str
    ) -> dict[str, str] | None:
        """The hashes a storage load stored for this skeleton flavour, or None.

        :class:`UntrustedRecordError` (logged, counted) if the stored record is
        unsigned, badly signed, malformed or kept without a TTL: never acted on.
        """
        key = self.ground_truth_key(version, rank, world_size, manifest_digest)
        raw, ttl_ms = self._get_with_ttl(key)
        if raw is WRONG_TYPE:
            raw = []  # a list or set: refused below as a wrong type
        if raw is None:
            return None
        try:
            return self._truth(key, raw, ttl_ms, manifest_digest)
        except UntrustedRecordError as e:
            self.reject(RecordKind.GROUND_TRUTH, key, str(e))
            raise

    def _truth(self, key: str, raw: object, ttl_ms: int, manifest_digest: str) -> dict[str, str]:
        """The hashes of a verified record stored at its own flavour's key."""
        value = self.verify(key, raw, RecordKind.GROUND_TRUTH, ttl_ms, records.MAX_GROUND_TRUTH_BYTES)
        digest, hashes = records.ground_truth(value)
        if digest != manifest_digest:
            raise UntrustedRecordError(f"{key}: digest {digest!r} under another key")
        return hashes

    def has_ground_truth(
        self, version: str, rank: int, world_size: int, manifest_digest: str | None = None
    ) -> bool:
        """Whether ground truth exists for this rank (of one flavour, or of any)."""
        if manifest_digest is not None:
            key = self.ground_truth_key(version, rank, world_size, manifest_digest)
            return bool(self._call("EXISTS", lambda: self.client.exists(key)))
        return any(True for _ in self._scan(self.keys.ground_truth(version, rank, world_size, ANY)))

    def keep_ground_truth(self, info: PeerInfo, truth: dict[str, str]) -> None:
        """Keep the ground-truth record of ``info``'s flavour alive and trustworthy: extend
        it while it is the value last verified; write ``truth`` (signed) if it is absent,
        of another type, or untrusted; leave a trusted record that says otherwise (a
        storage loader's replacement rules, see ``WeightService``)."""
        key = self.ground_truth_key(info.version, info.rank, info.world_size, info.manifest_digest)
        ttl = self._ground_truth_ttl
        state = int(self._call("keep_truth", lambda: self.lua.keep_truth(
            keys=[key], args=[self._good_truth.get(key, ""), ms(ttl)])))
        if state == 1:
            return
        value = {"manifest_digest": info.manifest_digest, "hashes": truth}
        if state in (0, -1):  # SET NX drops another type first
            if self.set_signed(key, value, ttl, nx=True, expires=False):
                log.info("ground_truth_republished", key=key, was="absent" if state == 0 else "wrong type")
            self._good_truth.pop(key, None)
            return
        raw, ttl_ms = self._get_with_ttl(key)
        if raw is None or raw is WRONG_TYPE:
            return  # changed again meanwhile: the next beat sees it
        try:
            self._truth(key, raw, ttl_ms, info.manifest_digest)
        except UntrustedRecordError as e:
            self.reject(RecordKind.GROUND_TRUTH, key, f"{e}; replaced by a holder")
            if self._take(key, str(raw), self.signed(key, value, ttl, expires=False), ttl):
                log.info("ground_truth_republished", key=key, was="untrusted")
            return
        self._good_truth[key] = hashlib.sha1(str(raw).encode()).hexdigest()
        self._call("PEXPIRE", lambda: self.client.pexpire(key, ms(ttl)))

    def _extend_ground_truth(self, info: PeerInfo) -> None:
        """A heartbeat without the truth in hand: extend whatever record is there."""
        key = self.ground_truth_key(info.version, info.rank, info.world_size, info.manifest_digest)
        self._call("heartbeat", lambda: self.client.pexpire(key, ms(self._ground_truth_ttl)))
