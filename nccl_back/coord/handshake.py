"""The liveness handshake: prove both sides are alive *now*, before any communicator.

A registry entry says a peer existed at some moment, not that it is alive; creating a
communicator against a dead peer hangs (``ncclCommInitRank`` has no timeout). So the
two sides first exchange nonces through Redis, under keys scoped by a fresh
``transfer_id`` (a uuid per attempt), so keys left by an earlier attempt can never
satisfy this one::

    R = ns:hs:{transfer_id}:receiver_ready      S = ns:hs:{transfer_id}:sender_ready
    each value: {"by": "receiver"|"sender", "value": int, "digest": manifest digest}

    receiver                                    sender
    --------                                    ------
    R0 WRITE_X   R := {receiver, X, d_r}
                 (after_ready(): e.g. push the transfer request)
                                                S0 WAIT_X    poll R until by=receiver
                                                S1 ACK_X     R := {sender, X+1, d_s}
                                                             d_r != d_s -> ManifestMismatchError
                                                S2 WRITE_Y   S := {sender, Y, d_s}
    R1 WAIT_ACK  poll R until value=X+1
                 d_s != d_r -> ManifestMismatchError
                 R = {sender, refused} -> the sender refused (see below)
    R2 WAIT_Y    poll S until by=sender
    R3 ACK_Y     S := {receiver, Y+1, d_r}    -> done
                 only if S is still {sender, Y}
                 (atomic compare-and-set)
                                                S3 WAIT_ACK  poll S until value=Y+1 -> done
                                                             deadline: S := {sender,
                                                             abandoned} only if still
                                                             {sender, Y} (atomic):
                                                             swapped -> abandoned
                                                             not swapped -> the ack landed

The last step races by nature (the ack may land as the sender's deadline passes): one
atomic operation on ``S`` settles it, so a receiver never believes in a transfer its
sender gave up. A sender that will not serve says so before creating anything
(:func:`refuse`: ``R := {sender, refused: code}``); one that gives a transfer up after
the handshake writes ``S := {sender, abandoned}`` (:func:`abandon`), which the
receiver's guarded transfer reads once quiet instead of waiting out its stall bound.

Each side has one deadline (``sender_handshake``, 1 s: don't wait on a flaky receiver;
``handshake_timeout``, 10 s: the peer may be busy), past which
:class:`HandshakeTimeoutError` names the state. With a secret every value is signed for
its key with an expiry, and one that does not verify or parse reads as absent: a Redis
writer can neither complete nor refuse a handshake.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import Any

from nccl_back import _clock
from nccl_back.coord import schema
from nccl_back.coord.records import HandshakeValue
from nccl_back.coord.registry import Registry
from nccl_back.coord.schema import HANDSHAKE_KEY_TTL
from nccl_back.errors import (
    HandshakeTimeoutError,
    IncompatiblePeerError,
    ManifestMismatchError,
    NoPeerError,
    PeerError,
    RegistryError,
)
from nccl_back.log import get_logger
from nccl_back.timing import HANDSHAKE_POLL as POLL
from nccl_back.timing import HANDSHAKE_POLL_MAX as POLL_MAX

log = get_logger(__name__)

__all__ = ["REFUSALS", "abandon", "abandoned", "refuse", "run_receiver", "run_sender"]


#: Refusal codes a sender may write, and what the receiver raises for each.
REFUSALS: dict[str, type[PeerError]] = {
    "incompatible": IncompatiblePeerError,
    "draining": NoPeerError,
    "busy": NoPeerError,
    "version": ManifestMismatchError,
}


def keys(registry: Registry, transfer_id: str) -> tuple[str, str]:
    """The ``(receiver_ready, sender_ready)`` keys of one transfer."""
    return (
        registry.keys.of(schema.HANDSHAKE, transfer_id, "receiver_ready"),
        registry.keys.of(schema.HANDSHAKE, transfer_id, "sender_ready"),
    )


def refuse(registry: Registry, transfer_id: str, code: str, message: str) -> None:
    """The sender declines ``transfer_id`` (``code`` in :data:`REFUSALS`) before creating
    anything; the receiver waiting in R1 raises the matching error at once."""
    if code not in REFUSALS:
        raise ValueError(f"refusal code {code!r}: choose one of {sorted(REFUSALS)}")
    r_key, _ = keys(registry, transfer_id)
    registry.set_signed(r_key, {"by": "sender", "refused": code, "message": message[:500]},
                        schema.HANDSHAKE)


def abandon(registry: Registry, transfer_id: str) -> None:
    """The sender gives ``transfer_id`` up after its handshake: ``S :=`` the abandonment
    marker, which its receiver reads (:func:`abandoned`) and moves on at once."""
    _, s_key = keys(registry, transfer_id)
    registry.set_signed(s_key, _ABANDONED, schema.HANDSHAKE)


def abandoned(registry: Registry, transfer_id: str) -> bool:
    """Whether the sender gave ``transfer_id`` up (an untrusted value is no notice)."""
    _, s_key = keys(registry, transfer_id)
    found = registry.get_signed(s_key, schema.HANDSHAKE)
    return found is not None and found[0].abandoned


def run_receiver(
    registry: Registry,
    transfer_id: str,
    manifest_digest: str,
    timeout: float,
    *,
    after_ready: Callable[[], None] | None = None,
    gone: threading.Event | None = None,
) -> None:
    """The receiver's half (states R0-R3); returns once the sender proved it is alive.

    ``after_ready`` runs right after X is stored (pushing the request then starts the
    sender's short timeout only once X is there). ``gone``, once set (the sender's
    liveness record expired), ends the wait with :class:`NoPeerError`. Raises
    :class:`HandshakeTimeoutError`, :class:`ManifestMismatchError`, a refusal's error or
    :class:`RegistryError`, removing the keys.
    """
    r_key, s_key = keys(registry, transfer_id)
    deadline = _clock.monotonic() + timeout
    x = _nonce()
    try:
        registry.set_signed(r_key, _entry("receiver", x, manifest_digest), schema.HANDSHAKE)
        if after_ready is not None:
            after_ready()
        ack, _ = _wait(registry, r_key,
                       lambda v: v.by == "sender" and (v.value == x + 1 or v.refused is not None),
                       deadline, "R1 WAIT_ACK", transfer_id, gone)
        if ack.refused is not None:
            cls = REFUSALS.get(ack.refused, PeerError)
            raise cls(f"transfer {transfer_id}: the sender refused it ({ack.refused}):"
                      f" {ack.message[:500]}")
        _check_digest(manifest_digest, ack, "sender", transfer_id)
        got, got_raw = _wait(registry, s_key, lambda v: v.by == "sender",
                             deadline, "R2 WAIT_Y", transfer_id, gone)
        if got.abandoned:
            raise HandshakeTimeoutError(
                f"handshake for transfer {transfer_id}: the sender gave up (its deadline"
                " passed) before we read its nonce, state R2 WAIT_Y"
            )
        mine = registry.signed(s_key, _entry("receiver", got.value + 1, manifest_digest),
                               schema.HANDSHAKE)
        if not registry.compare_and_set(s_key, got_raw, mine, HANDSHAKE_KEY_TTL):
            raise HandshakeTimeoutError(
                f"handshake for transfer {transfer_id}: the sender gave up (its deadline"
                " passed) before our acknowledgement landed, state R3 ACK_Y"
            )
    except BaseException:
        registry.delete(r_key, s_key)  # only tidies (never raises): the error matters
        raise
    log.debug("handshake_done", side="receiver", transfer_id=transfer_id)


def run_sender(registry: Registry, transfer_id: str, manifest_digest: str, timeout: float) -> None:
    """The sender's half (states S0-S3); returns once the receiver proved it is alive.
    Raises :class:`HandshakeTimeoutError`, :class:`ManifestMismatchError` (after acking,
    so the receiver learns of it at once) or :class:`RegistryError`."""
    r_key, s_key = keys(registry, transfer_id)
    deadline = _clock.monotonic() + timeout
    abandoned = False
    try:
        got, _ = _wait(registry, r_key, lambda v: v.by == "receiver",
                       deadline, "S0 WAIT_X", transfer_id)
        registry.set_signed(r_key, _entry("sender", got.value + 1, manifest_digest),
                            schema.HANDSHAKE)
        _check_digest(manifest_digest, got, "receiver", transfer_id)
        y = _nonce()
        offer = registry.signed(s_key, _entry("sender", y, manifest_digest), schema.HANDSHAKE)
        registry.set_json(s_key, offer, HANDSHAKE_KEY_TTL)
        try:
            _wait(registry, s_key, lambda v: v.value == y + 1 and v.by == "receiver",
                  deadline, "S3 WAIT_ACK", transfer_id)
        except HandshakeTimeoutError:
            # Abandon atomically: if the ack landed meanwhile, the receiver is committed
            # and waits for us, so we go on instead. The marker stays for it to read.
            abandon = registry.signed(s_key, _ABANDONED, schema.HANDSHAKE)
            if registry.compare_and_set(s_key, offer, abandon, HANDSHAKE_KEY_TTL):
                abandoned = True
                raise
            late: HandshakeValue | None = registry.record(s_key, schema.HANDSHAKE)
            if not (late is not None and late.value == y + 1 and late.by == "receiver"):
                raise
            log.info("handshake_late_ack_accepted", transfer_id=transfer_id)
    except (HandshakeTimeoutError, RegistryError):
        # The receiver is gone or Redis is; a mismatch instead leaves the keys for the
        # receiver to read our digest, an abandonment its marker.
        if not abandoned:
            registry.delete(r_key, s_key)
        raise
    log.debug("handshake_done", side="sender", transfer_id=transfer_id)


_ABANDONED: dict[str, Any] = {"by": "sender", "abandoned": True}


def _nonce() -> int:
    # Below 2**52 so it stays exact through any JSON implementation.
    return secrets.randbelow(1 << 52)


def _entry(by: str, value: int, digest: str) -> dict[str, Any]:
    return {"by": by, "value": value, "digest": digest}


def _check_digest(mine: str, theirs: HandshakeValue, side: str, transfer_id: str) -> None:
    other = theirs.digest
    if other != mine:
        raise ManifestMismatchError(
            f"transfer {transfer_id}: the {side}'s manifest digest {other} differs from ours"
            f" {mine}; the two sides would not issue the same broadcasts"
        )


def _wait(
    registry: Registry,
    key: str,
    ready: Callable[[HandshakeValue], bool],
    deadline: float,
    state: str,
    transfer_id: str,
    gone: threading.Event | None = None,
) -> tuple[HandshakeValue, str]:
    """Poll ``key`` until its verified value satisfies ``ready``, or the deadline passes
    (or ``gone`` is set): the value, and the raw one stored (for a compare-and-set)."""
    pauses = _clock.pauses(POLL, POLL_MAX)
    while True:
        # Untrusted values are skipped: only the genuine other side moves the handshake on.
        found = registry.get_signed(key, schema.HANDSHAKE)
        if found is not None and ready(found[0]):
            return found[0], found[1]
        if gone is not None and gone.is_set():
            raise NoPeerError(f"handshake for transfer {transfer_id}: the peer was found gone"
                              f" in state {state}")
        left = deadline - _clock.monotonic()
        if left <= 0:
            raise HandshakeTimeoutError(
                f"handshake for transfer {transfer_id} timed out in state {state}"
                " (the peer did not answer in time)"
            )
        _clock.sleep(min(next(pauses), left))
