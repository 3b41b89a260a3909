"""The Starlette application: routes, CORS, API-key auth, one error handler."""

from __future__ import annotations

import contextlib
import hmac

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from mlxq.server import routes
from mlxq.server.errors import (
    APIError,
    error_response,
    handle_api_error,
    handle_http_exception,
    handle_unexpected,
)
from mlxq.server.state import ServerState

# Reachable without the API key: load balancers probe them.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/dashboard"})


class ApiKeyAuth:
    """Pure ASGI middleware (streams pass through untouched): Bearer key on every path but /health."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if (
            self.expected is None
            or scope["type"] != "http"
            or scope["method"] == "OPTIONS"  # CORS preflight carries no credentials
            or scope["path"] in PUBLIC_PATHS
        ):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
            return await error_response(err)(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(state: ServerState, *, manage_engine: bool = True) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            state.engine.start()
        try:
            yield
        finally:
            if manage_engine:
                state.engine.stop(timeout=10)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/completions", routes.completions, methods=["POST"]),
            Route("/v1/models", routes.list_models, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/ready", routes.ready, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/dashboard", routes.dashboard, methods=["GET"]),
            Route("/stats", routes.stats, methods=["GET"]),
        ],
        middleware=[
            Middleware(CORSMiddleware, allow_origins=list(state.config.allowed_origins),
                       allow_methods=["*"], allow_headers=["*"]),
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
