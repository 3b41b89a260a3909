"""Anthropic Messages routes: POST /v1/messages (plain and streamed) and /v1/messages/count_tokens."""

from __future__ import annotations

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from mlxq.server.accumulator import Accumulator
from mlxq.server.anthropic_format import MessageStream, message_json, new_message_id
from mlxq.server.anthropic_request import parse_count_tokens, parse_messages
from mlxq.server.generation import admit, collect_all, read_and_parse, sse_response, stream_one, submit
from mlxq.server.json_body import read_json
from mlxq.server.offload import off_loop
from mlxq.server.state import ServerState


async def create_message(http: HTTPRequest):
    state, body, spec = await read_and_parse(http, parse_messages)
    [request] = admit(state, spec, "msg", http)
    acc = Accumulator(state.loaded.tokenizer, spec.tools)
    message_id = new_message_id()
    model = spec.model if isinstance(body.get("model"), str) else state.model_name
    if spec.stream:
        streams = submit(state, [request])
        return sse_response(stream_one(streams[0], MessageStream(acc, message_id, model, len(spec.prompt_ids))),
                            streams)
    await collect_all(state, http, [request], [acc])
    return JSONResponse(message_json(acc, message_id, model, len(spec.prompt_ids)))


async def count_tokens(http: HTTPRequest):
    state: ServerState = http.app.state.mlxq
    state.require_ready()
    body = await read_json(http, state.config.max_request_bytes)
    count = await off_loop(parse_count_tokens, body, state.loaded, state.config.request_defaults)
    return JSONResponse({"input_tokens": count})
