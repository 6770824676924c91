"""The watchdog: communicator creation plus the broadcast loop, under one deadline.

NCCL has no timeouts of its own and a gloo wait cannot be interrupted, so the work runs
in a worker thread while the caller waits until the deadline, then aborts the transport:
a hung transfer never keeps the worker from falling back to storage.

The connect may get a shorter deadline (both sides proved alive a moment ago, so a
communicator that has not formed soon never will, and the receiver must not hold its
send slot meanwhile). A stall bound aborts once no step completed for that long, so a
peer that stops silently (a partition: no reset) costs the bound, not the deadline; it
is enforced here, so it holds for every transport. A sender's abandonment notice,
asked once quiet for :data:`NOTICE_AFTER`, ends the transfer at once.

After an abort the thread unwinds within the transport's ``join_grace`` (every wait
is bounded by the same deadline). The watchdog only *asks* for the abort: NCCL's owner
thread carries it out, since ``ncclCommAbort`` is unsafe beside another NCCL call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from nccl_back import _clock
from nccl_back.errors import (
    NcclBackError,
    TransferAbandonedError,
    TransferError,
    TransferStalledError,
    TransferTimeoutError,
)
from nccl_back.log import get_logger
from nccl_back.transport.channel import Transport

log = get_logger(__name__)

T = TypeVar("T")

#: Seconds without a step before the sender's notice is asked for (``abandoned``), and
#: between two asks while none comes: a transfer that flows never asks.
NOTICE_AFTER = 0.5


def run_guarded(
    transport: Transport,
    work: Callable[[Transport], T],
    deadline: float,
    *,
    connect_deadline: float | None = None,
    stall: float | None = None,
    abandoned: Callable[[], bool] | None = None,
) -> T:
    """``transport.connect(...)`` then ``work(transport)``, done by ``deadline`` (the
    connect also by ``connect_deadline``; at most ``stall`` seconds between steps;
    ``abandoned()`` reads the sender's notice). Returns what ``work`` returns.

    Raises :class:`TransferStalledError`, :class:`TransferTimeoutError` or
    :class:`TransferAbandonedError` (after aborting), the work's :class:`NcclBackError`,
    or :class:`TransferError` wrapping anything else. The transport is always closed.
    """
    # One-element lists: the worker thread's result or error, typed for the caller.
    values: list[T] = []
    errors: list[BaseException] = []
    connected = threading.Event()
    first = deadline if connect_deadline is None else min(deadline, connect_deadline)
    if stall is not None:
        if not stall > 0:
            raise TransferError(f"stall={stall!r}: must be a positive number of seconds")
        transport.call_timeout = min(transport.call_timeout, stall)

    def target() -> None:
        try:
            try:
                transport.connect(first)
            except TransferTimeoutError as e:
                # The rendezvous saw the deadline before the watcher woke: name the phase.
                raise TransferTimeoutError(f"{_not_formed(transport, first < deadline)} ({e})") from e
            transport.extend_deadline(deadline)
            transport.progressed()  # the stall bound counts from the communicator's birth
            connected.set()
            value = work(transport)
            transport.finish()
            values.append(value)
        except BaseException as e:  # handed to the caller's thread below
            errors.append(e)
        finally:
            try:
                transport.close()
            except Exception as e:  # a failed close must not hide the transfer's outcome
                log.warning("transport_close_failed", transfer_id=transport.transfer_id, error=str(e))

    thread = threading.Thread(
        target=target, name=f"nccl-back-transfer-{transport.transfer_id}", daemon=True
    )
    thread.start()
    began = _clock.monotonic()
    asked = began

    def heed_notice() -> None:
        """Abort if the notice says the other side gave up (asked once quiet, that often)."""
        nonlocal asked
        now = _clock.monotonic()
        since = max(transport.progress_at if connected.is_set() else began, asked)
        if abandoned is None or now - since < NOTICE_AFTER:
            return
        asked = now
        if abandoned():
            _abort(transport, thread, "abandoned", NOTICE_AFTER)
            raise TransferAbandonedError(
                f"{transport.kind} transfer {transport.transfer_id}: the sender gave it up (it"
                " closed, or its drain ran out); the communicator was aborted")

    def nap(until: float) -> float:
        """How long to wait for the thread: until ``until``, or the next ask of the notice."""
        left = until - _clock.monotonic()
        return max(min(left, NOTICE_AFTER) if abandoned is not None else left, 0.0)

    if first < deadline:
        while thread.is_alive() and not connected.is_set() and _clock.monotonic() < first:
            thread.join(nap(first))
            if thread.is_alive() and not connected.is_set():
                heed_notice()
        if thread.is_alive() and not connected.is_set():
            _abort(transport, thread, "connect")
            raise TransferTimeoutError(f"{_not_formed(transport, True)}; aborted")
    while True:
        wait = deadline - _clock.monotonic()
        if stall is not None:
            # Before the connect is seen, wake up every stall bound to start watching.
            quiet = (transport.progress_at + stall - _clock.monotonic()) if connected.is_set() else stall
            wait = min(wait, quiet)
        thread.join(nap(_clock.monotonic() + wait))
        if not thread.is_alive():
            break
        heed_notice()
        if _clock.monotonic() >= deadline:
            _abort(transport, thread, "transfer")
            raise TransferTimeoutError(
                f"{transport.kind} transfer {transport.transfer_id} did not finish by its deadline;"
                " the communicator was aborted"
            )
        if stall is not None and connected.is_set() and _clock.monotonic() - transport.progress_at >= stall:
            _abort(transport, thread, "stall")
            raise TransferStalledError(
                f"{transport.kind} transfer {transport.transfer_id} stalled: no step completed"
                f" for {stall:g} s (the stall bound; the peer stopped or its link is down);"
                " the communicator was aborted"
            )
    if errors:
        error = errors[0]
        quiet = _clock.monotonic() - transport.progress_at
        if (stall is not None and connected.is_set() and quiet >= stall
                and isinstance(error, TransferError) and not isinstance(error, TransferStalledError)):
            # The transport's own per-call timeout (the stall bound) beat our check: say
            # what happened, whatever words the transport found for it.
            raise TransferStalledError(
                f"{transport.kind} transfer {transport.transfer_id} stalled: no step completed"
                f" for {quiet:.1f} s (stall bound {stall:g} s): {error}"
            ) from error
        if isinstance(error, NcclBackError):
            raise error
        raise TransferError(
            f"{transport.kind} transfer {transport.transfer_id} failed: {error}"
        ) from error
    return values[0]


def _abort(transport: Transport, thread: threading.Thread, phase: str,
           grace: float | None = None) -> None:
    log.warning("transfer_deadline_passed", transfer_id=transport.transfer_id,
                kind=transport.kind, phase=phase)
    transport.abort()
    grace = transport.join_grace if grace is None else min(grace, transport.join_grace)
    thread.join(grace)
    if thread.is_alive() and phase == "abandoned":
        # A gloo wait outlives its abort until the sender's sockets close; the sender gave
        # up, so nothing but a step already sent can land: the caller moves on now.
        log.info("transfer_thread_left", transfer_id=transport.transfer_id, grace=grace)
    elif thread.is_alive():
        # A wait ignoring both deadline and abort: the daemon thread is left behind.
        log.error("transfer_thread_stuck", transfer_id=transport.transfer_id, grace=grace)


def _not_formed(transport: Transport, connect: bool) -> str:
    return (f"{transport.kind} transfer {transport.transfer_id}: the communicator did not"
            f" form by the {'connect' if connect else 'transfer'} deadline (the peer gave up"
            " or is gone)")
