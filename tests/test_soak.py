"""The fault-injection soak's CI variant (benchmarks/soak.py): the few rollouts of the
seed's first hundred whose schedules together draw every path those hundred draw (every
fault kind and hostile form, unit kind, TP layout, group size and fan-out: ``--cover``),
real processes, real Redis; any wrong weight, hang, untyped exception, overrun, leak or
key without a TTL fails it.

A failing run prints the seed and rollout; ``python benchmarks/soak.py --seed 20261201
--only N`` replays that rollout's schedule (the processes' timing is not replayable).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEED = 20261201
#: Every fault kind of benchmarks/soak.py: each is injected at least once.
FAULT_KINDS = ("kill", "stop", "redis_flush", "redis_restart", "redis_outage", "hostile", "shard_same",
               "shard_changed", "shard_flap", "replay_claim", "garble_relay", "early_close")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_soak_ci_variant(tmp_path: Path) -> None:
    """Seeded rollouts under random kills, stops, Redis loss, hostile records and rewritten
    shards: every worker holds its version's exact bytes or raised a typed error, in bound."""
    summary = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--seed", str(SEED), "--rollouts", "100",
         "--cover", "--json", str(summary)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert summary.exists(), tail
    result = json.loads(summary.read_text())
    assert result["rollouts"] >= 3, tail  # a run that did nothing proves nothing
    assert [k for k in FAULT_KINDS if not any(f.startswith(k) for f in result["faults"])] == [], tail
    assert result["wrong"] == 0, tail
    assert result["hangs"] == 0, tail
    assert result["failures"] == [], tail
    assert proc.returncode == 0, tail
