"""A server's request log read back: per measured round, where the first token's time went.

An mlxq server started with ``--log-format json --log-level info`` logs one
line per finished request (server/request_log.py), with ``queue_ms`` and the
batch lane's way from admission to token 0 in phases (``ttft_<phase>_ms``,
engine/ttft_phases.py). A serving-load round on one server is its warm-up
requests, then the round's requests; rounds run one after another, so the
requests ordered by when the server received them split into rounds.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxq.bench.burst_causes import spread


def logged_requests(path: Path, offset: int = 0) -> list[dict]:
    """The request-log records in ``path`` from byte ``offset`` on (other lines skipped)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    out = []
    for line in text.splitlines():
        start = line.find("{")
        try:
            fields = json.loads(line[start:]) if start >= 0 else {}
        except ValueError:
            continue
        if isinstance(fields, dict) and "queue_ms" in fields and "id" in fields:
            out.append(fields)
    return out


def phases_of(fields: dict) -> dict[str, float]:
    """A record's ``ttft_<phase>_ms`` fields as phase -> ms (empty for the serial lane)."""
    return {key[5:-3]: value for key, value in fields.items()
            if key.startswith("ttft_") and key.endswith("_ms") and key != "ttft_ms" and value is not None}


def split_rounds(records: list[dict], per_round: int, warmup: int) -> list[list[dict]]:
    """The records in order of arrival, cut into rounds of ``warmup`` + ``per_round``, warm-ups dropped."""
    ordered = sorted(records, key=lambda r: r.get("received_monotonic_s") or 0.0)
    size = warmup + per_round
    return [ordered[i + warmup:i + size] for i in range(0, len(ordered), size)]


def round_summary(records: list[dict]) -> dict[str, dict[str, float]]:
    """p50 / p95 over one round's requests: the parse (received -> submitted), the server's TTFT
    (submitted -> token 0), the queue and each phase after it."""
    names = list(dict.fromkeys(name for r in records for name in phases_of(r)))  # the server's order
    out = {key: spread([r[f"{key}_ms"] for r in records if r.get(f"{key}_ms") is not None])
           for key in ("parse", "ttft", "queue")}
    for name in names:
        out[name] = spread([phases_of(r)[name] for r in records if name in phases_of(r)])
    return out


def summary_line(summary: dict[str, dict[str, float]]) -> str:
    """``name p50/p95`` per entry, in ms."""
    return ", ".join(f"{name} {v['p50']:.0f}/{v['p95']:.0f}" for name, v in summary.items() if v) or "not logged"
