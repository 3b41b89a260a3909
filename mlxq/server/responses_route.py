"""OpenAI Responses route: POST /v1/responses (plain and streamed), stateless."""

from __future__ import annotations

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from mlxq.engine.types import FinishReason, Request
from mlxq.server.accumulator import Accumulator
from mlxq.server.choices import collect
from mlxq.server.errors import APIError
from mlxq.server.generation import admit, event_batches, sse_response
from mlxq.server.json_body import read_json
from mlxq.server.offload import off_loop
from mlxq.server.responses_format import ResponseRenderer
from mlxq.server.responses_request import parse_responses
from mlxq.server.state import ServerState


async def create_response(http: HTTPRequest):
    state: ServerState = http.app.state.mlxq
    state.require_ready()
    body = await read_json(http, state.config.max_request_bytes)
    parsed = await off_loop(parse_responses, body, state.loaded, state.config.token_limits,
                            state.config.request_defaults)
    spec = parsed.spec
    [request] = admit(state, spec, "resp")
    acc = Accumulator(state.loaded.tokenizer, spec.tools)
    model = body["model"] if isinstance(body.get("model"), str) else state.model_name
    renderer = ResponseRenderer(acc, parsed, model)
    if spec.stream:
        return sse_response(_stream(state, request, renderer))
    await collect(state.engine, [request], [acc], http.is_disconnected)
    if not acc.is_complete:
        raise APIError(503, "the request was cancelled before it finished (server shutting down?)")
    return JSONResponse(renderer.final())


async def _stream(state: ServerState, request: Request, renderer: ResponseRenderer):
    yield renderer.start()
    async for batch in event_batches(state, request):
        for event in batch:
            if event.finish_reason is FinishReason.ERROR:
                yield renderer.error(APIError(500, event.error or "generation failed", code="engine_error"))
                return
            yield renderer.step(renderer.acc.add(event))
