"""Redis key names: every coordination key is built (and every key name parsed) here,
from the record schema's prefixes (:mod:`.schema`).

Every key lives under ``{namespace}:``, a hash tag, so on a Redis Cluster a whole
namespace sits in one slot (multi-key commands and Lua scripts need that). A cohort's
chains are ``{cohort}:{epoch}:{chain}``, named inside the join script. The methods also
build ``SCAN`` globs (pass :data:`ANY` for a part; :meth:`Registry.publish_peer` refuses
glob characters in ids), so a glob and its keys are spelled by the same method.
"""

from __future__ import annotations

from nccl_back.coord import schema as K

#: Any value of one key part, in a ``SCAN`` glob.
ANY = "*"


class Keys:
    """The key names of one namespace (a value: cheap, immutable, shared by threads)."""

    def __init__(self, namespace: str) -> None:
        self._tag = "{" + namespace + "}"

    def key(self, *parts: object) -> str:
        """``{namespace}:part1:part2...`` (parts joined as ``str``)."""
        return ":".join([self._tag, *(str(p) for p in parts)])

    # -- availability -----------------------------------------------------------------

    def peer(self, version: str, rank: int | str, world_size: int | str, peer_id: str) -> str:
        """One peer's entry for one rank of ``version``."""
        return self.key(K.PEER.prefix, version, rank, world_size, peer_id)

    def peer_prefix(self, version: str, rank: int | str, world_size: int | str) -> str:
        """What every peer key of one rank starts with (the peer id follows it)."""
        return self.peer(version, rank, world_size, "")

    def all_peers(self) -> str:
        """The glob of every peer entry (``nccl-back status``)."""
        return self.key(K.PEER.prefix, ANY)

    def peer_parts(self, key: str) -> tuple[str, str, str, str]:
        """``(version, rank, world_size, peer_id)`` of a peer key, as the strings in it."""
        _, _, version, rank, world, peer_id = key.rsplit(":", 5)
        return version, rank, world, peer_id

    def peer_index(self, version: str, rank: int | str, world_size: int | str) -> str:
        """The set of peer ids of one rank (a hint: the peer keys are the truth)."""
        return self.key(K.INDEX.prefix, version, rank, world_size)

    # -- ground truth, send slots, requests, the download lease ---------------------------

    def ground_truth(self, version: str, rank: int | str, world_size: int | str,
                     manifest_digest: str, scheme: str) -> str:
        """Ground truth of one rank's skeleton flavour under one verification scheme."""
        return self.key(K.GROUND_TRUTH.prefix, version, rank, world_size, manifest_digest, scheme)

    def layout(self, layout_digest: str) -> str:
        """A layout description, content-addressed by its digest (resharding)."""
        return self.key(K.LAYOUT_RECORD.prefix, layout_digest)

    def group(self, group_digest: str) -> str:
        """The holder layouts a reshard plan is computed over, content-addressed."""
        return self.key(K.GROUP.prefix, group_digest)

    def position_truth(self, version: str, rank: int | str, world_size: int | str,
                       layout_digest: str, scheme: str) -> str:
        """Truth in checkpoint coordinates of one rank's layout, under one scheme."""
        return self.key(K.POSITION_TRUTH.prefix, version, rank, world_size, layout_digest, scheme)

    def claim(self, peer_id: str, slot: int | str) -> str:
        """One of ``peer_id``'s send slots."""
        return self.key(K.CLAIM.prefix, peer_id, slot)

    def requests(self, peer_id: str) -> str:
        """The queue of transfer requests ``peer_id`` (a peer or a relay member) serves."""
        return self.key(K.REQUEST.prefix, peer_id)

    def lease(self, version: str, world_size: int) -> str:
        """The single-flight download lease of ``version`` for workers of ``world_size`` ranks."""
        return self.key(K.LEASE.prefix, version, world_size)

    def download_group(self, version: str, world_size: int) -> str:
        """The workers of ``world_size`` ranks waiting together for ``version``."""
        return self.key(K.DOWNLOAD_GROUP.prefix, version, world_size)

    def download_roster(self, version: str, world_size: int) -> str:
        """The members of ``version``'s cooperative download, named by the worker elected."""
        return self.key(K.DOWNLOAD_ROSTER.prefix, version, world_size)

    def download_member(self, version: str, rank: int, world_size: int, member: int) -> str:
        """Where member ``member`` of a cooperative download serves one rank's part."""
        return self.key(K.DOWNLOAD_MEMBER.prefix, version, rank, world_size, member)

    def download_rescue(self, version: str, rank: int, world_size: int) -> str:
        """The failed members' parts of a cooperative download, spread over the others."""
        return self.key(K.DOWNLOAD_RESCUE.prefix, version, rank, world_size)

    # -- relay: cohorts and streamed downloads ----------------------------------------------

    def cohort(self, version: str, rank: int, world_size: int, manifest_digest: str) -> str:
        """The current cohort of receivers of one rank's skeleton flavour."""
        return self.key(K.COHORT.prefix, version, rank, world_size, manifest_digest)

    def cohort_of_chain(self, chain: str) -> str | None:
        """The cohort key a chain key belongs to (its records are signed for it), or
        None if ``chain`` is no cohort chain of this namespace."""
        if not chain.startswith(self.key(K.COHORT.prefix, "")):
            return None
        return chain.rsplit(":", 2)[0]

    @staticmethod
    def chain_place(chain: str) -> list[str]:
        """``[epoch, chain index]`` of a chain key: how a log line names a chain."""
        return chain.rsplit(":", 2)[-2:]

    def gone(self, member_id: str) -> str:
        """A relay endpoint that has stopped: members behind it skip it at once."""
        return self.key(K.GONE.prefix, member_id)

    def verdict(self, member_id: str) -> str:
        """A relay member's own check, passed or failed."""
        return self.key(K.VERDICT.prefix, member_id)

    def alive(self, member_id: str) -> str:
        """A relay endpoint's liveness mark: a stopped one's lapses within its TTL."""
        return self.key(K.ALIVE.prefix, member_id)

    def stream(self, version: str, rank: int, world_size: int, manifest_digest: str) -> str:
        """The relay endpoint of the worker downloading one rank's skeleton flavour."""
        return self.key(K.STREAM.prefix, version, rank, world_size, manifest_digest)

    # -- artifact sets (compile caches) ------------------------------------------------------

    def artifact_set(self, lookup: str) -> str:
        """The manifest of the artifact set published under ``lookup``."""
        return self.key(K.ARTIFACT_SET.prefix, lookup)

    def artifact_index(self, scope: str) -> str:
        """The newest artifact set of one model (``scope``: its weights' version)."""
        return self.key(K.ARTIFACT_INDEX.prefix, scope)

    # -- per-transfer keys --------------------------------------------------------------------

    def handshake(self, transfer_id: str, name: str) -> str:
        """A per-transfer key (handshake nonces, refusals), scoped by ``transfer_id``."""
        return self.key(K.HANDSHAKE.prefix, transfer_id, name)

    def rendezvous(self, scope: str, name: str) -> str:
        """A process group's bootstrap key (``scope``: :func:`.auth.transfer_scope`)."""
        return self.key(K.RENDEZVOUS.prefix, scope, name)

    def check(self, token: str) -> str:
        """``nccl-back check``'s write/read round trip."""
        return self.key(K.CHECK.prefix, token)
