"""NCCL transport: GPU tensors through torch's own ``ProcessGroupNCCL``.

Why this binding (the requirements come from NCCL's fault-tolerance guide):

* ``ncclCommAbort`` is safe only on a **non-blocking** communicator with no other
  thread inside an NCCL call. cupy's ``NcclConfig`` cannot ask for non-blocking;
  torch's ``ProcessGroupNCCL`` can (``Options.config.blocking = 0``), has ``abort()``,
  and uses the NCCL that the user's torch already ships (CUDA 12 or 13), so the
  process never loads a second ``libnccl``. nccl4py would also meet the bar but is
  one more native dependency that must match torch's NCCL.
* **Every NCCL call from the thread that owns the communicator.** The transfer's
  worker thread (:func:`~nccl_back.transport.run_guarded`) builds the group, issues
  every copy, polls for completion and, on a deadline or an abort request,
  calls ``abort()`` itself. :meth:`NcclTransport.abort` from any other thread (the
  watchdog, a drain) only *signals*; the owner acts on it at its next poll.
* **The connect phase inside the deadline.** The unique id travels through the
  transfer's signed Redis keys (:mod:`.store`; no rendezvous port is open), each wait
  bounded by the time left. The communicator is created by a one-byte collective
  inside ``connect``, not by ``eager_connect_single_device``: a non-blocking
  communicator made that way need not ever report ``_is_initialized()``
  (``benchmarks/RESULTS.md``, GPU). Host-side waits inside torch's non-blocking NCCL
  calls (creation, and since NCCL 2.22 the lazy connect that waits for the peer's
  first call) are bounded by ``TORCH_NCCL_NONBLOCKING_TIMEOUT``, which this module
  sets, if the user has not, to :data:`NONBLOCKING_TIMEOUT_S` before its first
  communicator (torch reads it once).
* **A stall is bounded too.** torch's NCCL work has no per-call timeout we can use,
  so the stall bound (:func:`~nccl_back.transport.run_guarded`'s ``stall``) is the
  watchdog's: when no step completed within it, it asks for the abort, which the
  owner thread carries out at its next poll.
* **A failed transfer never kills the worker.** torch's default
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` tears the process down on an NCCL error or a
  timeout; each of our groups is built with it set to ``0`` (no handling: the error
  surfaces in the work, we abort), torch's own timeout far beyond ours, and
  its heartbeat monitor off for our groups.
* **Off the inference stream.** Each transfer runs on its own CUDA stream, ordered
  after the caller's stream at the moment the transport was made (an event), and
  packing/unpacking run on it. NCCL kernels run on the group's own stream, which
  torch orders after ours. Before the transfer counts as done the receiver waits for
  its stream (:meth:`NcclTransport.finish`), so ``load`` returns ready tensors, and a
  slow receiver never queues work on the worker's default stream.

What NCCL shares with gloo (the receiver factory, the bootstrap keys, the deadline,
error classification) is :class:`~nccl_back.transport.rendezvous_store.StoreTransport`.
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
        # The caller's stream at creation: the transfer must not read or write the
        # model before work already queued on it (a load, a consolidate) is done.
        self._after = torch.cuda.current_stream(device).record_event()

    # -- the owner thread ------------------------------------------------------------------

    def connect(self, deadline: float) -> None:
        self._deadline = deadline
        torch.cuda.set_device(self.device)
        self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_event(self._after)
        # The current stream is per thread: this worker thread's copies and the
        # group's stream ordering all follow the transfer's own stream from here on.
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
            # The first collective creates the communicator (lazily) and, since NCCL
            # 2.22, connects the two ranks: a one-byte broadcast now keeps both inside
            # the connect deadline instead of the first data step's.
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
            # Orders this thread's stream after the collective (no host wait) and
            # raises the error the collective ended with, if any.
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
        # The owner may sit in one host-side wait inside torch (bounded, see above)
        # before it sees the abort request.
        return nonblocking_timeout() + 5.0

    def abort(self) -> None:
        """Ask the owner thread to abort; it does at its next poll (never from here)."""
        self._aborted.set()

    def close(self) -> None:
        """Release the communicator (owner thread); idempotent.

        ``abort`` both on success and failure: the group is used for one transfer, all
        of whose work has completed or must be cancelled, and unlike a graceful
        destroy it never waits on a peer.
        """
        self._abort_now()
        self._drop_bootstrap()


class NcclRendezvous(StoreRendezvous):
    """The sender's endpoint for NCCL transfers (see :mod:`.store`)."""

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
    """NCCL's version and the visible GPUs; a failure when CUDA is present but NCCL is
    not usable, or when the settings name nccl on a machine without CUDA."""
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
