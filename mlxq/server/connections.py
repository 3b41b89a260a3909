"""Connections: a cap on how many, and a deadline for sending a whole request.

uvicorn closes idle keep-alive connections but gives a client unlimited
time to send its headers and body, so a few thousand half-sent requests
hold as many sockets forever. ``deadline_protocol`` is uvicorn's h11
protocol with one timer per request: from the connection's first byte (or
the end of the previous response) until the request's last body byte has
arrived; a client that has not finished by then is disconnected. It also
stamps each request's scope with the time the event loop read its headers
(``READ_AT``): the request log's ``read_monotonic_s``, the start of the
server's part of a request's way in. And it reads a request's body off its
socket ahead of the route, up to ``BODY_READ_AHEAD_BYTES``: uvicorn stops
reading once 64 KiB of a body wait for the route to take them, so the
route of an agent's ~90 KB chat (a 14.5k-word system prompt) asked for the
rest and waited a turn of the event loop for it, in a burst a turn behind
every other request's work on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxq.engine.burst_hold import OnTheWay

log = logging.getLogger("mlxq.server")

FD_HEADROOM = 256  # descriptors kept for model files, the SSD tier, logs
READ_AT = "mlxq.read_at"  # the scope key: when the event loop read the request's headers (time.monotonic)
BODY_READ_AHEAD_BYTES = 1 << 20  # a body is read off its socket up to this many bytes before its route asks


def deadline_protocol(read_timeout_s: float, on_the_way: OnTheWay | None = None) -> type[H11Protocol]:
    """``on_the_way``: where each POST read off its socket is counted until its route settles it (a
    burst's rest is on its way to the engine: engine/burst_hold.py)."""

    class DeadlineH11Protocol(H11Protocol):
        """h11, where a request must arrive in full within ``read_timeout_s``."""

        _read_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_read_deadline()

        def data_received(self, data: bytes) -> None:
            read_at = time.monotonic()
            super().data_received(data)
            if self.scope is not None:  # a request's headers are in: its route task runs later, on the loop
                self.scope.setdefault(READ_AT, read_at)
            if self.conn.their_state is not h11.SEND_BODY and self.conn.their_state is not h11.IDLE:
                self._disarm_read_deadline()  # the whole request is in (or the connection is ending)
                if on_the_way is not None and self.scope is not None and _generates(self.scope):
                    on_the_way.read(self.scope, read_at)  # on its way to the engine until its route settles it
            else:
                self._read_ahead()

        def _read_ahead(self) -> None:
            """Keep reading a body uvicorn paused at its 64 KiB mark, up to ``BODY_READ_AHEAD_BYTES``."""
            cycle = getattr(self, "cycle", None)
            flow = getattr(self, "flow", None)
            if (flow is not None and flow.read_paused and cycle is not None and not cycle.response_complete
                    and self.conn.their_state is h11.SEND_BODY and len(cycle.body) < BODY_READ_AHEAD_BYTES):
                flow.resume_reading()

        def on_response_complete(self) -> None:
            self._settle()
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_read_deadline()  # the next request on this connection gets its own deadline

        def connection_lost(self, exc) -> None:
            self._disarm_read_deadline()
            self._settle()
            super().connection_lost(exc)

        def _settle(self) -> None:
            if on_the_way is not None and self.scope is not None:
                on_the_way.settled(self.scope)  # a no-op once its route settled it

        def _arm_read_deadline(self) -> None:
            self._disarm_read_deadline()
            self._read_deadline = self.loop.call_later(read_timeout_s, self._read_too_slow)

        def _disarm_read_deadline(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _read_too_slow(self) -> None:
            self._read_deadline = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                self.transport.close()  # connection_lost tells a handler still reading the body

    return DeadlineH11Protocol


def _generates(scope: dict) -> bool:
    """A request that may become an engine request (not an admin call, nor counting tokens)."""
    path = scope["path"]
    return scope["method"] == "POST" and not path.startswith("/admin/") and not path.endswith("/count_tokens")


def connection_cap(requested: int, fd_soft_limit: int) -> int:
    """``requested`` connections, or fewer when the process may not open that many descriptors."""
    usable = max(64, fd_soft_limit - FD_HEADROOM)
    if requested > usable:
        log.warning("--max-connections %d lowered to %d: the open-file limit is %d", requested, usable,
                    fd_soft_limit)
        return usable
    return requested
