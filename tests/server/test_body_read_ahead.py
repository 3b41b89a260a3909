"""A request body is read off its socket ahead of its route, up to ``BODY_READ_AHEAD_BYTES``.

uvicorn stops reading a socket once 64 KiB of a request's body wait for
the route; the server's protocol (server/connections.py) keeps reading up
to its read-ahead bound, so an agent's ~90 KB chat is in memory when its
route starts, and a body over the bound still pauses the socket.
"""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.server import ServerState

from mlxq.server.connections import BODY_READ_AHEAD_BYTES, deadline_protocol


class _Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.paused = False
        self.pauses = 0

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5000)}.get(name, default)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False

    def write(self, data) -> None:
        pass

    def close(self) -> None:
        pass


async def _nothing(scope, receive, send) -> None:
    await asyncio.sleep(3600)


def _paused_after(body_bytes: int, sent_bytes: int) -> tuple[bool, int]:
    """(the socket paused, the body bytes the protocol holds) once ``sent_bytes`` of the body arrived,
    before the route ran."""

    async def feed() -> tuple[bool, int]:
        config = uvicorn.Config(app=_nothing, log_level="warning", lifespan="off")
        protocol = deadline_protocol(60.0)(config=config, server_state=ServerState(), app_state={})
        transport = _Transport()
        protocol.connection_made(transport)
        protocol.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n" % body_bytes)
        for at in range(0, sent_bytes, 32 * 1024):
            protocol.data_received(b"x" * min(32 * 1024, sent_bytes - at))
        held = len(protocol.cycle.body)
        for task in list(protocol.tasks):
            task.cancel()
        return transport.paused, held

    return asyncio.run(feed())


def test_a_body_under_the_read_ahead_bound_is_read_in_full_before_its_route_asks():
    size = 300 * 1024  # ~3x uvicorn's 64 KiB mark
    assert _paused_after(size, size - 1024) == (False, size - 1024)  # the socket is still read
    assert _paused_after(size, size)[1] == size


def test_a_body_over_the_bound_pauses_its_socket_until_the_route_reads_it():
    size = 2 * BODY_READ_AHEAD_BYTES
    paused, held = _paused_after(size, BODY_READ_AHEAD_BYTES + 64 * 1024)
    assert paused and BODY_READ_AHEAD_BYTES <= held < size
