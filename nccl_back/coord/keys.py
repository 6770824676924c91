"""The Redis key schema: every coordination key is built (and every key name parsed) here.

Every key lives under ``{namespace}:``, a hash tag, so on a Redis Cluster a whole
namespace sits in one slot (multi-key commands, transactions and Lua scripts need
that); on one server it is just a prefix. Keys (``ns`` = namespace; ``v``/``r``/``w`` =
version, rank, world size; ``d`` = manifest digest)::

    key                                 value                          lifetime / writer
    ns:peer:{v}:{r}:{w}:{peer_id}       PeerInfo JSON, signed          TTL peer_ttl (heartbeat refreshes)
    ns:peers:{v}:{r}:{w}                set of peer_ids (index)        TTL peer_ttl (heartbeat refreshes)
    ns:gt:{v}:{r}:{w}:{d}               {"manifest_digest", "hashes"}  signed, SET NX, TTL ground_truth_ttl
                                        hashes keyed "{mode}|{layer}" (:func:`.truth.encode_truth`)
    ns:layout:{l}                       a layout's canonical JSON      signed, TTL ground truth's (layouts.py)
    ns:ct:{v}:{r}:{w}:{l}               MACs at sampled checkpoint     signed, SET NX, TTL ground truth's
                                        positions a layout ``l`` holds (:mod:`nccl_back.model.position_truth`)
    ns:claim:{peer_id}:{slot}           {"token", "receiver"}          signed, SET NX, TTL claim_ttl, renewed
    ns:req:{peer_id}                    list of request JSON, signed   TTL peer_ttl, newest 256 kept
    ns:dl:{v}:{w}                       {"owner": worker_id}           signed, expiring: download lease
    ns:cohort:{v}:{r}:{w}:{d}           hash {n, epoch}                TTL cohort_window (relay)
    ns:cohort:{v}:{r}:{w}:{d}:{e}:{c}   list of member JSON, signed    TTL transfer_timeout + busy_wait;
                                        (named inside the join script: the epoch ``e`` is read there)
    ns:stream:{v}:{r}:{w}:{d}           relay endpoint of a download   signed, TTL (relay)
    ns:gone:{member_id}                 {"member_id"}                  signed, TTL of a chain: a stopped
                                        relay endpoint, skipped by later members
    ns:hs:{transfer_id}:{name}          handshake values, refusals     signed, short TTL (handshake.py)
    ns:rdv:{scope}:{name}               a process group's bootstrap    HMAC'd, short TTL (transport/store.py)
    ns:check:{uuid}                     "1"                            10 s (``nccl-back check``'s round trip)
    ns:art:{k}                          an artifact set's manifest     signed, TTL 360 x peer_ttl; newest
                                        published under lookup key k   publisher wins (artifacts.py)
    ns:artidx:{s}                       a model's newest set: lookup   signed, same TTL (artifacts.py)
                                        key and factors (s: version)

The record-key methods also build the ``SCAN`` globs: pass ``"*"`` for a part (peer ids
and versions never hold ``:``, spaces or glob characters; :meth:`Registry.publish_peer`
refuses them), so a glob and the keys it matches are spelled by the same method.
"""

from __future__ import annotations

#: Any value of one key part, in a ``SCAN`` glob.
ANY = "*"


class Keys:
    """The key names of one namespace (a value: cheap, immutable, shared by threads)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._tag = "{" + namespace + "}"

    def key(self, *parts: object) -> str:
        """``{namespace}:part1:part2...`` (parts joined as ``str``)."""
        return ":".join([self._tag, *(str(p) for p in parts)])

    # -- availability -----------------------------------------------------------------

    def peer(self, version: str, rank: int | str, world_size: int | str, peer_id: str) -> str:
        """One peer's entry for one rank of ``version``."""
        return self.key("peer", version, rank, world_size, peer_id)

    def peer_prefix(self, version: str, rank: int | str, world_size: int | str) -> str:
        """What every peer key of one rank starts with (the peer id follows it)."""
        return self.peer(version, rank, world_size, "")

    def all_peers(self) -> str:
        """The glob of every peer entry (``nccl-back status``)."""
        return self.key("peer", ANY)

    def peer_parts(self, key: str) -> tuple[str, str, str, str]:
        """``(version, rank, world_size, peer_id)`` of a peer key, as the strings in it."""
        _, _, version, rank, world, peer_id = key.rsplit(":", 5)
        return version, rank, world, peer_id

    def peer_index(self, version: str, rank: int | str, world_size: int | str) -> str:
        """The set of peer ids of one rank (a hint: the peer keys are the truth)."""
        return self.key("peers", version, rank, world_size)

    # -- ground truth, send slots, requests, the download lease ---------------------------

    def ground_truth(self, version: str, rank: int | str, world_size: int | str,
                     manifest_digest: str) -> str:
        """Ground truth of one rank's skeleton flavour (keyed by its manifest digest)."""
        return self.key("gt", version, rank, world_size, manifest_digest)

    def layout(self, layout_digest: str) -> str:
        """A layout description, content-addressed by its digest (resharding)."""
        return self.key("layout", layout_digest)

    def position_truth(self, version: str, rank: int | str, world_size: int | str,
                       layout_digest: str) -> str:
        """Truth in checkpoint coordinates of the positions one rank's layout holds."""
        return self.key("ct", version, rank, world_size, layout_digest)

    def claim(self, peer_id: str, slot: int | str) -> str:
        """One of ``peer_id``'s send slots."""
        return self.key("claim", peer_id, slot)

    def requests(self, peer_id: str) -> str:
        """The queue of transfer requests ``peer_id`` (a peer or a relay member) serves."""
        return self.key("req", peer_id)

    def lease(self, version: str, world_size: int) -> str:
        """The single-flight download lease of ``version`` for workers of ``world_size``
        ranks: one per worker (taken by its rank 0), never one per rank."""
        return self.key("dl", version, world_size)

    # -- relay: cohorts and streamed downloads ----------------------------------------------

    def cohort(self, version: str, rank: int, world_size: int, manifest_digest: str) -> str:
        """The current cohort of receivers of one rank's skeleton flavour; its chains are
        ``{cohort}:{epoch}:{chain}`` (named by the join script)."""
        return self.key("cohort", version, rank, world_size, manifest_digest)

    def cohort_of_chain(self, chain: str) -> str | None:
        """The cohort key a chain key belongs to (its records are signed for it), or
        None if ``chain`` is no cohort chain of this namespace."""
        if not chain.startswith(self.key("cohort", "")):
            return None
        return chain.rsplit(":", 2)[0]

    @staticmethod
    def chain_place(chain: str) -> list[str]:
        """``[epoch, chain index]`` of a chain key: how a log line names a chain."""
        return chain.rsplit(":", 2)[-2:]

    def gone(self, member_id: str) -> str:
        """A relay endpoint that has stopped: members behind it skip it at once."""
        return self.key("gone", member_id)

    def stream(self, version: str, rank: int, world_size: int, manifest_digest: str) -> str:
        """The relay endpoint of the worker downloading one rank's skeleton flavour."""
        return self.key("stream", version, rank, world_size, manifest_digest)

    # -- artifact sets (compile caches) ------------------------------------------------------

    def artifact_set(self, lookup: str) -> str:
        """The manifest of the artifact set published under ``lookup``."""
        return self.key("art", lookup)

    def artifact_index(self, scope: str) -> str:
        """The newest artifact set of one model (``scope``: its weights' version)."""
        return self.key("artidx", scope)

    # -- per-transfer keys --------------------------------------------------------------------

    def handshake(self, transfer_id: str, name: str) -> str:
        """A per-transfer key (handshake nonces, refusals), scoped by ``transfer_id``."""
        return self.key("hs", transfer_id, name)

    def rendezvous(self, scope: str, name: str) -> str:
        """A process group's bootstrap key of one transfer (``scope``: its transfer id,
        with a token under a secret, :func:`.auth.transfer_scope`)."""
        return self.key("rdv", scope, name)

    def check(self, token: str) -> str:
        """``nccl-back check``'s write/read round trip."""
        return self.key("check", token)
