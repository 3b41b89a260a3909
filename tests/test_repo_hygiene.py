"""The repository holds summaries, not raw benchmark records: a clone stays small as results accrue."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_BYTES = 300 * 1024
MAX_RESULTS_BYTES = 2 * 1024 * 1024


def _tracked(path: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", path], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def test_no_large_tracked_result_file():
    big = [f"{p.relative_to(ROOT)} ({p.stat().st_size // 1024} KB)" for p in _tracked("docs/results")
           if p.stat().st_size > MAX_FILE_BYTES]
    assert not big, f"results over 300 KB (keep summaries; write records with --records outside git): {big}"


def test_results_stay_small():
    total = sum(p.stat().st_size for p in _tracked("docs/results"))
    assert total <= MAX_RESULTS_BYTES, f"docs/results holds {total / 2**20:.1f} MiB of tracked files (limit 2 MiB)"
