"""A holder process for the artifact-set tests: publishes a cache directory's set,
prints READY (with its peer id), then serves until killed.

``python tests/artifact_holder.py CONFIG_JSON``: ``settings`` (Settings fields),
``root``, ``units``, ``factors``, ``scope``; ``tamper``: after publishing, change one
byte of the served bytes (a holder gone bad).
"""

from __future__ import annotations

import json
import sys
import time

from nccl_back.caches import artifact_transfer as artifacts
from nccl_back.config import Settings


def main() -> int:
    cfg = json.loads(sys.argv[1])
    settings = Settings(**cfg["settings"])
    key = artifacts.CacheKey(cfg["factors"], cfg["scope"])
    what = artifacts.publish(settings, key, cfg["root"], cfg["units"])
    if not what.startswith("published"):
        print(f"FAILED {what}", flush=True)
        return 1
    service = artifacts._SERVING[-1]
    peer = service.peers[0].peer_id
    if cfg.get("tamper"):
        service.served_tensors(peer)["data"][100] ^= 1
    print(f"READY {peer}", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
