"""Request work that can take seconds runs in a worker thread, not on the event loop.

Parsing a 15 MiB body, rendering a chat template over 100k messages and
tokenizing megabytes of text each froze every stream for seconds when they
ran inside the async handler. ``parse_request`` reads the body on the loop
(it arrives in chunks) and does everything else in Starlette's thread pool
(the loop keeps its turns at the interpreter's switch interval). After a
large body the worker also drops the body and hands freed heap pages back to
the OS (``malloc_trim``, which runs without the GIL), so one big request does
not leave gigabytes of resident memory behind.

A body under ``INLINE_PARSE_BYTES`` is parsed on the loop itself: an
agent's chat on a kept system head parses in well under a millisecond
(its system prompt's tokens are kept: server/head_split.py), while a hop
to a worker thread and back is two GIL hand-offs, each of which waits up
to the switch interval (5 ms) whenever another thread (the engine's,
planning a burst's admissions) runs Python. Its chat template renders on
the loop too (``parsing_inline``). What would take long on the loop (a
text of ``INLINE_TEXT_CHARS`` or more to tokenize, such as a system
prompt seen for the first time, a large JSON schema to compile, or a chat
of many turns to render) raises
``OffLoop`` where it is about to start (``leave_loop_if``), and the parse
starts over in a worker thread: so the size of a body alone does not send
a cached agent's chat off the loop.
"""

from __future__ import annotations

import contextvars
import ctypes
import ctypes.util
import functools
import os

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest

from mlxq.server.json_body import LARGE_REQUEST_BYTES, parse_json_body, read_body

# Bodies under this many bytes are parsed on the event loop (until work too long for it starts: OffLoop).
# MLXQ_PARSE_INLINE_BYTES=0 sends every body to the thread pool (an A/B lever).
INLINE_PARSE_BYTES = int(os.environ.get("MLXQ_PARSE_INLINE_BYTES", LARGE_REQUEST_BYTES))
# A parse on the loop tokenizes (or compiles into a grammar) texts shorter than this there; a longer one sends
# the parse to a worker thread.
INLINE_TEXT_CHARS = 64 * 1024
# True while a small body is parsed on the loop: its chat template renders there too (server/prompts.py).
parsing_inline: contextvars.ContextVar[bool] = contextvars.ContextVar("parsing_inline", default=False)


class OffLoop(Exception):
    """Raised in a parse on the event loop where work too long for the loop would start: the parse
    starts over in a worker thread (``off_loop_unless_small``)."""


def leave_loop_if(too_long: bool) -> None:
    """Raise ``OffLoop`` when ``too_long`` and the caller is parsing on the event loop. Call it before
    the work starts, and before anything is kept for other requests (the parse runs again)."""
    if too_long and parsing_inline.get():
        raise OffLoop


async def parse_request(http: HTTPRequest, limit: int, parse, *args, **kwargs):
    """``parse(body_json, *args, **kwargs)`` in a worker thread, the body read here (413 over ``limit``)."""
    raw = [await read_body(http, limit)]  # a list the worker empties: the bytes die with the parse
    return await off_loop_unless_small(len(raw[0]), _parse_and_release, raw,
                                       lambda body: parse(body, *args, **kwargs))


async def off_loop(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a worker thread (for routes that keep the parsed body)."""
    return await run_in_threadpool(fn, *args, **kwargs)


async def off_loop_unless_small(num_bytes: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` for a request of ``num_bytes``: on the loop when small, else in a worker thread;
    and there too when it raised ``OffLoop`` on the loop (``fn`` runs again from the start)."""
    if num_bytes < INLINE_PARSE_BYTES:
        token = parsing_inline.set(True)
        try:
            return fn(*args, **kwargs)
        except OffLoop:
            pass
        finally:
            parsing_inline.reset(token)
    return await run_in_threadpool(fn, *args, **kwargs)


def _parse_and_release(raw: list, parse):
    large = len(raw[0]) >= LARGE_REQUEST_BYTES
    try:
        return _parse(raw, parse)
    finally:
        if large:
            release_memory()


def _parse(raw: list, parse):
    # On the loop the bytes stay: a parse that leaves the loop (OffLoop) starts over from them.
    body = parse_json_body(raw[0] if parsing_inline.get() else raw.pop())
    return parse(body)  # ``body`` is garbage once this returns; only the parse result stays


def release_memory() -> None:
    """Hand freed heap pages back to the OS. No ``gc.collect()``: a request's garbage is acyclic (reference
    counting has freed it already), and a full collection holds the GIL for the whole heap's walk."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (returns freed heap pages to the OS), or None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None
