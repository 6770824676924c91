"""Send slots: a receiver claims one of a peer's ``max_sends`` slots before it asks.

A claim is taken through :meth:`SignedStore.acquire` (an untrusted one is taken over,
not obeyed) and renewed by re-signing it with a compare-and-set. It expires by itself if
its receiver dies; renewal and release act only while it holds the caller's token, so a
late release never frees a slot another receiver took.
"""

from __future__ import annotations

import hashlib
import random
import uuid

from nccl_back.coord import schema
from nccl_back.coord.keys import ANY
from nccl_back.coord.records import Claim, PeerInfo
from nccl_back.coord.signed_store import SignedStore
from nccl_back.errors import RegistryError


class ClaimRecords(SignedStore):
    """The send-slot record family."""

    def claim(self, peer_id: str, receiver_id: str, max_sends: int, ttl: float,
              share: str | None = None) -> str | None:
        """Take one of ``peer_id``'s ``max_sends`` send slots for ``ttl`` seconds: a token for
        :meth:`renew_claim` and :meth:`release`, or None when every slot is taken.

        ``share`` (32 hex digits, the same on every rank of one receiving group): the token
        is ``{slot}:{share}``, a rank finding its group's token holds the slot too, and
        every rank tries the slots in one order drawn from ``share``, so racing ranks meet
        in the same slot: the group takes one, as one receiver.
        """
        if share is None:
            order = random.sample(range(max_sends), max_sends)
        else:
            order = random.Random(hashlib.sha256(share.encode()).digest()).sample(
                range(max_sends), max_sends)
        for slot in order:
            token = f"{slot}:{share or uuid.uuid4().hex}"
            key = self.keys.of(schema.CLAIM, peer_id, slot)
            if self.acquire(key, {"token": token, "receiver": receiver_id},
                            schema.CLAIM, ttl) is not None:
                return token
            if share is not None and self._held_as(key, token, ttl):
                return token
        return None

    def _held_as(self, key: str, token: str, ttl: float) -> bool:
        """Whether the trusted claim at ``key`` holds ``token``."""
        claim: Claim | None = self.record(key, schema.CLAIM, ttl=ttl)
        return claim is not None and claim.token == token

    def release(self, peer_id: str, token: str) -> None:
        """Free the slot ``token`` holds, if it still does; only tidies (never an error)."""
        key = self.keys.of(schema.CLAIM, peer_id, _claim_slot(token))
        self.tidy("release", lambda: self.lua.release(keys=[key], args=[token]))

    def renew_claim(self, peer_id: str, token: str, ttl: float) -> bool:
        """Re-sign the slot ``token`` holds for another ``ttl`` seconds; False if no longer ours."""
        key = self.keys.of(schema.CLAIM, peer_id, _claim_slot(token))
        got = self.get_signed(key, schema.CLAIM, ttl=ttl)
        if got is None or got[0].token != token:
            return False
        new = self.signed(key, {"token": token, "receiver": got[0].receiver}, schema.CLAIM, ttl)
        # Another rank of a sharing group may have renewed it meanwhile: still ours.
        return self.compare_and_set(key, got[1], new, ttl) or self._held_as(key, token, ttl)

    def active_claims(self, peer_id: str) -> int:
        """How many send slots of ``peer_id`` are taken now."""
        return sum(1 for _ in self._scan(self.keys.of(schema.CLAIM, peer_id, ANY), limit=1024))

    def _claim_counts(self, peers: list[PeerInfo]) -> dict[str, int]:
        """Taken slots of each peer, in one round trip."""
        if not peers:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for p in peers:
            pipe.exists(*[self.keys.of(schema.CLAIM, p.peer_id, s)
                          for s in range(max(p.max_sends, 1))])
        counts = self._call("EXISTS", pipe.execute)
        return {p.peer_id: int(c) for p, c in zip(peers, counts, strict=True)}


def _claim_slot(token: str) -> int:
    slot, sep, _ = token.partition(":")
    if not sep or not slot.isdigit():
        raise RegistryError(f"malformed claim token {token!r}")
    return int(slot)
