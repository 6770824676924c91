"""Whom a cohort blames when one member of the trees garbles what it forwards.

Run: ``.venv/bin/python benchmarks/garbling_member.py [--runs 3] [--cases 0,1,2,3]``

Six worker processes released together in the fan-out's trees behind
one or two honest holders, secret set; the member seated at position 1 (the second
tree's root) or 2 (interior in the first tree) flips every byte its relay endpoint
forwards while its own copy stays exact (tests/faults.py, the fault
``corrupt_relay_seat=N``). Per run: each member's source (a storage read is a load from
storage while an honest holder lived), the sources it blamed for failing verification
(``GARBLER``, ``HOLDER``, or the seat of an honest member), and whether any member
reported verified bytes that differ from the checkpoint. The same scenario is the test
``tests/test_relay_trees.py::test_a_member_garbling_what_it_forwards_is_the_only_one_blamed``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_relay_trees as trees  # noqa: E402
from test_service import MODEL, Fleet  # noqa: E402

from nccl_back.dev.servers import LocalRedis  # noqa: E402

from models import TinyTransformer, fill_random, write_checkpoint  # noqa: E402

#: (garbling seat, verify mode, holders): each seat, mode and holder count twice.
CASES = [(1, "sampled", 1), (1, "full", 2), (2, "full", 1), (2, "sampled", 2)]


def run(redis_url: str, seat: int, verify: str, holders: int) -> dict[str, Any]:
    """One cohort: every member's outcome, named by seat."""
    tmp = Path(tempfile.mkdtemp(prefix="nccl-back-garble-"))
    ckpt = str(write_checkpoint(fill_random(TinyTransformer(**MODEL), seed=13), tmp / "ckpt"))
    namespace = "g" + uuid.uuid4().hex[:12]
    fleet = Fleet(ckpt, redis_url, namespace, str(tmp / "cache"))
    fleet.settings.update(verify=verify, secret="a-fleet-secret-for-the-trees-0123")
    try:
        roles = []
        for h in range(holders):
            fleet.start(f"holder{h}", settings={"max_send_gbps": 0.0004})
            roles.append(fleet.report()["role"])
        _, t0 = trees._release(fleet, 6, trees.TREES | {"max_send_gbps": 0.0008},
                               fault=f"corrupt_relay_seat={seat}")
        order = trees._seats(redis_url, namespace, 6, t0)
        reports = [fleet.report(timeout=90) for _ in range(6)]
        seconds = time.monotonic() - t0

        def name(peer: str) -> str:
            if peer == order[seat]:
                return "GARBLER"
            if peer.split("-", 1)[0] in roles:
                return "HOLDER"
            return f"seat{order.index(peer)}" if peer in order else peer

        members = [{"seat": order.index(next(m for m in order if m.startswith(r["role"] + "-"))),
                    "source": r.get("source"), "blamed": sorted(name(b) for b in r.get("blamed", [])),
                    "verified_wrong": bool(r.get("verified") and not r.get("identical")),
                    "error": r.get("error")} for r in reports]
        forwarders = {f"seat{m['seat']}" for m in members
                      if m["seat"] % 2 == seat % 2 and "GARBLER" in m["blamed"]}
        return {"case": [seat, verify, holders], "seconds": round(seconds, 1),
                "storage_reads": sum(m["source"] == "storage" for m in members),
                "wrong_bytes_verified": sum(m["verified_wrong"] for m in members),
                "holder_blamed": sum(b == "HOLDER" for m in members for b in m["blamed"]),
                # A member in the garbler's tree that caught its bytes itself had forwarded
                # them first: its receivers blame it (they cannot tell it from the garbler).
                "forwarders_blamed": sum(b in forwarders for m in members for b in m["blamed"]),
                "honest_members_blamed": sum(b not in ("GARBLER", "HOLDER", *forwarders)
                                             for m in members for b in m["blamed"]),
                "blamed_by_seat": {m["seat"]: m["blamed"] for m in sorted(members, key=lambda m: m["seat"])
                                   if m["blamed"]},
                "errors": [m["error"] for m in members if m["error"]]}
    finally:
        fleet.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))),
                    help=f"indices into {CASES}")
    args = ap.parse_args()
    server = LocalRedis().start()
    try:
        for i in (int(c) for c in args.cases.split(",")):
            for n in range(args.runs):
                print(json.dumps({"run": n, **run(server.url, *CASES[i])}), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
