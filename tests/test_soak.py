"""The fault-injection soak's CI variant (benchmarks/soak.py): about two minutes of
rollouts with every fault kind, real processes, real Redis; any wrong weight, hang,
untyped exception, overrun, leak or key without a TTL fails it.

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
#: Rollouts start until this many seconds have passed (about 14 on a quiet 2-core
#: machine); a loaded machine runs fewer, never longer.
BUDGET_S = 110


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_soak_ci_variant(tmp_path: Path) -> None:
    """Seeded rollouts under random kills, stops, Redis loss, hostile records and rewritten
    shards: every worker holds its version's exact bytes or raised a typed error, in bound."""
    summary = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--seed", str(SEED), "--rollouts", "40",
         "--budget", str(BUDGET_S), "--json", str(summary)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert summary.exists(), tail
    result = json.loads(summary.read_text())
    assert result["rollouts"] >= 3, tail  # a run that did nothing proves nothing
    assert sum(result["faults"].values()) > 0, tail
    assert result["wrong"] == 0, tail
    assert result["hangs"] == 0, tail
    assert result["failures"] == [], tail
    assert proc.returncode == 0, tail
