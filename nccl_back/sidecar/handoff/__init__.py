"""Local hand-off: a sidecar that holds loaded weights gives them to a process on the
same host, with no storage and no network.

The sidecar runs a :class:`HandoffServer`; an inference process calls :func:`attach`
with its skeleton and the server's Unix socket path. One JSON line goes each way; the
server refuses a different version or manifest before anything is mapped, else names
where the weights are: one *arena* holding every tensor, a /dev/shm segment for a CPU
model or a CUDA IPC handle for a GPU one. The consumer copies out of it (``copy``) or
keeps views of it (``zero_copy``), then checks the layer hashes.

=====================  ==============================================================
:mod:`.protocol`       the line framing, its limits, refusals, base64
:mod:`.perms`          local doors: private socket directory, peer uid, segment checks
:mod:`.arena`          building a skeleton in the arena or packing a model into it, mapping, views
:mod:`.cuda`           the GPU arena's CUDA IPC export and import, GPUs by UUID
:mod:`.server`         :class:`HandoffServer`, the serving half
:mod:`.client`         :func:`attach`, the consuming half
=====================  ==============================================================
"""

from __future__ import annotations

from nccl_back.sidecar.handoff.client import attach
from nccl_back.sidecar.handoff.cuda import gpu_uuid, local_gpu_index
from nccl_back.sidecar.handoff.perms import check_segment, peer_uid, private_dir
from nccl_back.sidecar.handoff.protocol import PROTOCOL, AttachMode
from nccl_back.sidecar.handoff.server import HandoffServer

__all__ = [
    "PROTOCOL",
    "AttachMode",
    "HandoffServer",
    "attach",
    "check_segment",
    "gpu_uuid",
    "local_gpu_index",
    "peer_uid",
    "private_dir",
]
