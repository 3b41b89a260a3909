"""A burst's way to its first tokens on one time axis, from the server's JSON request log.

    python scripts/burst_timeline.py SERVER_LOG [--gap-s 1.0] [--json out.json]

Each batch-lane request's log record (``--log-format json``) carries when the
server read it (``received_monotonic_s``), its parse, its queue and its way
from admission to token 0 in phases (engine/ttft_phases.py). Placed on one
axis per wave (requests received within ``--gap-s`` of the previous one),
they show where the last first token of a burst goes: the burst's arrival
on the server's event loop, the engine taking it in (one admission after
another), each forward of a group of tails (rows whose prefill started
together), and token 0. Per wave and per forward group, milliseconds after
the wave's first request was read: received (first / last), admitted
(first / last), forward start, forward end (the last row's ``prefilled``),
token 0 (first / last).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlxq.bench.request_phases import logged_requests

PHASES = ("lease", "wait", "prefill", "ready", "join", "first")


def records(path: Path) -> list[dict]:
    """The batch lane's request-log records (they carry the arrival and the TTFT), in order of arrival."""
    out = [r for r in logged_requests(path) if "received_monotonic_s" in r and "ttft_ms" in r]
    return sorted(out, key=lambda r: r["received_monotonic_s"])


def waves(recs: list[dict], gap_s: float) -> list[list[dict]]:
    out: list[list[dict]] = []
    for r in recs:
        if not out or r["received_monotonic_s"] - out[-1][-1]["received_monotonic_s"] > gap_s:
            out.append([])
        out[-1].append(r)
    return out


def marks(r: dict, t0: float) -> dict[str, float]:
    """The request's points in ms after ``t0``: received, submitted, admitted, forward start and end, token 0."""
    received = 1000 * (r["received_monotonic_s"] - t0)
    submitted = received + (r.get("parse_ms") or 0.0)
    admitted = submitted + r["queue_ms"]
    phase = {p: r.get(f"ttft_{p}_ms") or 0.0 for p in PHASES}
    start = admitted + phase["lease"] + phase["wait"]
    return {"received": received, "admitted": admitted, "forward_start": start,
            "forward_end": start + phase["prefill"], "token0": submitted + r["ttft_ms"]}


def groups(rows: list[dict[str, float]], within_ms: float = 1.0) -> list[list[dict[str, float]]]:
    """Rows whose forward started within ``within_ms`` of each other: one forward."""
    out: list[list[dict[str, float]]] = []
    for row in sorted(rows, key=lambda m: m["forward_start"]):
        if not out or row["forward_start"] - out[-1][0]["forward_start"] > within_ms:
            out.append([])
        out[-1].append(row)
    return out


def span(group: list[dict[str, float]], first: str, last: str) -> list[float]:
    """[earliest ``first`` mark, latest ``last`` mark] of the group's rows."""
    return [round(min(m[first] for m in group), 1), round(max(m[last] for m in group), 1)]


def timeline(wave: list[dict]) -> dict:
    t0 = wave[0]["received_monotonic_s"]
    rows = [marks(r, t0) for r in wave]
    out = [{"rows": len(group), "received": span(group, "received", "received"),
            "admitted": span(group, "admitted", "admitted"), "forward": span(group, "forward_start", "forward_end"),
            "token0": span(group, "token0", "token0")} for group in groups(rows)]
    return {"requests": len(wave), "last_token0_ms": round(max(m["token0"] for m in rows), 1), "groups": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--gap-s", type=float, default=1.0, help="a wave ends where no request was read for this long")
    ap.add_argument("--json", type=Path, help="also write the timelines here")
    args = ap.parse_args()
    result = [timeline(w) for w in waves(records(args.log), args.gap_s)]
    for i, t in enumerate(result):
        print(f"wave {i}: {t['requests']} requests, last token 0 at {t['last_token0_ms']:.0f} ms")
        for g in t["groups"]:
            print("  {rows:3d} rows: received {r[0]:6.0f}-{r[1]:<6.0f} admitted {a[0]:6.0f}-{a[1]:<6.0f} "
                  "forward {f[0]:6.0f}-{f[1]:<6.0f} token 0 {k[0]:6.0f}-{k[1]:.0f}".format(
                      rows=g["rows"], r=g["received"], a=g["admitted"], f=g["forward"], k=g["token0"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
