"""An application embedding nccl_back, run as its own process by tests/test_logging.py.

    python embed_app.py CKPT REDIS_URL NAMESPACE CACHE_DIR RESULT [--logging FILE]
                        [--serve-until FILE] [--started FILE]

Loads the checkpoint through a WeightService (peer first) and writes the LoadResult to
RESULT as JSON; prints nothing itself. ``--logging FILE`` configures the standard
``logging`` module as an application would (basicConfig on stderr at INFO) and also
writes each nccl_back record's structured attributes to FILE as JSON lines.
``--serve-until FILE`` keeps serving peers until FILE exists; ``--started FILE`` is
created just before the load starts. Other settings come from ``NCCL_BACK_*``
variables (TLS files, for instance).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from nccl_back import ModelSpec, Settings, WeightService
from nccl_back.model.checkpoint import flat_skeleton


class _Fields(logging.Handler):
    """Keeps what a JSON log formatter would see: the record's extra attributes."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        fields = {k: getattr(record, k, None) for k in ("event", "rank", "version", "peer", "source")}
        with open(self.path, "a") as f:
            f.write(json.dumps({"logger": record.name, "level": record.levelname,
                                "message": record.getMessage(), **fields}, default=str) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("ckpt", "redis_url", "namespace", "cache_dir", "result"):
        p.add_argument(name)
    p.add_argument("--logging")
    p.add_argument("--serve-until")
    p.add_argument("--started")
    args = p.parse_args()
    if args.logging:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
        logging.getLogger().addHandler(_Fields(args.logging))
    settings = Settings.from_env(
        redis_url=args.redis_url, namespace=args.namespace, cache_dir=args.cache_dir,
        advertise_host="127.0.0.1", redis_timeout=0.5,
        peer_ttl=3.0,
    ).capped(busy_wait=1.0, single_flight_wait=1.0)
    spec = ModelSpec.from_dir(args.ckpt, cache_dir=args.cache_dir)
    model = flat_skeleton(spec)
    with WeightService(settings, worker_id=f"embed-{os.getpid()}") as svc:
        if args.started:
            open(args.started, "w").close()
        result = svc.load(model, spec)
        with open(args.result, "w") as f:
            json.dump({"source": result.source, "verified": result.verified,
                       "seconds": result.seconds,
                       "fallback_reason": result.fallback_reason, "peer_id": result.peer_id}, f)
        # Only a safety net for an orphan: the test touches the file when it is done
        # (a loaded machine takes over 40 s to reach its last worker).
        deadline = time.monotonic() + 600
        while args.serve_until and not os.path.exists(args.serve_until) and time.monotonic() < deadline:
            time.sleep(0.05)


if __name__ == "__main__":
    main()
