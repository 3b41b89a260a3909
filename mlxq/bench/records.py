"""Per-request records apart from the summaries: the JSON a sweep writes holds summaries only;
the records (one line per request: its timings, tokens, errors) go to a gzipped JSONL file
only when asked for (`--records PATH.jsonl.gz`), so results committed with docs stay small."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def _runs(result: dict) -> list[dict]:
    return list(result.get("a") or []) + list(result.get("b") or [])


def without_records(result: dict) -> dict:
    """A copy of a sweep's result with every measurement's per-request records left out."""
    out = dict(result)
    for side in ("a", "b"):
        if out.get(side) is not None:
            out[side] = [{k: v for k, v in run.items() if k != "records"} for run in out[side]]
    return out


def write_records(result: dict, path: Path) -> int:
    """Write every record as one JSON line tagged with its measurement; returns the count."""
    count = 0
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for index, run in enumerate(_runs(result)):
            for record in run.get("records") or []:
                tags = {"measurement": index, "label": run.get("label"), "concurrency": run.get("concurrency")}
                f.write(json.dumps(tags | record) + "\n")
                count += 1
    return count


def read_records(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
