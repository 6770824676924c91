"""Availability: which peers hold which version, for which rank.

A peer entry and its rank's index of peer ids are written in one step and kept alive by
the holder's heartbeat (with its ground truth and request queue). The index is only a
hint to avoid ``SCAN`` on the hot path: the entries are the truth, dead members are
pruned when read, and a garbage index is bypassed by scanning the entries, so a hint
never hides a live holder.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from nccl_back import _clock
from nccl_back.coord import records, schema
from nccl_back.coord.claims import ClaimRecords
from nccl_back.coord.keys import ANY
from nccl_back.coord.records import PeerInfo
from nccl_back.coord.requests import RequestRecords
from nccl_back.coord.signed_store import WRONG_TYPE, SignedStore, log, ms
from nccl_back.coord.truth import TruthRecords
from nccl_back.errors import ConfigError, RecordKind

_KEY_UNSAFE = " :*?[]"

#: Members of a peer index read at most; a bigger index is garbage (real fleets hold
#: far fewer peers of one version and rank): dropped, and the peer keys scanned instead.
MAX_INDEX = 1024


@dataclass(frozen=True)
class PeerStatus:
    """One peer as :meth:`PeerRecords.list_all` reports it."""

    info: PeerInfo
    age: float
    """Seconds since the peer finished loading."""
    ttl: float
    """Seconds until the entry expires without a heartbeat."""
    active_claims: int

    @property
    def busy(self) -> bool:
        return self.active_claims >= self.info.max_sends


class PeerRecords(ClaimRecords, TruthRecords, RequestRecords, SignedStore):
    """The peer-entry and index record families (with what a heartbeat keeps alive)."""

    def publish_peer(self, info: PeerInfo) -> None:
        """Announce that ``info.peer_id`` holds ``info.version`` (visible for ``peer_ttl``)."""
        for field_name in ("peer_id", "version"):
            value = getattr(info, field_name)
            # Both are parts of key names that are split and globbed later.
            if not value or any(c in value for c in _KEY_UNSAFE):
                raise ConfigError(f"{field_name}={value!r}: must be non-empty, without ':', spaces or globs")
        ttl = ms(self.settings.peer_ttl)
        key = self.keys.of(schema.PEER, info.version, info.rank, info.world_size, info.peer_id)
        # Re-signed at every heartbeat, so the expiry inside the signature moves too.
        value = self.signed(key, asdict(info), schema.PEER)
        index = self.keys.of(schema.INDEX, info.version, info.rank, info.world_size)
        self._call("publish", lambda: self.lua.publish(keys=[key, index],
                                                       args=[value, ttl, info.peer_id, MAX_INDEX]))
        log.debug("peer_published", peer_id=info.peer_id, version=info.version, rank=info.rank)

    def heartbeat(self, info: PeerInfo, scheme: str, truth: dict[str, str] | None = None) -> None:
        """Refresh the peer's keys and the ground truth it relies on.

        Re-writes the entry, so one that expired (a GC pause, a Redis restart) reappears.
        ``truth`` (stored form) is re-published when gone or untrusted, before the entry,
        so receivers never find the peer without its truth.
        """
        if truth:
            self.keep_ground_truth(info, scheme, truth)
        self.publish_peer(info)
        if not truth:
            self._extend_ground_truth(info, scheme)
        self._keep_requests(info.peer_id)

    def withdraw(self, peer_id: str, version: str) -> None:
        """Remove every availability entry of ``peer_id`` for ``version`` (all ranks)."""
        keys = list(self._scan(self.keys.of(schema.PEER, version, ANY, ANY, peer_id)))
        queue = self.keys.of(schema.REQUEST, peer_id)
        self._call("withdraw", lambda: self.client.delete(*keys, queue))
        if keys:  # the index is a hint: pruning it only tidies, whatever is there
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                _, rank, world, _ = self.keys.peer_parts(key)
                pipe.srem(self.keys.of(schema.INDEX, version, rank, world), peer_id)
            self.tidy("SREM", pipe.execute)
        log.debug("peer_withdrawn", peer_id=peer_id, version=version)

    def find_peers(self, version: str, rank: int, world_size: int) -> list[PeerInfo]:
        """Live peers holding ``version`` for this rank, least-claimed first (ties at random,
        so receivers starting together spread across peers)."""
        index = self.keys.of(schema.INDEX, version, rank, world_size)
        ids = self._peer_ids(index, version, rank, world_size)
        if not ids:
            return []
        keys = [self.keys.of(schema.PEER, version, rank, world_size, pid) for pid in ids]
        raws, ttls = self._get_with_ttls(keys, schema.PEER)
        # Only absent keys are dead: another type is a live holder's overwritten entry.
        dead = [pid for pid, raw in zip(ids, raws, strict=True) if raw is None]
        if dead and len(dead) < len(ids):  # a hint's pruning: never a registry error
            self.tidy("SREM", lambda: self.client.srem(index, *dead))
        elif dead:
            # Dead peers only: stale or forged; the peer keys are the truth. Not pruned:
            # emptied, it would read as no index to the next reader, which would take the
            # download lease at once (a forgery must cost a wait for the holders'
            # heartbeat, not storage reads). A holder's publication resets it.
            glob = self.keys.of(schema.PEER, version, rank, world_size, ANY)
            keys = sorted(self._scan(glob, limit=MAX_INDEX))
            if not keys:
                return []
            self.reject(RecordKind.INDEX, index, f"{len(ids)} members, none alive; peer keys scanned")
            raws, ttls = self._get_with_ttls(keys, schema.PEER)
        peers = [p for p, _ in self._entries(keys, raws, ttls)
                 if (p.version, p.rank, p.world_size) == (version, rank, world_size)]
        claims = self._claim_counts(peers)
        random.shuffle(peers)
        peers.sort(key=lambda p: claims[p.peer_id] / max(p.max_sends, 1))
        return peers

    def _peer_ids(self, index: str, version: str, rank: int, world_size: int) -> list[str]:
        """The peer ids of the index, or of the peer keys when the index is garbage:
        bypassed, not dropped (the next reader would find no index while entries exist);
        the holders' next heartbeats replace it."""
        got = self.members(index, schema.INDEX, MAX_INDEX)
        if got is WRONG_TYPE:
            why = "wrong Redis type"
        else:
            n, members = got
            ids = sorted({m.decode() for m in members if len(m) <= 200
                          and records.IDENT.fullmatch(m.decode("ascii", "replace"))})
            if n <= MAX_INDEX and (ids or not n):
                return ids
            # Members but no peer id among them (bytes flipped, garbage): as garbage.
            why = f"{n} members, more than {MAX_INDEX}" if n > MAX_INDEX else f"{n} members, none a peer id"
        self.reject(RecordKind.INDEX, index, f"{why}; peer keys scanned instead")
        prefix = self.keys.of(schema.PEER, version, rank, world_size, "")  # the peer id follows it
        return sorted(k[len(prefix):] for k in self._scan(prefix + ANY, limit=MAX_INDEX))

    def _entries(self, keys: list[str], raws: list[Any],
                 ttls: list[int]) -> list[tuple[PeerInfo, int]]:
        """The verified entries (each describing its key) with their PTTLs; one bad entry
        never hides the good ones (another Redis type was rejected when read)."""
        return [(info, int(ttl_ms)) for key, raw, ttl_ms in zip(keys, raws, ttls, strict=True)
                if raw is not None and raw is not WRONG_TYPE
                and (info := self.parse(key, raw, schema.PEER, ttl_ms=ttl_ms)) is not None]

    def list_all(self) -> dict[str, list[PeerStatus]]:
        """Every live peer, grouped by version (for ``nccl-back status``)."""
        keys = list(self._scan(self.keys.key(schema.PEER.prefix, ANY)))
        if not keys:
            return {}
        raws, ttls = self._get_with_ttls(keys, schema.PEER)
        peers = [(info, max(ttl_ms, 0) / 1000) for info, ttl_ms in self._entries(keys, raws, ttls)]
        claims = self._claim_counts([p for p, _ in peers])
        now = _clock.wall()
        out: dict[str, list[PeerStatus]] = {}
        for info, ttl in sorted(peers, key=lambda x: (x[0].version, x[0].rank, x[0].peer_id)):
            out.setdefault(info.version, []).append(
                PeerStatus(info, max(now - info.started_at, 0.0), ttl, claims[info.peer_id])
            )
        return out
