"""Operator endpoints: ``POST /admin/cache/flush``, the durability barrier of the SSD tier."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from mlxq.server.errors import APIError
from mlxq.server.state import ServerState

DEFAULT_FLUSH_TIMEOUT_S = 300.0


async def flush_cache(http: HTTPRequest):
    """200 ``{"durable": true, ...}`` once every dirty prompt-cache entry is on disk; else 503 with counts.

    ``?timeout=SECONDS`` bounds the wait (default 300). Requests keep being served while it runs.
    """
    state: ServerState = http.app.state.mlxq
    state.require_ready()
    raw = http.query_params.get("timeout")
    try:
        timeout = DEFAULT_FLUSH_TIMEOUT_S if raw is None else float(raw)
        if not 0 <= timeout <= 86400:
            raise ValueError
    except ValueError:
        raise APIError(400, f"timeout must be a number of seconds between 0 and 86400, got {raw!r}",
                       param="timeout") from None
    if state.engine.cold is None:
        raise APIError(409, f"there is no SSD cache to flush: {state.engine.cold_off_reason}",
                       code="ssd_cache_off")
    result = await run_in_threadpool(state.engine.flush_cache, timeout)
    return JSONResponse(result.as_dict(), status_code=200 if result.durable else 503)
