"""The Starlette application: routes, CORS, API-key auth, one error handler."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from mlxq.server import admin, admin_adapters, messages_route, responses_route, routes
from mlxq.server.errors import (
    APIError,
    error_response,
    handle_api_error,
    handle_http_exception,
    handle_unexpected,
)
from mlxq.server.guard import LOOPBACK_ORIGIN_REGEX, Guard, GuardPolicy
from mlxq.server.state import ServerState

log = logging.getLogger("mlxq.server")

# Reachable without the API key: load balancers probe them.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/dashboard"})

# At shutdown the engine gets this long (at least) to drop the requests the shutdown cancelled, one step.
QUIET_WAIT_S = 10.0
QUIET_POLL_S = 0.01


class ApiKeyAuth:
    """Pure ASGI middleware (streams pass through untouched): the key on every path but the public ones,
    as ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (Anthropic's)."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.expected_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if (
            self.expected is None
            or scope["type"] != "http"
            or scope["method"] == "OPTIONS"  # CORS preflight carries no credentials
            or scope["path"] in PUBLIC_PATHS
        ):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
        key_ok = hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected_key)
        if not (bearer_ok or key_ok):
            err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           code="invalid_api_key")
            return await error_response(err, scope["path"])(scope, receive, send)
        return await self.app(scope, receive, send)


async def _until_quiet(engine, timeout: float) -> None:
    """Until the engine runs and holds no request (bounded): the ones the shutdown ended are cancelled and
    dropped at its next step, a checkpointed one queueing its last generation checkpoint first."""
    deadline = time.monotonic() + timeout
    while engine.is_alive and (engine.num_running or engine.num_waiting) and time.monotonic() < deadline:
        await asyncio.sleep(QUIET_POLL_S)


async def _flush_before_exit(state: ServerState) -> None:
    """Graceful shutdown: in-flight requests have finished or been cancelled; make the SSD tier durable
    (bounded), the cancelled requests' last checkpoints included."""
    engine = state.engine
    if engine.cold is None or not engine.is_alive:
        return
    await _until_quiet(engine, max(state.config.shutdown_timeout_s, QUIET_WAIT_S))
    result = await run_in_threadpool(engine.flush_cache, state.config.shutdown_timeout_s)
    if result.durable:
        log.info("SSD cache durable at shutdown: %d entries, longest prefix %d tokens%s",
                 result.entries, result.longest_durable_prefix_tokens,
                 f", {result.checkpoints['requests']} generation checkpoints" if result.checkpoints else "")
    else:
        log.warning("SSD cache NOT durable at shutdown: %s", result.as_dict())


def build_app(state: ServerState, *, manage_engine: bool = True) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            state.engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await _flush_before_exit(state)
                state.engine.stop(timeout=10)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/completions", routes.completions, methods=["POST"]),
            Route("/v1/messages", messages_route.create_message, methods=["POST"]),
            Route("/v1/messages/count_tokens", messages_route.count_tokens, methods=["POST"]),
            Route("/v1/responses", responses_route.create_response, methods=["POST"]),
            Route("/responses", responses_route.create_response, methods=["POST"]),
            Route("/v1/models", routes.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", routes.get_model, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/ready", routes.ready, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/dashboard", routes.dashboard, methods=["GET"]),
            Route("/stats", routes.stats, methods=["GET"]),
            Route("/admin/cache/flush", admin.flush_cache, methods=["POST"]),
            Route("/admin/adapters", admin_adapters.load_adapter, methods=["POST"]),
            Route("/admin/adapters/{name:path}", admin_adapters.unload_adapter, methods=["DELETE"]),
        ],
        middleware=[
            Middleware(Guard, policy=GuardPolicy.of(state.config)),
            Middleware(CORSMiddleware, allow_origins=list(state.config.allowed_origins),
                       allow_origin_regex=LOOPBACK_ORIGIN_REGEX, allow_methods=["*"], allow_headers=["*"]),
            Middleware(ApiKeyAuth, api_key=state.config.api_key),
        ],
        exception_handlers={
            APIError: handle_api_error,
            HTTPException: handle_http_exception,
            Exception: handle_unexpected,
        },
        lifespan=lifespan,
    )
    app.state.mlxq = state
    return app
