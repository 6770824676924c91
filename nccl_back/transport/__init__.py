"""Transports: a 2-rank channel (gloo on CPU, NCCL on GPU), the watchdog that bounds
it, and the bucketed data plane that walks a state dict over it."""

from nccl_back.transport.broadcast import (
    Step,
    payload_bytes,
    plan,
    recv_tensors,
    send_tensors,
)
from nccl_back.transport.channel import (
    Pending,
    Rendezvous,
    Transport,
    all_transports,
    auto_kind,
    open_rendezvous,
    receiver_transport,
    resolve_kind,
    transport_classes,
)
from nccl_back.transport.parts import Part, part_steps, parts
from nccl_back.transport.watchdog import run_guarded

__all__ = [
    "Part",
    "Pending",
    "Rendezvous",
    "Step",
    "Transport",
    "all_transports",
    "auto_kind",
    "open_rendezvous",
    "part_steps",
    "parts",
    "payload_bytes",
    "plan",
    "receiver_transport",
    "recv_tensors",
    "resolve_kind",
    "run_guarded",
    "send_tensors",
    "transport_classes",
]
