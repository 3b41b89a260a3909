"""HTTP routes: parse, submit, shape. Nothing here touches MLX."""

from __future__ import annotations

import json
import os
import uuid
from importlib import resources

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlxq.engine.admission import AdmissionError
from mlxq.engine.types import FinishReason, Request
from mlxq.server.bridge import stream_event_batches, stream_events
from mlxq.server.choices import choice_params, collect, merged
from mlxq.server.errors import APIError
from mlxq.server.offload import parse_request
from mlxq.server.openai_format import ChoiceBuilder, merged_final, merged_usage_chunk
from mlxq.server.protocol import GenerationSpec, parse_generation
from mlxq.server.state import ServerState


def _check_limits(spec: GenerationSpec, config) -> None:
    """Server-wide caps (--max-tokens-limit, --max-prompt-tokens), beyond the model's context."""
    if config.max_prompt_tokens is not None and len(spec.prompt_ids) > config.max_prompt_tokens:
        raise APIError(400, f"the prompt is {len(spec.prompt_ids)} tokens; this server accepts at most "
                            f"{config.max_prompt_tokens} (--max-prompt-tokens)", param="messages",
                       code="prompt_too_long")
    if config.max_tokens_limit is not None and spec.max_tokens > config.max_tokens_limit:
        raise APIError(400, f"max_tokens {spec.max_tokens} is above this server's limit of "
                            f"{config.max_tokens_limit} (--max-tokens-limit)", param="max_tokens",
                       code="max_tokens_too_large")


def _new_request(spec: GenerationSpec, prefix: str, index: int = 0) -> Request:
    return Request(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_ids=spec.prompt_ids,
        params=choice_params(spec.params, index),
        max_tokens=spec.max_tokens,
        stop=spec.stop,
        logprobs=spec.logprobs,
        top_logprobs=spec.top_logprobs,
        ignore_eos=spec.ignore_eos,
        deterministic=spec.deterministic,
        snapshot_at=spec.snapshot_at,
    )


async def chat_completions(http: HTTPRequest):
    return await _generate(http, "chat")


async def completions(http: HTTPRequest):
    return await _generate(http, "completion")


async def _generate(http: HTTPRequest, kind):
    state: ServerState = http.app.state.mlxq
    state.require_ready()
    spec = await parse_request(http, state.config.max_request_bytes, parse_generation, kind, state.loaded,
                               default_max_tokens=state.config.max_tokens_limit)
    _check_limits(spec, state.config)
    try:
        state.engine.check_admissible(len(spec.prompt_ids), spec.max_tokens)
    except AdmissionError as exc:
        raise APIError(400, str(exc), param="max_tokens", code="kv_budget_exceeded") from None
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    requests = [_new_request(spec, prefix, i) for i in range(spec.n)]
    response_id = requests[0].request_id
    builders = [ChoiceBuilder(spec, state.loaded.tokenizer, response_id, state.model_name, index=i)
                for i in range(spec.n)]
    if spec.stream:
        return StreamingResponse(_sse(state, requests, builders), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await collect(state.engine, requests, builders, http.is_disconnected)
    if any(b.finish_reason is None or b.finish_reason == FinishReason.CANCELLED.value for b in builders):
        raise APIError(503, "the request was cancelled before it finished (server shutting down?)")
    return JSONResponse(merged_final(builders))


def _sse_line(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# MLXQ_SSE_COALESCE=0 sends one chunk per token even when a stream is behind (an A/B lever).
_COALESCE = os.environ.get("MLXQ_SSE_COALESCE", "1") != "0"


async def _batches(state: ServerState, request: Request):
    if _COALESCE:
        async for batch in stream_event_batches(state.engine, request):
            yield batch
    else:
        async for event in stream_events(state.engine, request):
            yield [event]


async def _choice_batches(state: ServerState, requests: list[Request]):
    """(choice index, events) of one request's n choices (one: its own stream, no merging)."""
    if len(requests) == 1:
        async for batch in _batches(state, requests[0]):
            yield 0, batch
    else:
        async for item in merged([_batches(state, r) for r in requests]):
            yield item


async def _sse(state: ServerState, requests: list[Request], builders: list[ChoiceBuilder]):
    # Starlette cancels this generator when the client disconnects; leaving
    # stream_event_batches cancels the engine request(s). Plain text tokens that
    # arrived together are sent as one chunk (one JSON encode, one write);
    # tokens with logprobs or tool calls keep a chunk each, aligned with their text.
    # With n choices, each chunk carries its choice's index.
    failed = False
    async for index, batch in _choice_batches(state, requests):
        builder = builders[index]
        pending = ""
        for event in batch:
            if event.finish_reason is FinishReason.ERROR:
                if pending:
                    yield _sse_line(builder.chunk(pending, [], None, None))
                    pending = ""
                err = APIError(500, event.error or "generation failed", code="engine_error")
                yield _sse_line(err.body())
                failed = True
                break
            text, calls, entry = builder.add(event)
            finish = builder.finish_reason if event.finish_reason is not None else None
            if not (calls or entry or finish):
                pending += text
                continue
            if entry and pending:
                yield _sse_line(builder.chunk(pending, [], None, None))
                pending = ""
            yield _sse_line(builder.chunk(pending + text, calls, entry, finish))
            pending = ""
        if pending:
            yield _sse_line(builder.chunk(pending, [], None, None))
        if failed:
            break  # one choice failed: the others are cancelled as the merged streams close
    if builders[0].spec.include_usage and all(b.usage for b in builders):
        yield _sse_line(merged_usage_chunk(builders))
    yield "data: [DONE]\n\n"


async def list_models(http: HTTPRequest):
    state: ServerState = http.app.state.mlxq
    created = int(state.started_at_wall)
    data = [{"id": state.model_name, "object": "model", "created": created, "owned_by": "mlxq",
             "description": state.loaded.description if state.loaded else None}]
    return JSONResponse({"object": "list", "data": data})


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
