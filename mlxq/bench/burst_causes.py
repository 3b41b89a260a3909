"""Bursts of agents, read back: why a request's first token came late, and per-wave summaries.

Plain data in (each request's timings, ``/stats`` readings taken while the
wave ran), plain data out; scripts/agents_burst.py makes the measurements.
A request whose first token came more than ``factor`` times the wave's
median (and at least ``min_ms``) after it was sent is an outlier, and its
cause is named: admission held it in the queue (what was full: rows, the
prompt concurrency, the KV budget, the memory room, a row cap lowered by
memory faults), a memory fault preempted it, or it prefilled its own prompt.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class Sample:
    """One reading of /stats.batch (and the prompt cache), at ``t`` seconds into the wave."""

    t: float
    active: int
    prefilling: int
    pending: int
    preempted: int
    row_cap: int
    kv_bytes: int
    kv_budget: int | None
    preemptions: int
    cache_entries: int
    active_bytes: int  # MLX's active memory
    limit_bytes: int  # MLX's memory limit: a newcomer waits while its KV would not fit below 95% of it


@dataclass
class Record:
    wave: int
    id: str
    sent_s: float  # into the wave
    ttft_ms: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_ms: float | None = None  # the server's: submit -> engine pickup (from its request log)
    phases_ms: dict[str, float] | None = None  # the server's: pickup -> token 0 by phase (engine/ttft_phases.py)
    parse_ms: float | None = None  # the server's: request received -> submitted (read, render, tokenize)
    server_ttft_ms: float | None = None  # the server's: submitted -> token 0
    sent_at: float | None = None  # the client's time.monotonic() when it sent the request
    send_ms: float | None = None  # sent -> the server's route began reading it (one host's monotonic clock)
    written_at: float | None = None  # the client's time.monotonic() as it wrote the request's headers
    read_at: float | None = None  # the server's time.monotonic() when its event loop read the headers
    outlier: str | None = None  # the cause, for an outlier


def sample_of(stats: dict, t: float) -> Sample:
    batch, cache, memory = stats.get("batch") or {}, stats.get("prompt_cache") or {}, stats.get("memory") or {}
    return Sample(t, batch.get("active_rows", 0), batch.get("prefilling_rows", 0), stats["engine"]["waiting"],
                  batch.get("preempted_rows", 0), batch.get("row_cap", 0), batch.get("kv_bytes", 0),
                  batch.get("kv_budget_bytes"), (batch.get("faults") or {}).get("preemptions", 0),
                  cache.get("entries", 0), memory.get("mlx_active_bytes", 0), memory.get("mlx_memory_limit_bytes", 0))


def explain(record: Record, samples: list[Sample], batch: int, prompt_concurrency: int) -> str:
    """Why this request's first token came late, from the server's state while it waited."""
    during = [s for s in samples if record.sent_s <= s.t <= record.sent_s + record.ttft_ms / 1000] or samples[-1:]
    if not during:
        return "no /stats reading while it waited"
    faults = during[-1].preemptions - during[0].preemptions
    if record.queue_ms is not None and record.queue_ms >= record.ttft_ms / 2:
        admitted = record.sent_s + record.queue_ms / 1000
        at = ([s for s in during if s.t <= admitted] or during)[-1]  # the last reading before admission
        return f"queued {record.queue_ms:.0f} ms before admission: {held_by(at, batch, prompt_concurrency)}"
    if faults > 0 or max(s.preempted for s in during) > 0:
        return f"memory faults while it waited: {faults} preemptions (KV dropped and recomputed)"
    uncached = record.prompt_tokens - record.cached_tokens
    return f"prefill after admission: {uncached} uncached prompt tokens, beside {max(s.active for s in during)} rows"


def held_by(at: Sample, batch: int, prompt_concurrency: int) -> str:
    """What kept the queue's head out, as one /stats reading shows it."""
    if at.row_cap < batch:
        return f"row cap lowered to {at.row_cap} by memory faults"
    if at.active + at.prefilling >= at.row_cap:
        return f"all {at.row_cap} rows were taken"
    if at.kv_budget and at.kv_bytes > 0.9 * at.kv_budget:
        return f"the KV budget was full ({at.kv_bytes / 1e9:.2f} of {at.kv_budget / 1e9:.2f} GB)"
    if at.preempted:
        return f"{at.preempted} preempted rows go first"
    room = 0.95 * at.limit_bytes - at.active_bytes
    if at.limit_bytes and room < 0.05 * at.limit_bytes:
        return (f"memory room while busy: {room / 1e9:.2f} GB left under 95% of MLX's "
                f"{at.limit_bytes / 1e9:.1f} GB limit (the RAM tier and the rows' KV hold the rest)")
    if at.prefilling >= prompt_concurrency:
        return f"{at.prefilling} joiners were prefilling (--prompt-concurrency {prompt_concurrency})"
    return (f"not visible in /stats ({at.pending} waiting, {at.prefilling} prefilling, {at.active} rows, "
            f"{room / 1e9:.2f} GB memory room)")


def mark_outliers(records: list[Record], samples: list[Sample], factor: float, min_ms: float, batch: int,
                  prompt_concurrency: int) -> None:
    median = statistics.median(r.ttft_ms for r in records)
    for r in records:
        if r.ttft_ms > max(factor * median, min_ms):
            r.outlier = explain(r, samples, batch, prompt_concurrency)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def wave_summary(records: list[Record], samples: list[Sample], wall: float, stats: dict) -> dict:
    ttfts = [r.ttft_ms for r in records]
    cache = stats.get("prompt_cache") or {}
    return {"requests": len(records), "wall_s": round(wall, 3),
            "ttft_ms": {"p50": round(pct(ttfts, 0.5), 1), "p95": round(pct(ttfts, 0.95), 1),
                        "max": round(max(ttfts), 1)},
            "out_tok_s": round(sum(r.completion_tokens for r in records) / wall, 1),
            "prompt_tokens_mean": round(statistics.mean(r.prompt_tokens for r in records), 1),
            "cached_share": round(sum(r.cached_tokens for r in records) / max(1, sum(r.prompt_tokens for r in records)),
                                  3),
            "ram_tier": {k: cache.get(k) for k in ("entries", "nodes", "bytes", "max_bytes", "evictions", "puts")},
            "shared_prefills": (stats.get("batch") or {}).get("shared_prefills"),
            "preemptions": (stats.get("batch") or {}).get("faults", {}).get("preemptions"),
            # Totals since the server started: how the joins went (kept/referenced/copied rows), prefill steps.
            "row_copies": (stats.get("batch") or {}).get("row_copies"),
            "prefill_iterations": ((stats.get("batch") or {}).get("phase_timing") or {}).get("prefill_iterations"),
            "max_pending": max((s.pending for s in samples), default=0),
            "queue_ms": spread([r.queue_ms for r in records if r.queue_ms is not None]),
            **outside_engine(records),
            "ttft_phases_ms": phase_spread(records),
            "outliers": [{"id": r.id, "ttft_ms": round(r.ttft_ms), "cause": r.outlier} for r in records if r.outlier]}


def spread(values: list[float]) -> dict[str, float] | None:
    return {"p50": round(pct(values, 0.5), 1), "p95": round(pct(values, 0.95), 1)} if values else None


def outside_engine(records: list[Record]) -> dict:
    """The client's first-token time outside the engine: ``parse_ms`` (received -> submitted, the server's)
    and ``http_ms`` (the rest: sending, reading the SSE chunk, the client's own work), p50 / p95; with a
    client on the server's host, ``http_ms`` split in ``send_ms`` (sent -> the route began reading it) and
    ``back_ms`` (token 0 -> the client read its chunk), and ``send_ms`` in the client's part ``client_ms``
    (sent -> it writes its headers: connecting, building, writing, waiting for the client's own loop),
    ``wire_ms`` (written -> the server's event loop read the headers: the kernel, and the loop's turn
    to read that socket) and ``route_ms`` (read -> the route began: the loop's queue of ready tasks)."""
    timed = [r for r in records if r.parse_ms is not None and r.server_ttft_ms is not None]
    sent = [r for r in timed if r.send_ms is not None]
    written = [r for r in sent if r.written_at is not None]
    read = [r for r in written if r.read_at is not None]
    return {"parse_ms": spread([r.parse_ms for r in timed]),
            "http_ms": spread([r.ttft_ms - r.parse_ms - r.server_ttft_ms for r in timed]),
            "send_ms": spread([r.send_ms for r in sent]),
            "client_ms": spread([(r.written_at - r.sent_at) * 1000 for r in written]),
            "wire_ms": spread([(r.read_at - r.written_at) * 1000 for r in read]),
            "route_ms": spread([r.sent_at * 1000 + r.send_ms - r.read_at * 1000 for r in read]),
            "back_ms": spread([r.ttft_ms - r.parse_ms - r.server_ttft_ms - r.send_ms for r in sent])}


def phase_spread(records: list[Record]) -> dict[str, dict[str, float]]:
    """Per phase of admission -> token 0 (the server's request log), p50 / p95 over the requests that had it."""
    names = list(dict.fromkeys(name for r in records for name in (r.phases_ms or {})))  # the server's order
    return {name: spread([r.phases_ms[name] for r in records if r.phases_ms and name in r.phases_ms])
            for name in names}


def overall_summary(records: list[Record], waves: list[dict], cold_waves: int) -> dict:
    """Cold bursts vs waves on a cached prefix; the most agents the RAM tier held before its first eviction."""
    cold = [r.ttft_ms for r in records if r.wave < cold_waves]
    cached = [r.ttft_ms for r in records if r.wave >= cold_waves]
    held = [w["ram_tier"]["entries"] for w in waves if not w["ram_tier"]["evictions"]]
    return {"cold_ttft_ms": {"p95": round(pct(cold, 0.95), 1), "max": round(max(cold), 1)} if cold else None,
            "cached_ttft_ms": {"p50": round(pct(cached, 0.5), 1), "p95": round(pct(cached, 0.95), 1)}
            if cached else None,
            "cached_out_tok_s": [w["out_tok_s"] for w in waves[cold_waves:]],
            "cached_queue_ms": spread([r.queue_ms for r in records if r.wave >= cold_waves and r.queue_ms is not None]),
            "cached_outside_engine": outside_engine([r for r in records if r.wave >= cold_waves]),
            "cached_ttft_phases_ms": phase_spread([r for r in records if r.wave >= cold_waves]),
            "ram_entries_before_eviction": max(held, default=None),
            "ram_entries_last": waves[-1]["ram_tier"]["entries"] if waves else None,
            "outliers": sum(len(w["outliers"]) for w in waves)}
