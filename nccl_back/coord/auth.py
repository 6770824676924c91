"""Signed coordination records: HMAC-SHA256 over canonical JSON, bound to a Redis key.

Whoever can write to Redis could otherwise tell a worker whom to receive weights from
and what hashes to expect. With ``Settings.secret`` set, every record carries ``"sig"``,
an HMAC under ``Settings.key("sign")`` of its canonical JSON prefixed by its Redis key,
so a genuine record cannot be replayed at another key; records that grant something
also sign an ``"exp"``, so an old one cannot be replayed later at the same key. Without
a secret every Redis writer is trusted; :func:`warn_unsigned` says so, loudly.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import threading
from collections.abc import Mapping
from typing import Any

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.errors import UntrustedRecordError
from nccl_back.log import get_logger
from nccl_back.timing import CLOCK_SKEW

log = get_logger(__name__)

SIG = "sig"
EXP = "exp"

_warned = threading.Event()


def canonical(value: Mapping[str, Any]) -> bytes:
    """The one byte string a JSON object signs as (ValueError for NaN/inf)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


class Signer:
    """Signs and verifies records with one key (``None``: unsigned mode)."""

    def __init__(self, key: bytes | None) -> None:
        self.key = key

    @classmethod
    def from_settings(cls, settings: Settings) -> Signer:
        """The signer of ``settings.secret`` (unsigned mode without one)."""
        return cls(settings.key("sign"))

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def sign(self, redis_key: str, record: Mapping[str, Any], ttl: float | None = None) -> dict[str, Any]:
        """``record`` as stored at ``redis_key``: with ``exp`` (when ``ttl`` is given)
        and ``sig`` if this signer has a key, unchanged otherwise."""
        out = {k: v for k, v in record.items() if k not in (SIG, EXP)}
        if self.key is None:
            return out
        if ttl is not None:
            out[EXP] = round(_clock.wall() + ttl, 3)
        out[SIG] = _mac(self.key, redis_key, out)
        return out

    def verify(self, redis_key: str, value: Any) -> dict[str, Any]:
        """The trusted record at ``redis_key`` without ``sig``/``exp``, or
        :class:`UntrustedRecordError`."""
        if not isinstance(value, dict):
            raise UntrustedRecordError(f"{redis_key}: not a JSON object")
        body = {k: v for k, v in value.items() if k != SIG}
        if self.key is not None:
            sig = value.get(SIG)
            if not isinstance(sig, str):
                raise UntrustedRecordError(f"{redis_key}: unsigned record (a secret is set)")
            try:
                expected = _mac(self.key, redis_key, body)
            except (TypeError, ValueError) as e:
                raise UntrustedRecordError(f"{redis_key}: record cannot be canonicalised: {e}") from e
            # As bytes: compare_digest raises TypeError on a non-ASCII str (a hostile sig).
            if not hmac.compare_digest(sig.encode("utf-8", "surrogatepass"), expected.encode()):
                raise UntrustedRecordError(f"{redis_key}: bad signature")
            exp = body.get(EXP)
            if exp is not None:
                if not isinstance(exp, (int, float)) or isinstance(exp, bool) or not math.isfinite(exp):
                    raise UntrustedRecordError(f"{redis_key}: malformed expiry")
                if exp + CLOCK_SKEW < _clock.wall():
                    raise UntrustedRecordError(f"{redis_key}: expired record (a replay?)")
        body.pop(EXP, None)
        return body


def transfer_scope(key: bytes | None, transfer_id: str) -> str:
    """The scope of a transfer's bootstrap keys; with a key (``Settings.key("store")``) it
    carries a token only the two sides can compute, so the keys cannot be named in
    advance from the transfer id."""
    if key is None:
        return transfer_id
    token = hmac.new(key, transfer_id.encode(), hashlib.sha256).hexdigest()[:32]
    return f"{transfer_id}-{token}"


def _mac(key: bytes, redis_key: str, body: Mapping[str, Any]) -> str:
    msg = redis_key.encode() + b"\0" + canonical(body)
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def warn_unsigned() -> None:
    """Say once per process that, without a secret, any Redis writer is trusted."""
    if _warned.is_set():
        return
    _warned.set()
    log.warning(
        "no_secret",
        message="NCCL_BACK_SECRET is not set: coordination records are unsigned and the"
        " integrity checks unkeyed, so anyone who can write to Redis can make this worker"
        " load weights of their choosing. Set NCCL_BACK_SECRET or NCCL_BACK_SECRET_FILE.",
    )
