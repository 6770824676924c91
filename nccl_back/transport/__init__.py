"""Transports: a 2-rank broadcast channel (gloo on CPU, NCCL on GPU), the watchdog
that bounds it, and the bucketed data plane that walks a state dict over it."""

from nccl_back.transport.base import (
    RECEIVER_RANK,
    SENDER_RANK,
    Pending,
    Rendezvous,
    Transport,
    open_rendezvous,
    receiver_transport,
    resolve_kind,
)
from nccl_back.transport.broadcast import (
    Step,
    TransferStats,
    payload_bytes,
    plan,
    recv_tensors,
    send_tensors,
)
from nccl_back.transport.watchdog import run_guarded

__all__ = [
    "RECEIVER_RANK",
    "SENDER_RANK",
    "Pending",
    "Rendezvous",
    "Step",
    "TransferStats",
    "Transport",
    "open_rendezvous",
    "payload_bytes",
    "plan",
    "receiver_transport",
    "recv_tensors",
    "resolve_kind",
    "run_guarded",
    "send_tensors",
]
