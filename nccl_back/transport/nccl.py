"""NCCL transport: GPU tensors through cupy's NCCL binding (the ``gpu`` extra).

The sender draws the NCCL unique id and stores it in Redis (JSON, base64) under the
transfer's keys; the receiver polls for it until the deadline; both then build a
2-rank ``NcclCommunicator``. Broadcasts are enqueued on torch's current CUDA stream,
so they are ordered with the packing/unpacking copies of the data plane, and a
:class:`_NcclPending` polls a CUDA event, checking ``check_async_error`` and the
deadline between polls, because a blocking synchronize could never be interrupted.

``ncclCommInitRank`` itself has no timeout and cupy offers no non-blocking init: that
is why the liveness handshake comes first. If a peer still dies inside it, the
watchdog raises :class:`TransferTimeoutError` and leaves that thread behind.

One GPU per rank: NCCL refuses two ranks of one communicator on the same device.
"""

from __future__ import annotations

import base64
import threading
import time
from typing import Any

import torch

from ..config import Settings
from ..errors import TransferError, TransferTimeoutError
from ..log import get_logger
from ..registry import Registry
from .base import SENDER_RANK, WORLD_SIZE, Pending, Rendezvous, Transport

log = get_logger(__name__)

#: Seconds the unique id stays in Redis: only the receiver's connect needs it.
UID_TTL = 60.0

GPU_EXTRA_HINT = "nccl transport needs the gpu extra: pip install 'nccl-back[gpu]'"


def load_nccl() -> Any:
    """cupy's NCCL module, or :class:`TransferError` saying how to install it."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise TransferError(GPU_EXTRA_HINT) from e
    if not getattr(nccl, "available", False):
        raise TransferError(f"{GPU_EXTRA_HINT} (cupy found no NCCL library: nvidia-nccl-cu12)")
    return nccl


def encode_uid(uid: tuple[int, ...]) -> str:
    """cupy's unique id (a tuple of signed chars) as base64 text for JSON."""
    return base64.b64encode(bytes(b & 0xFF for b in uid)).decode("ascii")


def decode_uid(text: str) -> tuple[int, ...]:
    """Inverse of :func:`encode_uid`."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise TransferError(f"malformed NCCL unique id in Redis: {e}") from e
    return tuple(b - 256 if b > 127 else b for b in raw)


def uid_key(registry: Registry, transfer_id: str) -> str:
    return registry.key("hs", transfer_id, "nccl_uid")


class NcclRendezvous(Rendezvous):
    """Sender side for NCCL: nothing listens; the unique id goes through Redis."""

    kind = "nccl"

    def __init__(self, settings: Settings, *, device: torch.device, registry: Registry) -> None:
        load_nccl()
        self.settings = settings
        self.device = device
        self.registry = registry

    @property
    def address(self) -> str:
        # Informational: NCCL bootstraps from the unique id, which names the sender.
        return self.settings.advertise_host

    def sender(self, transfer_id: str) -> NcclTransport:
        return NcclTransport(SENDER_RANK, transfer_id, device=self.device, registry=self.registry)

    def close(self) -> None:
        """Nothing to release: each transfer owns its communicator."""


class _NcclPending:
    def __init__(self, event: torch.cuda.Event, transport: NcclTransport) -> None:
        self._event = event
        self._transport = transport

    def wait(self) -> None:
        self._transport._wait_event(self._event)


class NcclTransport(Transport):
    """One transfer over a 2-rank NCCL communicator (one GPU per side)."""

    kind = "nccl"

    def __init__(
        self,
        rank: int,
        transfer_id: str,
        *,
        device: torch.device,
        registry: Registry,
        poll: float = 0.001,
        world_size: int = WORLD_SIZE,
    ) -> None:
        if device.type != "cuda":
            raise TransferError(f"the nccl transport needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(rank, transfer_id, device)
        self.registry = registry
        self._poll = poll
        # world_size 1 exists only for single-GPU tests (NCCL refuses 2 ranks on 1 GPU).
        self._world = world_size
        self._nccl: Any = None
        self._comm: Any = None
        self._deadline = float("inf")
        self._aborted = threading.Event()
        self._lock = threading.Lock()
        self._last_event: torch.cuda.Event | None = None

    def connect(self, deadline: float) -> None:
        self._deadline = deadline
        nccl = load_nccl()
        self._nccl = nccl
        key = uid_key(self.registry, self.transfer_id)
        if self.rank == SENDER_RANK:
            uid = nccl.get_unique_id()
            self.registry.set_json(key, {"uid": encode_uid(uid)}, UID_TTL)
        else:
            uid = self._await_uid(key)
        try:
            import cupy

            with cupy.cuda.Device(self.device.index):
                comm = nccl.NcclCommunicator(self._world, uid, self.rank)
        except Exception as e:  # cupy raises NcclError / CUDARuntimeError
            raise TransferError(f"nccl communicator for {self.transfer_id} failed: {e}") from e
        with self._lock:
            self._comm = comm
            if self._aborted.is_set():
                self._abort_comm()
                raise TransferTimeoutError(f"nccl transfer {self.transfer_id} aborted during connect")
        log.debug("nccl_connected", transfer_id=self.transfer_id, rank=self.rank)

    def _await_uid(self, key: str) -> tuple[int, ...]:
        while True:
            value = self.registry.get_json(key)
            if isinstance(value, dict) and isinstance(value.get("uid"), str):
                return decode_uid(value["uid"])
            if self._aborted.is_set() or time.monotonic() >= self._deadline:
                raise TransferTimeoutError(
                    f"nccl transfer {self.transfer_id}: the sender's unique id never arrived"
                )
            time.sleep(self._poll * 5)

    def broadcast(self, tensor: torch.Tensor, src: int = SENDER_RANK) -> Pending:
        if self._aborted.is_set():
            raise TransferTimeoutError(f"nccl transfer {self.transfer_id} was aborted")
        if self._comm is None:
            raise TransferError(f"nccl transfer {self.transfer_id}: broadcast before connect")
        if tensor.device != self.device or not tensor.is_contiguous():
            raise TransferError(
                f"nccl broadcast needs a contiguous tensor on {self.device}, got {tensor.device}"
            )
        data = tensor.reshape(-1).view(torch.uint8)
        stream = torch.cuda.current_stream(self.device)
        try:
            self._comm.bcast(
                data.data_ptr(), data.numel(), self._nccl.NCCL_UINT8, src, stream.cuda_stream
            )
        except Exception as e:
            raise TransferError(f"nccl broadcast in {self.transfer_id} failed: {e}") from e
        event = torch.cuda.Event()
        event.record(stream)
        self._last_event = event
        return _NcclPending(event, self)

    def _wait_event(self, event: torch.cuda.Event) -> None:
        while not event.query():
            comm = self._comm
            if self._aborted.is_set() or comm is None:
                raise TransferTimeoutError(f"nccl transfer {self.transfer_id} was aborted")
            try:
                comm.check_async_error()
            except Exception as e:
                raise TransferError(f"nccl transfer {self.transfer_id} failed: {e}") from e
            if time.monotonic() >= self._deadline:
                self.abort()
                raise TransferTimeoutError(f"nccl transfer {self.transfer_id}: deadline passed")
            time.sleep(self._poll)

    def _abort_comm(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception as e:  # already broken: nothing more to release
                log.debug("nccl_abort_failed", transfer_id=self.transfer_id, error=str(e))

    def abort(self) -> None:
        self._aborted.set()
        with self._lock:
            self._abort_comm()

    def close(self) -> None:
        event = self._last_event
        if event is not None and not event.query():
            # Work still queued (an error path): destroy would wait for it, abort won't.
            self.abort()
            return
        with self._lock:
            comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception as e:
                log.debug("nccl_destroy_failed", transfer_id=self.transfer_id, error=str(e))
