"""NCCL transport: GPU tensors through torch's own ``ProcessGroupNCCL``.

Why this binding (NCCL's fault-tolerance guide):

* ``ncclCommAbort`` is safe only on a **non-blocking** communicator with no other thread
  inside NCCL. torch's ``ProcessGroupNCCL`` offers that and ``abort()``, with the NCCL
  the user's torch already ships (no second ``libnccl``; cupy cannot ask for
  non-blocking).
* **Every NCCL call from the owner thread** (the transfer's worker thread): it builds
  the group, issues and polls every copy, and aborts; :meth:`NcclTransport.abort` from
  any other thread only *signals*.
* **The connect inside the deadline.** The communicator is created by a one-byte
  collective in ``connect`` (one made by ``eager_connect_single_device`` need never
  report ``_is_initialized()``); torch's host-side waits are bounded by
  ``TORCH_NCCL_NONBLOCKING_TIMEOUT``, set (unless the user did) before the first group.
* **A failed transfer never kills the worker**: each group is built with torch's async
  error handling and heartbeat monitor off, and torch's timeout beyond ours.
* **Off the inference stream.** Each transfer runs on its own CUDA stream, ordered after
  the caller's at creation; the receiver waits for it (:meth:`NcclTransport.finish`),
  so ``load`` returns ready tensors.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.errors import TransferError
from nccl_back.log import get_logger
from nccl_back.timing import NCCL_POLL_S as POLL_S
from nccl_back.timing import NONBLOCKING_TIMEOUT_S, TORCH_TIMEOUT_SLACK_S
from nccl_back.transport.channel import SENDER_RANK, WORLD_SIZE, Pending, Probe, register_transport
from nccl_back.transport.rendezvous_store import StoreRendezvous, StoreTransport

if TYPE_CHECKING:
    from nccl_back.coord.registry import Registry

log = get_logger(__name__)

GPU_HINT = (
    "the nccl transport needs torch built with CUDA and NCCL on a machine with a GPU"
    " (torch.distributed.is_nccl_available() is False or no CUDA device is visible)"
)

_ENV_LOCK = threading.Lock()
# Read by ProcessGroupNCCL's constructor: no teardown on errors, no heartbeat monitor
# that could kill the process, no debug dumps on our (expected) timeouts.
_GROUP_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}


def check_available(device: torch.device | None) -> torch.device:
    """``device``; :class:`TransferError` unless NCCL and the CUDA ``device`` are usable."""
    if device is None or device.type != "cuda":
        raise TransferError(f"the nccl transport needs a CUDA device, got {device}")
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        raise TransferError(GPU_HINT)
    return device


@contextlib.contextmanager
def _group_env() -> Iterator[None]:
    """Our settings for the duration of one ``ProcessGroupNCCL`` construction."""
    with _ENV_LOCK:
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(NONBLOCKING_TIMEOUT_S))
        saved = {k: os.environ.get(k) for k in _GROUP_ENV}
        os.environ.update(_GROUP_ENV)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class _NcclPending:
    def __init__(self, work: Any, transport: NcclTransport) -> None:
        self._work = work
        self._transport = transport

    def wait(self) -> None:
        self._transport._wait_work(self._work)


class NcclTransport(StoreTransport):
    """One transfer over a fresh 2-rank, non-blocking ``ProcessGroupNCCL``."""

    kind = "nccl"

    def __init__(self, rank: int, transfer_id: str, settings: Settings, registry: Registry, *,
                 device: torch.device | None) -> None:
        device = check_available(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(rank, transfer_id, settings, registry, device=device)
        self._pg: Any = None
        self._stream: torch.cuda.Stream | None = None
        # The caller's stream at creation: work queued on it (a load) must come first.
        self._after = torch.cuda.current_stream(device).record_event()

    # -- the owner thread ------------------------------------------------------------------

    def connect(self, deadline: float) -> None:
        self._deadline = deadline
        torch.cuda.set_device(self.device)
        self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_event(self._after)
        # Per thread: this thread's copies and the group's ordering follow our stream.
        torch.cuda.set_stream(self._stream)
        try:
            prefixed = self._bootstrap()
            opts = dist.ProcessGroupNCCL.Options()
            config = opts.config  # a copy in some torch builds: set it back whole
            config.blocking = 0
            opts.config = config
            opts._timeout = timedelta(seconds=self._left("connect") + TORCH_TIMEOUT_SLACK_S)
            with _group_env():
                self._pg = dist.ProcessGroupNCCL(prefixed, self.rank, WORLD_SIZE, opts)
            # The first collective creates the communicator and (NCCL 2.22+) connects the
            # ranks: a one-byte broadcast now keeps both inside the connect deadline.
            hello = torch.zeros(1, dtype=torch.uint8, device=self.device)
            self._wait_work(self._issue(hello, SENDER_RANK))
        except TransferError:
            self._abort_now()
            raise
        except Exception as e:  # torch raises RuntimeError / DistBackendError / DistStoreError
            self._abort_now()
            raise self._error("connect", e) from e
        log.debug("nccl_connected", transfer_id=self.transfer_id, rank=self.rank)

    def copy(self, tensor: torch.Tensor, src: int = SENDER_RANK) -> Pending:
        self._left("copy")
        if self._pg is None:
            raise TransferError(f"{self._name}: copy before connect")
        if tensor.device != self.device or not tensor.is_contiguous():
            raise TransferError(
                f"nccl copy needs a contiguous tensor on {self.device}, got {tensor.device}"
            )
        return _NcclPending(self._issue(tensor, src), self)

    def _issue(self, tensor: torch.Tensor, src: int) -> Any:
        try:
            return self._pg.broadcast([tensor.reshape(-1).view(torch.uint8)], _bcast_opts(src))
        except Exception as e:
            self._abort_now()
            raise self._error("copy", e) from e

    def _wait_work(self, work: Any) -> None:
        """Poll ``work`` until done, an abort request or the deadline (owner thread only)."""
        try:
            while not work.is_completed():
                self._left("copy")
                _clock.sleep(POLL_S)
            # Orders our stream after the collective and raises its error, if any.
            work.wait()
        except TransferError:
            self._abort_now()
            raise
        except Exception as e:
            self._abort_now()
            raise self._error("copy", e) from e

    def finish(self) -> None:
        """Wait (polling, bounded) until every copy queued on the transfer's stream ran."""
        if self._stream is None:
            return
        done = self._stream.record_event()
        try:
            while not done.query():
                self._left("finishing")
                _clock.sleep(POLL_S)
        except TransferError:
            self._abort_now()
            raise

    def _abort_now(self) -> None:
        """``ncclCommAbort`` from the owner thread: kernels stuck on a dead peer exit."""
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception as e:  # already torn down: nothing more to release
                log.debug("nccl_abort_failed", transfer_id=self.transfer_id, error=str(e))

    # -- any thread ------------------------------------------------------------------------

    @property
    def join_grace(self) -> float:
        # The owner may sit in one (bounded) host-side torch wait before it sees the abort.
        return nonblocking_timeout() + 5.0

    def abort(self) -> None:
        """Ask the owner thread to abort; it does at its next poll (never from here)."""
        self._aborted.set()

    def close(self) -> None:
        """Release the communicator (owner thread); idempotent. Always ``abort``: the
        group served one transfer, and unlike a graceful destroy it never waits on a peer."""
        self._abort_now()
        self._drop_bootstrap()


class NcclRendezvous(StoreRendezvous):
    """The sender's endpoint for NCCL transfers."""

    kind = "nccl"
    transport = NcclTransport

    def __init__(self, settings: Settings, registry: Registry, *, device: torch.device) -> None:
        check_available(device)
        super().__init__(settings, registry, device=device)


def _bcast_opts(src: int) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return opts


def nonblocking_timeout() -> float:
    """The bound on torch's host-side non-blocking waits in force for this process."""
    raw = os.environ.get("TORCH_NCCL_NONBLOCKING_TIMEOUT", "")
    try:
        value = float(raw)
    except ValueError:
        return float(NONBLOCKING_TIMEOUT_S)
    return value if math.isfinite(value) and value > 0 else float(NONBLOCKING_TIMEOUT_S)


def probe(settings: Settings) -> Probe:
    """NCCL's version and the visible GPUs, or why the settings cannot use it here."""
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        try:
            v = torch.cuda.nccl.version()
        except Exception as e:  # a torch without NCCL raises from its C extension
            return Probe("", f"CUDA present but NCCL unavailable ({e})",
                         "install a CUDA build of torch that ships NCCL")
        version = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        return Probe(f"nccl {version} ({n} GPU(s): {', '.join(names)})")
    if settings.transport == "nccl":
        return Probe("", "transport=nccl but CUDA is not available here",
                     "run on a GPU node with the NVIDIA driver, or set NCCL_BACK_TRANSPORT=gloo")
    return Probe("no CUDA: nccl unused")


register_transport("nccl", NcclRendezvous, NcclTransport.receiver, devices=("cuda",),
                   probe=probe)
