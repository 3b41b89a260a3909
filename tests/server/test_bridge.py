"""Engine -> event loop: a stream that falls behind gets its backlog as one batch, nothing lost."""

from __future__ import annotations

import asyncio
import time

from mlxq.engine.types import Request, SamplingParams
from mlxq.server.bridge import stream_event_batches
from tests.engine.test_engine_thread import run, start_engine


def test_a_busy_loop_gets_the_backlog_in_one_batch(tiny_model_dirs):
    engine = start_engine(tiny_model_dirs["llama"])
    prompt = [5, 6, 7, 8, 9, 10]
    expected = [e.token_id for e in run(engine, Request("ref", prompt, SamplingParams(), 24, ignore_eos=True))
                if e.token_id is not None]

    async def consume() -> list[list]:
        batches = []
        stream = stream_event_batches(engine, Request("late", prompt, SamplingParams(), 24, ignore_eos=True))
        first = await stream.__anext__()  # submitted; now the loop is busy elsewhere
        batches.append(first)
        time.sleep(1.0)  # a blocked loop: the engine keeps generating meanwhile
        async for batch in stream:
            batches.append(batch)
        return batches

    try:
        batches = asyncio.run(consume())
    finally:
        engine.stop(timeout=10)
    tokens = [e.token_id for batch in batches for e in batch if e.token_id is not None]
    assert tokens == expected
    assert max(len(b) for b in batches) > 5  # the backlog came together
    assert batches[-1][-1].finish_reason is not None
