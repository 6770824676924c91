"""The hand-off's GPU path: a CUDA arena exported as a CUDA IPC handle, opened by the consumer.

The server exports its arena per request (``UntypedStorage._share_cuda_``); the consumer
opens it with torch's ``rebuild_cuda_tensor``. Not with ``expandable_segments``. GPU
indices differ between containers, so the sides name the GPU by its UUID.
"""

from __future__ import annotations

from typing import Any

import torch

from nccl_back.errors import AttachError
from nccl_back.sidecar.handoff.protocol import b64, unb64


def gpu_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as this process numbers it (``GPU-...``)."""
    raw = str(torch.cuda.get_device_properties(index).uuid)
    return raw if raw.startswith("GPU-") else f"GPU-{raw}"


def local_gpu_index(uuid: str, visible: list[str]) -> int:
    """This process's index of the GPU named ``uuid``; :class:`AttachError` if unseen."""
    if not uuid:
        raise AttachError("the sidecar did not name its GPU by UUID; upgrade the sidecar")
    if uuid not in visible:
        raise AttachError(
            f"the sidecar's weights are on GPU {uuid}, which this process cannot see"
            f" (visible: {', '.join(visible) or 'none'}); give the consumer that GPU"
            " (CUDA_VISIBLE_DEVICES / the device plugin) or attach with a CPU skeleton"
        )
    return visible.index(uuid)


def share(arena: torch.Tensor) -> dict[str, Any]:
    """A fresh IPC export of ``arena`` for one consumer (its own ref counter, released
    when it drops the mapping), as the reply's ``cuda`` object; the caller serialises."""
    with torch.cuda.device(arena.device):
        (device, handle, size, offset, counter, counter_offset, event, sync) = (
            arena.untyped_storage()._share_cuda_()
        )
    return {
        "device": device,
        # The index means nothing in a container with another CUDA_VISIBLE_DEVICES:
        # the consumer finds the GPU by its UUID.
        "uuid": gpu_uuid(int(device)),
        "handle": b64(handle),
        "storage_size": size,
        "storage_offset": offset,
        "tensor_offset": arena.storage_offset(),
        "ref_counter": b64(counter),
        "ref_counter_offset": counter_offset,
        "event": b64(event),
        "event_sync_required": bool(sync),
    }


def open_shared(info: dict[str, Any], size: int) -> torch.Tensor:
    """The server's arena (``size`` bytes, uint8) from its reply's ``cuda`` object."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise AttachError("the sidecar shares CUDA memory but this process has no CUDA")
    visible = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
    index = local_gpu_index(str(info.get("uuid", "")), visible)
    try:
        return rebuild_cuda_tensor(
            torch.Tensor,
            (size,),
            (1,),
            int(info["tensor_offset"]),
            torch.storage.TypedStorage,
            torch.uint8,
            index,
            unb64(info["handle"]),
            int(info["storage_size"]),
            int(info["storage_offset"]),
            False,
            unb64(info["ref_counter"]),
            int(info["ref_counter_offset"]),
            unb64(info["event"]),
            bool(info["event_sync_required"]),
        )
    except RuntimeError as e:
        raise AttachError(f"cannot open the sidecar's CUDA IPC handle: {e}") from e
