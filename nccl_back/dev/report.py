"""The demo's report: one row per worker, where its time went, and the fleet with peers
against the same fleet from storage alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: ``--phases`` columns: LoadResult.timings keys (and the skeleton build), in load order.
PHASES = ("skeleton", "discovery", "handshake", "transfer", "verify", "storage", "hash")



def format_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per worker: where its weights came from, how fast, verified, why not a peer."""
    by_id = {r.get("worker_id", ""): r["worker"] for r in results}

    def source_of(r: dict[str, Any]) -> str:
        peer = r.get("peer_id") or ""
        # Peer ids start with the serving worker's id: show that worker's name.
        return next((n for wid, n in by_id.items() if wid and peer.startswith(wid + "-")), peer)

    header = ("worker", "source", "from", "seconds", "GB/s", "verified", "fallback reason")
    rows = []
    for r in results:
        if "error" in r:
            rows.append((r["worker"], "FAILED", "", "", "", "", r["error"]))
            continue
        rows.append((r["worker"], r["source"], source_of(r) or "-", f"{r['seconds']:.2f}",
                     f"{r['gbps']:.2f}", "yes" if r["verified"] else "NO",
                     r["fallback_reason"] or "-"))
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header) - 1)]
    lines = []
    for row in (header, *rows):
        cells = [str(c).ljust(w) for c, w in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, str(row[-1])]).rstrip())
    return "\n".join(lines)


def format_phases(results: Sequence[dict[str, Any]]) -> str:
    """Seconds per phase and worker (``-``: the phase did not run for that worker)."""
    header = ("worker", *PHASES, "total")
    rows = []
    for r in results:
        if "error" in r:
            continue
        timings = {**r.get("timings", {}), "skeleton": r.get("skeleton_seconds", 0.0)}
        rows.append((r["worker"], *(f"{timings[p]:.3f}" if p in timings else "-" for p in PHASES),
                     f"{r['seconds'] + r.get('skeleton_seconds', 0.0):.3f}"))
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    return "\n".join("  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
                      for row in (header, *rows))


def format_comparison(results: Sequence[dict[str, Any]], gbit: float | None) -> str:
    """What the fleet cost with peers, and what it would cost from storage alone.

    Storage alone is computed, not run: every worker has its own link to the bucket, so
    each of the N downloads would take as long as the measured one did (``gbit`` None:
    real infrastructure, nothing throttled; the same reasoning on the measured rows).
    """
    ok = [r for r in results if "error" not in r]
    stored = [r for r in ok if r["source"] == "storage"]
    peers = [r for r in ok if r["source"] == "peer"]
    if not stored or not peers:
        return ""
    total = len(results)
    download = max(r["seconds"] for r in stored)
    nbytes = stored[0]["bytes"]
    fastest, slowest = (f(r["seconds"] for r in peers) for f in (min, max))
    link = f" at {gbit:g} Gbit/s per worker" if gbit is not None else ""
    return "\n".join([
        f"with peers:    {len(stored)} download(s) from storage ({download:.2f} s{link}),"
        f" {len(peers)} worker(s) from peers in {fastest:.2f}-{slowest:.2f} s each"
        f" ({download / slowest:.1f}x-{download / fastest:.1f}x faster than a download);"
        f" {len(stored) * nbytes / 1e9:.2f} GB read from storage",
        f"storage alone: {total} downloads, each worker ready in about {download:.2f} s"
        f" (computed from the download measured above: every worker has its own link);"
        f" {total * nbytes / 1e9:.2f} GB read from storage",
    ])
