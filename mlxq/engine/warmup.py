"""Start-up warm-up: every generation code path runs once before the first user's request.

MLX's GPU backends compile kernels the first time an operation meets a new
kind of input (and cuDNN builds a graph per attention shape). Seen on the
H200 (docs/benchmarks.md, "H200: start-up warm-up"): the first time joiners prefilled
together, every running row stalled for 7 s; the first batch merge and
eviction stalled a c=8 sweep for seconds. Those costs belong to start-up,
not to whichever users arrive first.

The warm-up runs on the engine thread before the server reports ready, on
synthetic prompts, with a scheduler of its own and no prompt cache: nothing
is stored, nothing is counted. It covers: joiners of different lengths
prefilled in one padded forward, tails of different lengths on caches
they hold (engine/tail_placement.py), a merge into a batch, batched decode (greedy
and seeded sampling), a joiner extending a running batch, evictions at
different times, and the return to a lone row's caches; with ``--batch 1``
the serial lane instead. Where rows may share a prefix
(``--shared-prefix-attention auto``/``on``), engine/warmup_shared.py runs
those paths too.
"""

from __future__ import annotations

import time
from dataclasses import replace

from mlxq.engine.burst_hold import BurstHold
from mlxq.engine.types import Request, SamplingParams
from mlxq.engine.warmup_shared import PREFIX_TOKENS, shares, warm_shared
from mlxq.models.multi_lora import adapter_names

_TEXT = "The quick brown fox jumps over the lazy dog while the engine warms up its kernels. "


def _prompt(tokenizer, length: int) -> list[int]:
    ids = tokenizer.encode(_TEXT * 8)
    return (ids * (length // max(len(ids), 1) + 1))[:length]


def warm_up(model, tokenizer, scheme, prefill_step_size: int, scheduler=None) -> float:
    """Run the code paths above once, the batch lane's as ``scheduler`` (the serving one) is
    configured, or the serial lane's without one; returns the seconds it took."""
    start = time.perf_counter()
    ignore = lambda event: None  # noqa: E731
    if scheduler is None:
        from mlxq.engine.serial import run_serial

        run_serial(model, tokenizer, Request("warmup", _prompt(tokenizer, 24), SamplingParams(), 4, ignore_eos=True),
                   ignore, prefill_step_size=prefill_step_size, scheme=scheme)
        return time.perf_counter() - start

    from mlxq.engine.scheduler import BatchScheduler

    config = replace(scheduler.config, max_rows=4, prompt_concurrency=4, kv_budget_bytes=None, burst=BurstHold())
    sched = BatchScheduler(model, tokenizer, scheduler.footprint, config, scheme=scheme)
    adapter = next(iter(adapter_names(model)), "")  # with --adapter: base, mixed and one-adapter steps too
    sched.add(Request("warmup-0", _prompt(tokenizer, 33), SamplingParams(), 6, ignore_eos=True), ignore)
    sched.add(Request("warmup-1", _prompt(tokenizer, 17), SamplingParams(temperature=0.7, seed=0), 4,
                      ignore_eos=True, adapter=adapter), ignore)
    for _ in range(8):  # both prefill in one step and join
        if sched.num_rows == 2:
            break
        sched.step()
    sched.add(Request("warmup-2", _prompt(tokenizer, 9), SamplingParams(), 3, ignore_eos=True, adapter=adapter),
              ignore)
    for _ in range(64):
        if sched.is_idle:
            break
        sched.step()
    _warm_placed_tails(model, tokenizer, scheme, scheduler, config)
    if shares(scheduler):
        warm_shared(model, tokenizer, scheduler, _prompt(tokenizer, PREFIX_TOKENS + 8))
    return time.perf_counter() - start


def _warm_placed_tails(model, tokenizer, scheme, scheduler, config) -> None:
    """Joiners continuing prefixes they hold, with chunks of different lengths in one forward: the
    placement of a cached burst's tails (engine/tail_placement.py; 16-token chunks: 16 + 16, then
    16 + 11 on the first chunks' caches)."""
    from mlxq.engine.scheduler import BatchScheduler

    ignore = lambda event: None  # noqa: E731
    sched = BatchScheduler(model, tokenizer, scheduler.footprint, replace(config, prefill_step_size=16), scheme=scheme)
    sched.add(Request("warmup-3", _prompt(tokenizer, 40), SamplingParams(), 2, ignore_eos=True), ignore)
    sched.add(Request("warmup-4", _prompt(tokenizer, 28), SamplingParams(), 2, ignore_eos=True), ignore)
    for _ in range(16):
        if sched.is_idle:
            break
        sched.step()
