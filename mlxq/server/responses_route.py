"""OpenAI Responses route: POST /v1/responses (plain and streamed), stateless."""

from __future__ import annotations

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from mlxq.server.accumulator import Accumulator
from mlxq.server.generation import admit, collect_all, read_and_parse, sse_response, stream_one, submit
from mlxq.server.responses_format import ResponseRenderer
from mlxq.server.responses_request import parse_responses


async def create_response(http: HTTPRequest):
    state, body, parsed = await read_and_parse(http, parse_responses)
    spec = parsed.spec
    [request] = admit(state, spec, "resp", http)
    acc = Accumulator(state.loaded.tokenizer, spec.tools)
    model = body["model"] if isinstance(body.get("model"), str) else state.model_name
    renderer = ResponseRenderer(acc, parsed, model)
    if spec.stream:
        streams = submit(state, [request])
        return sse_response(stream_one(streams[0], renderer), streams)
    await collect_all(state, http, [request], [acc])
    return JSONResponse(renderer.final())
