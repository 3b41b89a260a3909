"""Start-up warm-up of the shared-prefix paths: agents on a cached prefix, before the first user's.

With ``--shared-prefix-attention auto`` or ``on`` the batch lane has paths
the plain warm-up (engine/warmup.py) never reaches: joiners' tails
prefilled on a stored prefix read by reference (engine/shared_tails.py:
the shared-prefix attention with many queries per row, its kernel's first
launch included on CUDA), those rows adopted as a group, joiners appended to a running
group, rows grouped after an ordinary join (``RunningBatch.share``),
grouped decode steps, and rows leaving a group (extracted and stored).
Each runs here once on a 48-token prefix, on a scheduler of its own with a
prompt cache of its own (nothing it stores outlives the warm-up), under
``on`` so that rows this few are grouped at all.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxq.engine.burst_hold import BurstHold
from mlxq.engine.prefix_sharing import SharingPolicy
from mlxq.engine.types import Request, SamplingParams

log = logging.getLogger("mlxq.engine")

PREFIX_TOKENS = 48  # above prefix_sharing.MIN_PREFIX_TOKENS: ``on`` groups rows on it
_CACHE_BYTES = 1 << 30  # the warm-up's own RAM tier: it holds a few 48-token chains


def shares(scheduler) -> bool:
    """The serving scheduler may group rows on a shared prefix (so its paths need a warm-up)."""
    policy = scheduler.sharing
    return (policy is not None and policy.mode != "off" and policy.plan is not None and policy.plan.can_share
            and scheduler.prompt_cache is not None)


def warm_shared(model, tokenizer, scheduler, prompt: list[int]) -> None:
    """Run the shared-prefix paths once on ``prompt`` (at least PREFIX_TOKENS + 8 tokens) with a
    scheduler configured as ``scheduler`` (the serving one)."""
    from mlxq.engine.scheduler import BatchScheduler
    from mlxq.store.prompt_cache import PromptCache

    began = time.perf_counter()
    prefix = prompt[:PREFIX_TOKENS]
    config = replace(scheduler.config, max_rows=8, prompt_concurrency=4, kv_budget_bytes=None, burst=BurstHold())
    sched = BatchScheduler(model, tokenizer, scheduler.footprint, config, prompt_cache=PromptCache(_CACHE_BYTES),
                           scheme=scheduler.scheme, sharing=SharingPolicy("on", scheduler.sharing.plan))
    _store(sched, model, prefix)
    agents = iter(range(1, 64))

    def agent(tail: int) -> Request:
        n = next(agents)
        own = [prompt[PREFIX_TOKENS + (n + i) % 8] for i in range(tail)]
        return Request(f"warmup-shared-{n}", prefix + own, SamplingParams(), 4, ignore_eos=True)

    _run(sched, [agent(3)], rows=1)  # alone: solo caches
    _run(sched, [agent(4)], rows=2)  # an ordinary join, then the two rows grouped
    _run(sched, [agent(3), agent(5)], rows=4)  # tails on the running group's prefix, appended to it
    _run(sched, [], rows=0)  # every row leaves its group, stored
    _run(sched, [agent(3), agent(4), agent(6)], rows=0)  # tails on the stored prefix into an empty batch
    log.info("shared-prefix warm-up: its paths ran once in %.1fs", time.perf_counter() - began)


def _store(sched, model, prefix: list[int]) -> None:
    caches = make_prompt_cache(model)
    model(mx.array([prefix]), cache=caches)
    sched.scheme.convert(caches)  # where the serial lane converts: after the prefill
    mx.eval([c.state for c in caches])
    sched.prompt_cache.put("", prefix, caches)


def _run(sched, requests: list[Request], rows: int, steps: int = 64) -> None:
    """Add ``requests`` together, then step until ``rows`` rows decode (0: until idle)."""
    for request in requests:
        sched.add(request, lambda event: None)
    for _ in range(steps):
        if (sched.is_idle if rows == 0 else sched.num_rows >= rows and not sched.num_prefilling):
            return
        sched.step()
