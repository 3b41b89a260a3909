"""Per-request records and their summary, with `vllm bench serve`'s definitions.

- TTFT: request sent -> first chunk that carries content.
- ITL: gaps between successive content chunks, pooled over all requests.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request with > 1 token.
- E2EL: request sent -> response complete.
- Throughputs: over first send -> last completion (wall clock).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds, perf_counter clock)."""

    sent_at: float
    first_chunk_at: float | None = None  # first content chunk
    chunk_times: list[float] = field(default_factory=list)  # every content chunk
    done_at: float | None = None
    output_tokens: int = 0  # from usage when reported, else content chunks counted
    prompt_tokens: int | None = None  # from usage when reported
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    output_text: str = ""
    logprobs: list = field(default_factory=list)  # chat logprob entries, when the request asked for them
    finish_reason: str | None = None
    error: str | None = None
    tag: str = ""  # workload label (dataset group, conversation)
    turn: int = 0  # index of the turn within its conversation

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_at is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_chunk_at is None else self.first_chunk_at - self.sent_at

    @property
    def e2el(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(ttft=self.ttft, e2el=self.e2el, tpot=self.tpot, ok=self.ok)
        return d


def distribution_ms(values: list[float]) -> dict:
    """mean/p50/p95/p99 in milliseconds (zeros when there is nothing to summarize)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0, "count": 0}
    arr = np.asarray(values) * 1000.0
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p95": float(np.percentile(arr, 95)),
        "p99": float(np.percentile(arr, 99)),
        "count": int(arr.size),
    }


def summarize(records: list[RequestRecord]) -> dict:
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    if done:
        start = min(r.sent_at for r in records)
        duration = max(r.done_at for r in done) - start
    else:
        duration = 0.0
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens or 0 for r in done)
    with_usage = [r for r in done if r.prompt_tokens]
    cached = sum(r.cached_tokens or 0 for r in with_usage)
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    return {
        "completed": len(done),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:5],
        "duration_s": duration,
        "total_output_tokens": output,
        "total_prompt_tokens": prompt,
        "request_throughput": per_second(len(done)),
        "output_throughput_tok_s": per_second(output),
        "total_token_throughput_tok_s": per_second(output + prompt),
        "cached_token_ratio": (cached / sum(r.prompt_tokens for r in with_usage)) if with_usage else None,
        "ttft_ms": distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itls()]),
        "tpot_ms": distribution_ms([r.tpot for r in done if r.tpot is not None]),
        "e2el_ms": distribution_ms([r.e2el for r in done]),
        **_by_turn(done),
    }


def _by_turn(done: list[RequestRecord]) -> dict:
    """Multi-turn workloads: TTFT of first turns vs later turns (which can reuse the history's KV)."""
    if not any(r.turn for r in done):
        return {}
    return {"ttft_by_turn_ms": {
        "first": distribution_ms([r.ttft for r in done if r.turn == 0 and r.ttft is not None]),
        "later": distribution_ms([r.ttft for r in done if r.turn > 0 and r.ttft is not None]),
    }}
