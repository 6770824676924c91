"""Faults injected from the tests, never through production signatures."""

from __future__ import annotations

from typing import Any

import torch

#: A sender issues two broadcasts (plan digest, then the receiver's verdict) before data.
_FIRST_DATA_BROADCAST = 3
#: The rank that sends the data (the receiver answers the verdict and the final ack).
_SENDER_RANK = 0


class CorruptingTransport:
    """Wraps a sender's transport: one byte of the ``step``-th data broadcast (1: the
    first) is flipped in a copy on its way to the wire (the sender's own tensors are
    never touched). ``every``: every data broadcast from that one on, each with every
    byte flipped (a relay member that garbles all it forwards: a sampled check sees
    it too)."""

    def __init__(self, inner: Any, byte: int = 0, step: int = 1, every: bool = False) -> None:
        self._inner = inner
        self._byte = byte
        self._at = _FIRST_DATA_BROADCAST - 1 + step
        self._every = every
        self._calls = 0
        self._keep: list[torch.Tensor] = []  # a copy must outlive its broadcast

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def copy(self, tensor: torch.Tensor, src: int = 0) -> Any:
        self._calls += 1
        if self._calls == self._at or (self._every and self._calls > self._at and src == _SENDER_RANK):
            tensor = tensor.clone()
            if self._every:
                tensor.bitwise_not_()
            else:
                tensor[self._byte] ^= 0xFF
            self._keep.append(tensor)
        return self._inner.copy(tensor, src)


def garble_relay_sends(seat: int | None = None) -> None:
    """From now on, in this process, every send that forwards steps as they land (a
    relay member's, a streamed download's) flips every byte it puts on the wire; with
    ``seat``, only while this worker's latest cohort seat is at that position. Its own
    tensors, and what it sends as a holder, stay exact."""
    from nccl_back.transport import send
    from nccl_back.transport.relay.seating import Cohorts

    seats: list[int] = []
    orig_join, orig_send = Cohorts.join, send.send_tensors

    def join(self: Any, *a: Any, **k: Any) -> Any:
        chain = orig_join(self, *a, **k)
        if chain is not None:
            seats.append(chain.position)
        return chain

    def garbled(transport: Any, *a: Any, **k: Any) -> Any:
        if k.get("ready") is not None and (seat is None or seats[-1:] == [seat]):
            transport = CorruptingTransport(transport, every=True)
        return orig_send(transport, *a, **k)

    Cohorts.join = join  # type: ignore[method-assign]
    send.send_tensors = garbled
