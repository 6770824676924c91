"""Names every layer shares and none owns (no package imports): the transport kinds
(:mod:`nccl_back.transport.channel` registers exactly these), and how many parts one
transfer's steps may be split into.
"""

from __future__ import annotations

from typing import Literal, get_args

#: A transport kind: ``gloo`` (CPU or CUDA tensors over TCP) or ``nccl`` (CUDA tensors).
TransportKind = Literal["gloo", "nccl"]

#: Every transport kind, in preference order for error messages.
TRANSPORT_KINDS: tuple[TransportKind, ...] = get_args(TransportKind)

#: Parts a transfer's steps may be split into, each from its own source (a receiver's
#: idle holders, a fan-out's trees, a cooperative download's members): what a request
#: may name. A download group has at most this many members.
MAX_PARTS = 64

#: Idle holders one receiver may pull one part from each at once (``holder_parts``):
#: beyond a few, a receiver's own link, not its holders', is the limit.
MAX_HOLDER_PARTS = 4
