"""The demo's report: one row per worker, where its time went, and the fleet with peers
against the same fleet from storage alone."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
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
    rows = _rows(results, lambda r: (
        r["worker"], r["source"], source_of(r) or "-", f"{r['seconds']:.2f}", f"{r['gbps']:.3f}",
        "yes" if r["verified"] else "NO", r["fallback_reason"] or "-"))
    return "\n".join(_table(header, rows))


def _rows(results: Sequence[dict[str, Any]],
          row: Callable[[dict[str, Any]], tuple[str, ...]]) -> list[tuple[str, ...]]:
    """``row`` of each worker's result; a failed worker's row (7 columns) names its error."""
    return [(r["worker"], "FAILED", "", "", "", "", r["error"]) if "error" in r else row(r)
            for r in results]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: bool = False) -> list[str]:
    """Left-aligned columns, or (``right``: numbers) right-aligned after the first."""
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    return ["  ".join(str(c).rjust(w) if right and i else str(c).ljust(w)
                      for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
            for row in (header, *rows)]


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
    return "\n".join(_table(header, rows, right=True))


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


def format_new_version(results: Sequence[dict[str, Any]], checkpoint_bytes: int, download: float,
                       link_rate: float) -> str:
    """The brand-new version's round: one row per worker (bytes read on its own link,
    received from peers), then what storage served in all, the fleet's time against one
    ``download`` (the first round's, whose link moved ``link_rate`` bytes/s), and what
    the members' links moved together."""
    header = ("worker", "source", "seconds", "storage MB", "requests", "peers MB", "verified")
    rows = _rows(results, lambda r: (
        r["worker"], r["source"], f"{r['seconds']:.2f}", f"{r['link_bytes'] / 1e6:.1f}",
        str(r["link_requests"]), f"{r['peer_bytes'] / 1e6:.1f}", "yes" if r["verified"] else "NO"))
    lines = _table(header, rows)
    ok = [r for r in results if "error" not in r]
    if ok and checkpoint_bytes > 0 and download > 0:
        read = sum(r["link_bytes"] for r in ok)
        slowest = max(r["seconds"] for r in ok)
        lines.append(
            f"split download: storage served {read / 1e6:.1f} MB in all ({read / checkpoint_bytes:.2f}x"
            f" the {checkpoint_bytes / 1e6:.1f} MB checkpoint); all {len(ok)} ready in {slowest:.2f} s,"
            f" {slowest / download:.2f}x one download ({download:.2f} s above)")
        members = [r for r in ok if "share" in r.get("timings", {})]
        if members and link_rate > 0:
            together = sum(r["storage_bytes"] for r in members) / max(r["timings"]["share"] for r in members)
            lines.append(f"the members' links moved {together / 1e6:.0f} MB/s together while they read"
                         f" (one link alone, above: {link_rate / 1e6:.0f} MB/s)")
            if together < 1.5 * link_rate:
                lines.append(f"(here the emulated links and the workers share this machine's"
                             f" {os.cpu_count()} CPUs, so together the links moved about as much as"
                             " one or less; a split pays off where each worker's link to the bucket"
                             " is its own)")
    return "\n".join(lines).rstrip()
