"""Transports: a 2-rank channel (gloo on CPU, NCCL on GPU), the watchdog that bounds
it, and the bucketed data plane that walks a state dict over it.

A kind is a module ``nccl_back.transport.{kind}`` registering its classes
(:func:`~nccl_back.transport.channel.register_transport`) under a name of
:data:`nccl_back.transport_kinds.TRANSPORT_KINDS`; the factories below look kinds up there."""

from nccl_back.transport.broadcast import (
    Step,
    TransferStats,
    payload_bytes,
    plan,
    recv_tensors,
    send_tensors,
)
from nccl_back.transport.channel import (
    RECEIVER_RANK,
    SENDER_RANK,
    Pending,
    Probe,
    Rendezvous,
    Transport,
    TransportClasses,
    all_transports,
    auto_kind,
    open_rendezvous,
    receiver_transport,
    register_transport,
    resolve_kind,
    transport_classes,
)
from nccl_back.transport.parts import Part, part_steps, parts
from nccl_back.transport.watchdog import run_guarded

__all__ = [
    "RECEIVER_RANK",
    "SENDER_RANK",
    "Part",
    "Pending",
    "Probe",
    "Rendezvous",
    "Step",
    "TransferStats",
    "Transport",
    "TransportClasses",
    "all_transports",
    "auto_kind",
    "open_rendezvous",
    "part_steps",
    "parts",
    "payload_bytes",
    "plan",
    "receiver_transport",
    "recv_tensors",
    "register_transport",
    "resolve_kind",
    "run_guarded",
    "send_tensors",
    "transport_classes",
]
