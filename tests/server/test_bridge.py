"""Engine -> event loop: a stream that falls behind gets its backlog as one batch, nothing lost."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.requests import ClientDisconnect

from mlxq.engine.types import Request, SamplingParams
from mlxq.server.bridge import EventStream, open_streams, stream_event_batches
from mlxq.server.generation import event_batches, sse_response
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


def test_a_response_that_never_starts_cancels_its_submitted_request(tiny_model_dirs):
    # Streamed routes submit before their response starts; a client gone before the headers are
    # written (the write fails, the body generator never runs) must still cancel the request.
    engine = start_engine(tiny_model_dirs["llama"])
    request = Request("gone", [5, 6, 7, 8], SamplingParams(), 4000, ignore_eos=True)

    async def never_read(stream: EventStream):
        async for batch in event_batches(stream):
            yield f"{len(batch)}\n"

    async def send(message):
        raise OSError("the client is gone")

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def respond() -> None:
        streams = [EventStream(engine, request)]
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        await sse_response(never_read(streams[0]), streams)(scope, receive, send)

    try:
        with pytest.raises(ClientDisconnect):
            asyncio.run(respond())
        assert request.cancelled.is_set() and len(open_streams) == 0
        deadline = time.monotonic() + 20
        while (engine.num_running or engine.stats.requests_cancelled < 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.num_running == 0 and engine.stats.requests_cancelled == 1
    finally:
        engine.stop(timeout=10)
