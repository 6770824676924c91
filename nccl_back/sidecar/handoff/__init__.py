"""Local hand-off: a sidecar that holds loaded weights gives them to a process on the
same host, with no storage and no network.

The sidecar runs a :class:`HandoffServer`; an inference process calls :func:`attach`
with its skeleton and the server's Unix socket path. One JSON line goes each way; the
server refuses a different version or manifest before anything is mapped, else names
its *arena* (a /dev/shm segment, or a CUDA IPC handle). The consumer copies out of it
or keeps views of it, then checks the layer hashes. Modules: :mod:`.protocol` (framing,
limits), :mod:`.perms` (socket directory, peer uid, segment checks), :mod:`.arena`,
:mod:`.cuda` (IPC, GPUs by UUID), :mod:`.server` and :mod:`.client`.
"""

from __future__ import annotations

from nccl_back.sidecar.handoff.client import attach
from nccl_back.sidecar.handoff.cuda import gpu_uuid, local_gpu_index
from nccl_back.sidecar.handoff.protocol import PROTOCOL
from nccl_back.sidecar.handoff.server import HandoffServer

__all__ = ["PROTOCOL", "HandoffServer", "attach", "gpu_uuid", "local_gpu_index"]
