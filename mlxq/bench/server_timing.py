"""An mlxq server's own account of a measurement: where its batch scheduler spent the time.

Read from ``/stats`` (``batch.decode_timing`` and ``batch.phase_timing``, cumulative)
before and after a measurement; the difference is that measurement's split. Other
servers (mlx_lm.server, vLLM) have no such endpoint: the split is then None.
"""

from __future__ import annotations

import httpx

_DECODE_PARTS = ("step_s", "build_s", "submit_s", "device_wait_s", "cycle_s")


async def read_totals(url: str, api_key: str | None = None) -> dict | None:
    """The cumulative counters, or None when the server has none (not mlxq, no batch lane)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(f"{url.rstrip('/')}/stats", headers=headers)
        batch = response.json().get("batch") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(batch, dict) or not batch.get("decode_timing"):
        return None
    decode, phases = batch["decode_timing"], batch.get("phase_timing") or {}
    return {"steps": decode["steps"], **decode["totals"], **phases.get("totals", {})}


def split(before: dict | None, after: dict | None) -> dict | None:
    """Per decode step between two readings: its parts and the loop's cycle (ms), and each
    phase's share of the scheduler's busy time (decode, prefill, join)."""
    if before is None or after is None:
        return None
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in (*_DECODE_PARTS, "steps", "cycles", "prefill_s",
                                                              "join_s")}
    steps, cycles = delta["steps"], delta["cycles"]
    if not steps:
        return None
    out = {"steps": steps}
    out.update({k.removesuffix("_s") + "_ms": round(1000 * delta[k] / steps, 3) for k in _DECODE_PARTS[:-1]})
    out["cycle_ms"] = round(1000 * delta["cycle_s"] / cycles, 3) if cycles else None
    # The same share /stats.batch.phase_timing reports since start, over this measurement only
    # (computed here: bench is a client of any server and imports nothing of the engine).
    busy = delta["step_s"] + delta["prefill_s"] + delta["join_s"]
    out["busy_share"] = {name: round(delta[key] / busy, 4) if busy else None
                         for name, key in (("decode", "step_s"), ("prefill", "prefill_s"), ("join", "join_s"))}
    return out
