"""``n`` choices of one request: n engine requests on the same prompt, merged into one response.

Each choice is a request of its own in the batch. They arrive together with
one prompt, so the scheduler prefills it once and the others take it from
the prompt cache (agents arriving together, engine/scheduler.py; prompts of
at least MIN_SHARED_PREFILL new tokens, shorter ones prefill in one forward).
A seeded request gives choice i the seed ``seed + i``: the choices differ, and each
equals a single request with that seed. Leaving early (client gone, an
error in one choice) cancels every choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

from mlxq.engine.engine import Engine
from mlxq.engine.types import FinishReason, Request, SamplingParams, TokenEvent
from mlxq.server.bridge import stream_events
from mlxq.server.errors import APIError


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: its own seed when the request has one."""
    return params if params.seed is None or index == 0 else replace(params, seed=params.seed + index)


async def collect(engine: Engine, requests: list[Request], builders: list,
                  is_disconnected: Callable[[], Awaitable[bool]]) -> None:
    """Non-streamed: every choice's events into its builder, concurrently. An engine error in any
    choice raises a 500 and cancels the others."""

    async def one(request: Request, builder) -> None:
        async for event in stream_events(engine, request, is_disconnected):
            builder.add(event)
            if event.finish_reason is FinishReason.ERROR:
                raise APIError(500, event.error or "generation failed", code="engine_error")

    tasks = [asyncio.ensure_future(one(r, b)) for r, b in zip(requests, builders, strict=True)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            error = task.exception()
            if error is not None:
                raise error
    finally:
        for task in tasks:
            task.cancel()  # a no-op for finished ones; the others' streams cancel their requests


async def merged(sources: list[AsyncIterator[list[TokenEvent]]]) -> AsyncIterator[tuple[int, list[TokenEvent]]]:
    """(choice index, batch of its events) from every choice's stream, in arrival order."""
    queue: asyncio.Queue[tuple[int, list[TokenEvent] | None]] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[list[TokenEvent]]) -> None:
        try:
            async for batch in source:
                queue.put_nowait((index, batch))
        finally:
            queue.put_nowait((index, None))  # this choice is over (finished, failed or cancelled)

    tasks = [asyncio.ensure_future(pump(i, source)) for i, source in enumerate(sources)]
    try:
        running = len(tasks)
        while running:
            index, batch = await queue.get()
            if batch is None:
                running -= 1
                continue
            yield index, batch
    finally:
        for task in tasks:
            task.cancel()
