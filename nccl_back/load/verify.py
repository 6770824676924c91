"""Verification of received bytes: whose ground truth they are checked against, and
what a mismatch does to the sources that sent them.

The truth is discovery's (the hashes a storage load published) or, for a rank fed by
a streamed download, the hashes that downloader publishes once its load is complete.
A mismatch blames only the sources of the steps carrying the failing layers
(:class:`~nccl_back.transport.relay.Held`), and discards what they sent.
"""

from __future__ import annotations

from nccl_back import _clock
from nccl_back.coord.election import DownloadLease
from nccl_back.coord.registry import truth_for_mode
from nccl_back.errors import TransferTimeoutError, WeightVerificationError
from nccl_back.load.attempt import Attempt, Env
from nccl_back.model import integrity
from nccl_back.transport.relay import DamagedBytes

#: Seconds between two reads of a stream's ground truth while its downloader loads.
_POLL = 0.05


def check(env: Env, a: Attempt, deadline: float) -> None:
    """Verify what the last transfer left in this rank's tensors (``verify`` "none":
    nothing to do); :class:`DamagedBytes` if it fails."""
    if a.truth is None and a.found.stream is not None and env.settings.verify != "none":
        t = _clock.perf()
        a.truth = await_truth(env, a, deadline)
        a.timings["await_truth"] = _clock.perf() - t
    if a.truth is not None:
        t = _clock.perf()
        verify(env, a, a.truth)
        a.timings["verify"] = _clock.perf() - t


def verify(env: Env, a: Attempt, truth: dict[str, str]) -> None:
    """Compare the tensors with ``truth``; on a mismatch, never forward what this rank
    holds again, discard what the guilty sources sent, raise :class:`DamagedBytes`."""
    s = env.settings
    actual = integrity.layer_hashes(a.model, mode=s.verify,  # type: ignore[arg-type]
                                    key=s.key("integrity"))
    try:
        integrity.compare(truth, actual)
    except WeightVerificationError as e:
        if a.rx.chain is not None:
            # Downstream members may hold some of these bytes already: their links
            # end now and this endpoint refuses every later request.
            a.rx.chain.progress.fail(f"verification failed: {e}")
        bad = {k for k in truth.keys() | actual.keys() if truth.get(k) != actual.get(k)}
        held = a.rx.holding
        blamed = held.blame(bad, integrity.layer_of)
        held.discard(blamed)
        raise DamagedBytes(e, blamed) from e


def await_truth(env: Env, a: Attempt, deadline: float) -> dict[str, str]:
    """The ground truth a streaming downloader publishes once its load is complete
    (it hashes what it streamed); :class:`TransferError` if none comes by ``deadline``
    or the stream's downloader gave up (its relay endpoint is gone)."""
    version, digest, mode = a.spec.version, a.target.manifest.digest, env.settings.verify
    reg = env.registry
    # Only to read whether a (trusted) downloader holds the lease: a value there that
    # is not to be trusted counts as nobody, never as a reason to wait or raise.
    lease = DownloadLease(reg, version, a.world, env.worker_id, env.settings.download_lease)
    while True:
        # Read "still loading" before the truth: the downloader writes the truth before
        # it drops its stream record and releases its lease, so no truth after "gone"
        # means none is coming.
        loading = (reg.get_stream(version, a.rank, a.world, digest) is not None
                   or lease.holder() is not None)
        stored = reg.get_ground_truth(version, a.rank, a.world, digest)
        expected = truth_for_mode(stored, mode) if stored is not None else {}
        if expected:
            return expected
        if not loading or _clock.monotonic() >= deadline:
            raise TransferTimeoutError(
                f"the downloader streamed version {version[:12]} but published no {mode!r}"
                " ground truth " + ("by the deadline" if loading else "before it stopped")
                + ": nothing to verify against")
        _clock.sleep(_POLL)
