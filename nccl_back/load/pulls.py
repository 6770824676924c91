"""Transfers into one rank's tensors from several sources at once, and a pull watched
for a source that is lost (:func:`watched`).

A reshard pulls each holder's pieces at once; a load in parts pulls part ``i`` from
holder ``i``. Both wait for every pull (each writes into this rank's tensors, so none
may still run once the caller moves on) and learn which pull failed first (the cause;
with ``abort``, the others' errors may only be the abort).

``abort``: the first failure aborts the others' transports, each at its next step (a
gloo wait under way is not interrupted); an aborted transport closes, which fails its
sender's next call, so that sender's slot is free at once. A reshard aborts: its load
starts over without the pieces. A load in parts does not: what the other parts land
stays, and a healthy part finishing is worth more than its sender's slot.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from nccl_back import _clock
from nccl_back.transport import Transport

#: A pull: given the callback its transfer calls with its transport before data moves.
Pull = Callable[[Callable[[Transport], None]], None]


class Pulls:
    """One receive's pulls in flight: :meth:`run` them, then read :attr:`first`."""

    def __init__(self, *, abort: bool) -> None:
        self._abort = abort
        self._lock = threading.Lock()
        self._live: set[Transport] = set()
        self.first: int | None = None
        """The index of the pull that failed first (None while none has)."""

    def run(self, pulls: Sequence[Pull], name: str) -> list[BaseException | None]:
        """Run every pull at once (the first on this thread, each other on a thread
        named after ``name``) and wait for all of them: what each raised, or None."""
        if len(pulls) == 1:
            return [self._one(0, pulls[0])]
        with ThreadPoolExecutor(len(pulls) - 1, thread_name_prefix=name) as pool:
            later = [pool.submit(self._one, i, p) for i, p in enumerate(pulls[1:], 1)]
            errors = [self._one(0, pulls[0])]
            errors += [f.result() for f in later]
        return errors

    def _one(self, i: int, pull: Pull) -> BaseException | None:
        mine: list[Transport] = []

        def started(transport: Transport) -> None:
            if not self._abort:
                return  # nothing will abort it: not tracked
            mine.append(transport)
            with self._lock:
                self._live.add(transport)
                if self.first is not None:
                    transport.abort()

        try:
            pull(started)
        except BaseException as e:  # noqa: BLE001 - handed to the caller once all have ended
            self._fail(i)
            return e
        finally:
            with self._lock:
                self._live.difference_update(mine)
        return None

    def _fail(self, i: int) -> None:
        with self._lock:
            if self.first is not None:
                return
            self.first = i
            if not self._abort:
                return
            for tr in self._live:
                with contextlib.suppress(Exception):  # already torn down
                    tr.abort()


@contextlib.contextmanager
def watched(lost: Callable[[], bool], poll: float, name: str,
            started: Callable[[Transport], None] | None = None, first: float | None = None,
            ) -> Iterator[tuple[threading.Event, Callable[[Transport], None]]]:
    """``lost`` asked every ``poll`` seconds while the block pulls from a source (with
    ``first``: first after ``first`` seconds, then at twice the wait before, up to
    ``poll``: a source most often lost right away, a forming cohort's leaf parent). Once
    it says so, the event is set (hand it to the transfer's ``gone``: its handshake ends
    at the next poll) and the transport the pull's callback was told is aborted (a
    communicator still forming stops at once; a gloo wait under way is not interrupted,
    the stall bound ends it). ``started``: also told the transport."""
    gone, stop, lock = threading.Event(), threading.Event(), threading.Lock()
    live: list[Transport] = []

    def on_start(transport: Transport) -> None:
        if started is not None:
            started(transport)
        with lock:
            live.append(transport)
            if gone.is_set():
                transport.abort()

    def watch() -> None:
        wait = poll if first is None else min(poll, first)
        while not _clock.wait(stop, wait):
            wait = min(poll, wait * 2)
            if lost():
                with lock:
                    gone.set()
                    for transport in live:
                        transport.abort()
                return

    watcher = threading.Thread(target=watch, daemon=True, name=name)
    watcher.start()
    try:
        yield gone, on_start
    finally:
        stop.set()
        watcher.join()
