"""The repository holds summaries, not raw benchmark records: a clone stays small as results accrue."""

from __future__ import annotations

import re
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


# Code and tests speak of the code, not of how or when it was built: a measurement is cited by the
# docs/benchmarks.md section that holds it, never by a run number or a work period.
PROCESS_WORDS = re.compile(r"grows with the [\w -]*issue|\bruns? \d+(-\d+)?\b|\bwork period|\bissue #?\d+|"
                           r"\bsessions?\b", re.IGNORECASE)
ALLOWED = re.compile(r'scope="session"|test session|session_start|Session\(|sessionfinish')


def test_code_and_tests_speak_of_the_code():
    offenders = []
    for path in _tracked("mlxq") + _tracked("tests") + _tracked("scripts"):
        if path.suffix != ".py" or path == Path(__file__).resolve():  # this file names the words
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PROCESS_WORDS.search(line) and not ALLOWED.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "process words in code (cite a benchmarks.md section instead):\n" + "\n".join(offenders)


CONFLICT_MARKER = re.compile(r"^(<{7}|>{7}) |^={7}$")


def test_no_merge_conflict_markers():
    """A merge that committed its conflict block leaves both sides' text where readers take one as true."""
    offenders = []
    for path in _tracked("."):
        if path.suffix not in {".py", ".md", ".toml", ".txt", ".cfg", ".yml", ".yaml"}:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if CONFLICT_MARKER.match(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}")
    assert not offenders, f"merge conflict markers: {offenders}"
