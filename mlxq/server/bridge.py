"""From the asyncio side to the engine thread and back.

The engine calls ``emit`` on its own thread; ``emit`` hops onto the event
loop with ``call_soon_threadsafe``, so each request reads its events from an
ordinary asyncio.Queue. Leaving the generator early (client gone, error)
cancels the request; the engine drops it at its next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from mlxq.engine.engine import Engine
from mlxq.engine.types import Request, TokenEvent


async def stream_events(
    engine: Engine, request: Request, is_disconnected: Callable[[], Awaitable[bool]] | None = None
) -> AsyncIterator[TokenEvent]:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def emit(event: TokenEvent) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            request.cancel()

    engine.submit(request, emit)
    try:
        while True:
            if is_disconnected is None:
                event = await events.get()
            else:
                event = await _get_or_poll(events, is_disconnected)
                if event is None:
                    return
            yield event
            if event.finish_reason is not None:
                return
    finally:
        request.cancel()  # a no-op when it already finished


async def _get_or_poll(events: asyncio.Queue, is_disconnected) -> TokenEvent | None:
    """Next event, or None once the client has gone (for non-streamed replies)."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await is_disconnected():
                return None
