"""Signed coordination records: what verifies, what is refused and why."""

from __future__ import annotations

import pytest

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord import auth
from nccl_back.coord.auth import Signer, canonical
from nccl_back.errors import UntrustedRecordError

pytestmark = pytest.mark.timeout(10)

KEY = bytes(range(32))
RECORD = {"peer_id": "p1", "rank": 0, "address": "10.0.0.1:29500", "nested": {"b": 1, "a": [1, 2]}}


class Clock(_clock.Clock):
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def wall(self) -> float:
        return self.now


def test_signed_record_verifies_and_loses_its_envelope() -> None:
    """A record signed at a key verifies at that key, whatever its field order."""
    signer = Signer(KEY)
    signed = signer.sign("ns:peer:x", RECORD)
    assert set(signed) == set(RECORD) | {"sig"}
    shuffled = dict(reversed(list(signed.items())))
    assert signer.verify("ns:peer:x", shuffled) == RECORD


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda r: r.pop("sig"), "unsigned record"),
        (lambda r: r.update(sig="0" * 64), "bad signature"),
        (lambda r: r.update(address="6.6.6.6:1"), "bad signature"),
        (lambda r: r.update(extra=1), "bad signature"),
        (lambda r: r["nested"].update(a=[2, 1]), "bad signature"),
        (lambda r: r.update(sig=5), "unsigned record"),
    ],
)
def test_tampered_or_unsigned_records_are_refused(tamper: object, message: str) -> None:
    """Any change to a signed record, or no signature at all, is an UntrustedRecordError."""
    signer = Signer(KEY)
    signed = signer.sign("ns:peer:x", RECORD)
    signed["nested"] = dict(signed["nested"])
    tamper(signed)  # type: ignore[operator]
    with pytest.raises(UntrustedRecordError, match=f"ns:peer:x: {message}"):
        signer.verify("ns:peer:x", signed)


def test_a_record_replayed_at_another_key_or_with_another_key_is_refused() -> None:
    """The signature binds the Redis key and the secret."""
    signed = Signer(KEY).sign("ns:gt:v1:0:1", RECORD)
    with pytest.raises(UntrustedRecordError, match="bad signature"):
        Signer(KEY).verify("ns:gt:v2:0:1", signed)
    with pytest.raises(UntrustedRecordError, match="bad signature"):
        Signer(KEY[::-1]).verify("ns:gt:v1:0:1", signed)


def test_expired_records_are_refused_within_the_clock_skew() -> None:
    """A record with a TTL is refused once ``exp`` plus the allowed clock skew has passed."""
    clock = Clock()
    with _clock.use(clock):
        signer = Signer(KEY)
        signed = signer.sign("ns:hs:t:receiver_ready", RECORD, ttl=30)
        clock.now += 30 + auth.CLOCK_SKEW - 0.5
        assert signer.verify("ns:hs:t:receiver_ready", signed) == RECORD
        clock.now += 1
        with pytest.raises(UntrustedRecordError, match="expired record"):
            signer.verify("ns:hs:t:receiver_ready", signed)


def test_without_a_secret_records_pass_unsigned_and_a_warning_is_given_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No secret: sign() adds nothing, verify() accepts anything object-shaped, one warning."""
    from nccl_back import log

    log.configure(level="WARNING")
    auth._warned.clear()
    signer = Signer.from_settings(Settings())
    auth.warn_unsigned()
    auth.warn_unsigned()
    assert not signer.enabled
    assert signer.sign("k", RECORD) == RECORD
    assert signer.verify("k", {**RECORD, "sig": "junk"}) == RECORD
    with pytest.raises(UntrustedRecordError, match="not a JSON object"):
        signer.verify("k", [1, 2])
    err = capsys.readouterr().err
    assert err.count("no_secret") == 1 and "anyone who can write to Redis" in err
    assert Signer.from_settings(Settings(secret="x" * 16)).enabled


def test_canonical_json_is_sorted_compact_and_refuses_nan() -> None:
    """Canonical bytes: sorted keys, no spaces, ASCII; NaN is not JSON."""
    assert canonical({"b": 1, "a": "é"}) == b'{"a":"\\u00e9","b":1}'
    with pytest.raises(ValueError):
        canonical({"a": float("nan")})
