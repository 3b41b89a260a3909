"""From the asyncio side to the engine thread and back.

The engine calls ``emit`` on its own thread. Events go into one
thread-safe deque per event loop, and at most one ``call_soon_threadsafe``
wake-up is outstanding at a time: a decode step that emits a token for 64
rows costs one loop wake-up, not 64 (each wake-up is a syscall and a GIL
hand-off the engine thread pays for). The loop then fans the events out to
each request's asyncio.Queue. Leaving the generator early (client gone,
error) cancels the request; the engine drops it at its next step.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

from mlxq.engine.engine import Engine
from mlxq.engine.types import FinishReason, Request, TokenEvent


class EventDispatcher:
    """Engine thread -> event loop, batched per wake-up."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._pending: collections.deque[tuple[asyncio.Queue, TokenEvent]] = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, event: TokenEvent) -> None:
        """Any thread. Raises RuntimeError when the loop is closed."""
        self._pending.append((queue, event))
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            self._scheduled = False
        while self._pending:
            queue, event = self._pending.popleft()
            queue.put_nowait(event)


# One dispatcher per event loop, forgotten with the loop (tests start and stop many).
_dispatchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EventDispatcher] = weakref.WeakKeyDictionary()


def dispatcher_for(loop: asyncio.AbstractEventLoop) -> EventDispatcher:
    if loop not in _dispatchers:
        _dispatchers[loop] = EventDispatcher(loop)
    return _dispatchers[loop]


class OpenStreams:
    """Every request whose events a client is still reading, so a shutdown can end them properly.

    At the shutdown deadline (or a second Ctrl-C) each gets an error event as its last
    event: the route renders it in its protocol's shape (an SSE error, then the stream's
    end) and returns, so the connection closes cleanly instead of being cut."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Request]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue, request: Request) -> None:
        with self._lock:
            self._open[request.request_id] = (loop, events, request)

    def remove(self, request: Request) -> None:
        with self._lock:
            self._open.pop(request.request_id, None)

    def __len__(self) -> int:
        return len(self._open)

    def end_all(self, message: str) -> int:
        """Any thread: end every open stream with an error event, then cancel its engine request."""
        with self._lock:
            streams = list(self._open.values())
        for loop, events, request in streams:
            final = TokenEvent(request.request_id, finish_reason=FinishReason.ERROR, error=message)
            try:
                loop.call_soon_threadsafe(events.put_nowait, final)
            except RuntimeError:  # the loop is closed: nobody is reading
                pass
            request.cancel()  # its engine-side CANCELLED event arrives after the error, unread
        return len(streams)


open_streams = OpenStreams()


async def stream_events(
    engine: Engine, request: Request, is_disconnected: Callable[[], Awaitable[bool]] | None = None
) -> AsyncIterator[TokenEvent]:
    async for batch in stream_event_batches(engine, request, is_disconnected):
        for event in batch:
            yield event


async def stream_event_batches(
    engine: Engine, request: Request, is_disconnected: Callable[[], Awaitable[bool]] | None = None
) -> AsyncIterator[list[TokenEvent]]:
    """The request's events (submitted when this is first iterated), as lists of every event that arrived
    since the last one was taken; leaving early cancels the request."""
    stream = EventStream(engine, request)
    try:
        async for batch in stream.batches(is_disconnected):
            yield batch
    finally:
        stream.close()


class EventStream:
    """One engine request, submitted when this is made; its events read with ``batches``, and ``close``
    cancels it (a no-op once it finished).

    A streamed route submits as soon as it has parsed, before its response starts (the headers'
    write, the response's tasks), and its response closes the stream however it ends, even before
    its first chunk.
    """

    def __init__(self, engine: Engine, request: Request):
        loop = asyncio.get_running_loop()
        dispatcher = dispatcher_for(loop)
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def emit(event: TokenEvent) -> None:
            try:
                dispatcher.post(events, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                request.cancel()

        self.request = request
        self._events = events
        engine.submit(request, emit)
        open_streams.add(loop, events, request)

    async def batches(
        self, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[list[TokenEvent]]:
        """The events, as lists of every event that arrived since the last one was taken.

        When the event loop keeps up, each list holds one token; when it falls behind
        (many streams, a busy loop), a stream's backlog comes as one list, so the SSE
        writer can send it as one chunk instead of paying per-token overhead that
        would slow every stream further.
        """
        events = self._events
        while True:
            if is_disconnected is None:
                event = await events.get()
            else:
                event = await _get_or_poll(events, is_disconnected)
                if event is None:
                    return
            batch = [event]
            while event.finish_reason is None and not events.empty():
                event = events.get_nowait()
                batch.append(event)
            yield batch
            if event.finish_reason is not None:
                return

    def close(self) -> None:
        open_streams.remove(self.request)
        self.request.cancel()  # a no-op when it already finished


async def _get_or_poll(events: asyncio.Queue, is_disconnected) -> TokenEvent | None:
    """Next event, or None once the client has gone (for non-streamed replies)."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await is_disconnected():
                return None
