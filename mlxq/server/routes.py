"""HTTP routes: parse, submit, shape. Nothing here touches MLX."""

from __future__ import annotations

from importlib import resources

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from mlxq.engine.types import FinishReason
from mlxq.server.bridge import EventStream
from mlxq.server.errors import APIError
from mlxq.server.generation import admit, choice_batches, collect_all, mark_received, sse_response, submit
from mlxq.server.model_routing import model_cards
from mlxq.server.offload import parse_request
from mlxq.server.openai_format import ChoiceBuilder, merged_final, merged_usage_chunk, sse_line
from mlxq.server.protocol import parse_generation
from mlxq.server.state import ServerState


async def chat_completions(http: HTTPRequest):
    return await _generate(http, "chat")


async def completions(http: HTTPRequest):
    return await _generate(http, "completion")


async def _generate(http: HTTPRequest, kind):
    mark_received(http)
    state: ServerState = http.app.state.mlxq
    state.require_ready()
    spec = await parse_request(http, state.config.max_request_bytes, parse_generation, kind, state.loaded,
                               limits=state.config.token_limits, defaults=state.config.request_defaults)
    requests = admit(state, spec, "chatcmpl" if kind == "chat" else "cmpl", http)
    response_id = requests[0].request_id
    model = requests[0].adapter or state.model_name
    builders = [ChoiceBuilder(spec, state.loaded.tokenizer, response_id, model, index=i)
                for i in range(spec.n)]
    if spec.stream:
        streams = submit(state, requests)
        return sse_response(_sse(streams, builders), streams)
    await collect_all(state, http, requests, [b.acc for b in builders])
    return JSONResponse(merged_final(builders))


async def _sse(streams: list[EventStream], builders: list[ChoiceBuilder]):
    # The response cancels the engine request(s) when it ends (the client gone, an
    # error: generation.sse_response). Plain text tokens that
    # arrived together are sent as one chunk (one JSON encode, one write);
    # tokens with logprobs or tool calls keep a chunk each, aligned with their text.
    # With n choices, each chunk carries its choice's index.
    failed = False
    async for index, batch in choice_batches(streams):
        builder = builders[index]
        pending = ""
        for event in batch:
            if event.finish_reason is FinishReason.ERROR:
                if pending:
                    yield sse_line(builder.chunk(pending, [], None, None))
                    pending = ""
                err = APIError(500, event.error or "generation failed", code="engine_error")
                yield sse_line(err.body())
                failed = True
                break
            step = builder.add(event)
            finish = builder.finish_reason if step.finished else None
            if not (step.calls or step.logprob or finish):
                pending += step.text
                continue
            if step.logprob and pending:
                yield sse_line(builder.chunk(pending, [], None, None))
                pending = ""
            yield sse_line(builder.chunk(pending + step.text, step.calls, step.logprob, finish))
            pending = ""
        if pending:
            yield sse_line(builder.chunk(pending, [], None, None))
        if failed:
            break  # one choice failed: the others are cancelled as the merged streams close
    if builders[0].spec.include_usage and all(b.usage for b in builders):
        yield sse_line(merged_usage_chunk(builders))
    yield "data: [DONE]\n\n"


async def list_models(http: HTTPRequest):
    state: ServerState = http.app.state.mlxq
    return JSONResponse({"object": "list", "data": model_cards(state)})


async def get_model(http: HTTPRequest):
    state: ServerState = http.app.state.mlxq
    model_id = http.path_params["model_id"]
    cards = {card["id"]: card for card in model_cards(state)}
    if model_id not in cards:
        raise APIError(404, f"model {model_id!r} not found; this server serves {', '.join(map(repr, cards))}",
                       param="model", code="model_not_found")
    return JSONResponse(cards[model_id])


async def health(http: HTTPRequest):
    state: ServerState = http.app.state.mlxq
    healthy, reason = state.health()
    return JSONResponse({"status": "ok" if healthy else "unavailable", "reason": reason},
                        status_code=200 if healthy else 503)


async def ready(http: HTTPRequest):
    """Model loaded and admitting: what a load balancer should route on (/health says "alive")."""
    state: ServerState = http.app.state.mlxq
    ok = state.is_ready()
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


async def dashboard(http: HTTPRequest):
    """A static page that polls /stats (public: it holds no data; the key goes in #key=...)."""
    page = resources.files("mlxq.server").joinpath("static/dashboard.html").read_bytes()
    return Response(page, media_type="text/html; charset=utf-8")


async def metrics(http: HTTPRequest):
    state: ServerState = http.app.state.mlxq
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def stats(http: HTTPRequest):
    state: ServerState = http.app.state.mlxq
    return JSONResponse(state.stats())
