"""Anthropic Messages routes: POST /v1/messages (plain and streamed) and /v1/messages/count_tokens."""

from __future__ import annotations

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from mlxq.engine.types import FinishReason, Request
from mlxq.server.accumulator import Accumulator
from mlxq.server.anthropic_format import MessageStream, message_json, new_message_id
from mlxq.server.anthropic_request import parse_count_tokens, parse_messages
from mlxq.server.choices import collect
from mlxq.server.errors import APIError
from mlxq.server.generation import admit, event_batches, sse_response
from mlxq.server.json_body import read_json
from mlxq.server.offload import off_loop
from mlxq.server.state import ServerState


async def create_message(http: HTTPRequest):
    state: ServerState = http.app.state.mlxq
    state.require_ready()
    body = await read_json(http, state.config.max_request_bytes)
    spec = await off_loop(parse_messages, body, state.loaded, state.config.token_limits,
                          state.config.request_defaults)
    [request] = admit(state, spec, "msg")
    acc = Accumulator(state.loaded.tokenizer, spec.tools)
    message_id = new_message_id()
    model = spec.model if isinstance(body.get("model"), str) else state.model_name
    if spec.stream:
        return sse_response(_stream(state, request, MessageStream(acc, message_id, model, len(spec.prompt_ids))))
    await collect(state.engine, [request], [acc], http.is_disconnected)
    if not acc.is_complete:
        raise APIError(503, "the request was cancelled before it finished (server shutting down?)")
    return JSONResponse(message_json(acc, message_id, model, len(spec.prompt_ids)))


async def _stream(state: ServerState, request: Request, stream: MessageStream):
    yield stream.start()
    async for batch in event_batches(state, request):
        for event in batch:
            if event.finish_reason is FinishReason.ERROR:
                yield stream.error(APIError(500, event.error or "generation failed"))
                return
            yield stream.step(stream.acc.add(event))


async def count_tokens(http: HTTPRequest):
    state: ServerState = http.app.state.mlxq
    state.require_ready()
    body = await read_json(http, state.config.max_request_bytes)
    count = await off_loop(parse_count_tokens, body, state.loaded, state.config.request_defaults)
    return JSONResponse({"input_tokens": count})
