"""The gate: every row of a staggered batch equals its solo serial run, token for token (CPU, float32)."""

from __future__ import annotations

import pytest

from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.serial import run_serial
from mlxq.engine.types import Request, SamplingParams
from mlxq.golden.cases import LONG, SHORT
from mlxq.kv.projection import measure_footprint
from mlxq.kv.scheme import NATIVE

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
PROCESSORS = SamplingParams(temperature=0.7, top_k=40, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.4,
                            frequency_penalty=0.2, logit_bias={5: 2.0, 17: -5.0}, seed=3)


def solo_tokens(model, tokenizer, request: Request, step_size: int) -> list[int]:
    fresh = Request(request.request_id, request.prompt_ids, request.params, request.max_tokens, request.stop)
    return run_serial(model, tokenizer, fresh, lambda e: None, prefill_step_size=step_size).tokens


def run_schedule(model, tokenizer, arrivals, *, max_rows=8, prompt_concurrency=2, step_size=2048, scheme=NATIVE,
                 token0_in_decode=True):
    """arrivals: [(step, Request)]; returns {request_id: tokens} and the max rows seen together."""
    finished: dict[str, list[int]] = {}
    config = SchedulerConfig(max_rows, prompt_concurrency, step_size, None, token0_in_decode)
    scheduler = BatchScheduler(model, tokenizer, measure_footprint(model, step_size, scheme), config, scheme=scheme,
                               on_finish=lambda row: finished.__setitem__(row.request.request_id, row.output.tokens))
    queue = sorted(arrivals, key=lambda a: a[0])
    step, widest = 0, 0
    while queue or not scheduler.is_idle:
        while queue and queue[0][0] <= step and scheduler.can_admit(queue[0][1]):
            scheduler.add(queue.pop(0)[1], lambda e: None)
        scheduler.step()
        widest = max(widest, scheduler.num_rows)
        step += 1
        assert step < 10_000
    return finished, widest


def staggered(tokenizer) -> list[tuple[int, Request]]:
    short, long = tokenizer.encode(SHORT), tokenizer.encode(LONG)
    mid = tokenizer.encode("A journey of a thousand miles begins with a single step. " * 3)
    greedy = SamplingParams()
    return [
        (0, Request("a-long-greedy", long, greedy, 40)),
        (0, Request("b-short-greedy", short, greedy, 12)),
        (3, Request("c-seeded", mid, SEEDED, 30)),
        (5, Request("d-processors", long, PROCESSORS, 25)),
        (9, Request("e-short-late", short, greedy, 20)),
        (14, Request("f-one-token", mid, greedy, 1)),
        (20, Request("g-after-leaves", long[:50], SEEDED, 18)),
    ]


@pytest.mark.parametrize("token0_in_decode", [True, False], ids=["token0-in-decode", "token0-forward"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "qwen3_next"])
def test_staggered_join_leave_equals_solo(arch, token0_in_decode, load_tiny):
    model, tokenizer = load_tiny(arch)
    arrivals = staggered(tokenizer)
    batched, widest = run_schedule(model, tokenizer, arrivals, token0_in_decode=token0_in_decode)
    assert widest >= 3, "the schedule must actually batch rows"
    for _, request in arrivals:
        assert batched[request.request_id] == solo_tokens(model, tokenizer, request, 2048), request.request_id


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_next"])
def test_chunked_joiner_prefill_interleaved_with_decode(arch, load_tiny):
    # Step size 16: long prompts prefill over many iterations while others decode.
    model, tokenizer = load_tiny(arch)
    arrivals = staggered(tokenizer)
    batched, _ = run_schedule(model, tokenizer, arrivals, step_size=16, prompt_concurrency=3)
    for _, request in arrivals:
        assert batched[request.request_id] == solo_tokens(model, tokenizer, request, 16), request.request_id


def test_stop_strings_and_max_rows_cap(load_tiny):
    model, tokenizer = load_tiny("llama")
    prompt = tokenizer.encode(LONG)
    full = solo_tokens(model, tokenizer, Request("x", prompt, SamplingParams(), 30), 2048)
    text = tokenizer.decode(full)
    stop = text[10:14]
    arrivals = [(0, Request(f"r{i}", prompt, SamplingParams(), 30, stop=(stop,) if i % 2 else ()))
                for i in range(5)]
    batched, widest = run_schedule(model, tokenizer, arrivals, max_rows=3)
    assert widest == 3
    for _, request in arrivals:
        assert batched[request.request_id] == solo_tokens(model, tokenizer, request, 2048)
