"""scripts/bench_lockstep.py end to end on the CPU (ring, 2 ranks), a short version of its GPU command:
a steady decode issues one collective per loop iteration (an iteration with news, a request arriving, one
more)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mlxq.models.tiny import build_tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_lockstep.py"


def test_a_steady_decode_costs_one_gather_per_iteration(tmp_path):
    model = build_tiny_model("llama", tmp_path / "llama", preset="default")
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--servers", "2",
                           "--concurrency", "2", "--requests", "2", "--max-tokens", "32"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    two = next(r for r in rows if r.get("world") == 2 and "round" in r)
    assert two["cycle_ms"] > 0 and two["exchange_ms"] > 0
    assert 1.0 <= two["collectives"] <= 1.2  # 32 steps: about 35 iterations, 1-2 of them with news
    assert two["iterations_per_step"] < 1.2
