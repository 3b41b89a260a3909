"""What every generating route shares: read the body, check limits, submit, gather the events.

A route parses its protocol's body into a GenerationSpec, then uses these to
run it; the renderer it picks decides what the client sees.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import replace

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from mlxq.engine.admission import AdmissionError, max_tokens_within
from mlxq.engine.types import FinishReason, Request
from mlxq.models.adapters import AdapterInfo
from mlxq.server.bridge import EventStream
from mlxq.server.choices import choice_params, collect, merged
from mlxq.server.connections import READ_AT
from mlxq.server.errors import APIError
from mlxq.server.json_body import parse_json_body, read_body
from mlxq.server.model_routing import resolve_model
from mlxq.server.offload import off_loop_unless_small
from mlxq.server.protocol import GenerationSpec
from mlxq.server.state import ServerState

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_RECEIVED = "mlxq.received_at"  # the scope key: when the route began reading the request (time.monotonic)


def mark_received(http: HTTPRequest) -> None:
    """Stamp the request's arrival: its engine request logs ``parse_ms`` from here to its submission."""
    http.scope.setdefault(_RECEIVED, time.monotonic())


async def read_and_parse(http: HTTPRequest, parse) -> tuple[ServerState, dict, object]:
    """(state, the JSON body, ``parse(body, model, token limits, defaults)`` run off the event loop)."""
    mark_received(http)
    state: ServerState = http.app.state.mlxq
    state.require_ready()
    raw = await read_body(http, state.config.max_request_bytes)

    def body_and_parse() -> tuple[dict, object]:
        body = parse_json_body(raw)
        return body, parse(body, state.loaded, state.config.token_limits, state.config.request_defaults)

    return state, *await off_loop_unless_small(len(raw), body_and_parse)


def check_limits(spec: GenerationSpec, config) -> None:
    """Server-wide caps (--max-tokens-limit, --max-prompt-tokens), beyond the model's context."""
    if config.max_prompt_tokens is not None and len(spec.prompt_ids) > config.max_prompt_tokens:
        raise APIError(400, f"the prompt is {len(spec.prompt_ids)} tokens; this server accepts at most "
                            f"{config.max_prompt_tokens} (--max-prompt-tokens)", param="messages",
                       code="prompt_too_long")
    if config.max_tokens_limit is not None and spec.max_tokens > config.max_tokens_limit:
        raise APIError(400, f"max_tokens {spec.max_tokens} is above this server's limit of "
                            f"{config.max_tokens_limit} (--max-tokens-limit)", param="max_tokens",
                       code="max_tokens_too_large")


def admit(state: ServerState, spec: GenerationSpec, prefix: str, http: HTTPRequest | None = None) -> list[Request]:
    """The spec's engine requests (one per choice), once the server's limits and KV budget allow it.
    Under --max-tokens-policy clamp, a max_tokens the KV budget cannot hold is lowered to what it can.
    ``http``: the request they came in (its arrival, ``mark_received``, times their parse)."""
    check_limits(spec, state.config)
    adapter = resolve_model(state, spec.model)
    try:
        state.engine.check_admissible(len(spec.prompt_ids), spec.max_tokens)
    except AdmissionError as exc:
        fits = _kv_room(state, len(spec.prompt_ids)) if state.config.max_tokens_policy == "clamp" else 0
        if fits < 1:
            raise APIError(400, str(exc), param="max_tokens", code="kv_budget_exceeded") from None
        spec = replace(spec, max_tokens=fits)
    received = None if http is None else (http.scope.get(_RECEIVED), http.scope.get(READ_AT))
    requests = [_new_request(spec, prefix, adapter, received, i) for i in range(spec.n)]
    if http is not None:
        state.engine.on_the_way.settled(http.scope)  # submitted next: no longer on its way (burst_hold.py)
    return requests


def _kv_room(state: ServerState, num_prompt: int) -> int:
    engine = state.engine
    return max_tokens_within(engine.footprint, engine.kv_budget_bytes, num_prompt)


def _new_request(spec: GenerationSpec, prefix: str, adapter: AdapterInfo | None,
                 received: tuple[float | None, float | None] | None, index: int = 0) -> Request:
    """``received``: (the route began reading it, the event loop read its headers), time.monotonic."""
    received_at, read_at = received or (None, None)
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
        grammar=spec.grammar,
        num_choices=spec.n,
        adapter=adapter.name if adapter else "",
        namespace=adapter.identity if adapter else "",  # a prompt cached under one adapter serves no other
        received_at=received_at,
        read_at=read_at,
    )


def submit(state: ServerState, requests: list[Request]) -> list[EventStream]:
    """A streamed reply's engine requests, submitted now: the engine takes them while the response
    starts (the SSE response closes them: ``sse_response``)."""
    return [EventStream(state.engine, request) for request in requests]


class _EngineSSE(StreamingResponse):
    """Server-sent events whose engine requests are cancelled when the response ends, however it ends:
    finished, the client gone, or before its first chunk (the generator never started)."""

    def __init__(self, lines, streams: list[EventStream]):
        super().__init__(lines, media_type="text/event-stream", headers=SSE_HEADERS)
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()


def sse_response(lines, streams: list[EventStream]) -> StreamingResponse:
    return _EngineSSE(lines, streams)


# MLXQ_SSE_COALESCE=0 sends one chunk per token even when a stream is behind (an A/B lever).
_COALESCE = os.environ.get("MLXQ_SSE_COALESCE", "1") != "0"


async def event_batches(stream: EventStream):
    """One request's events, several at a time when the stream is behind (see bridge.py)."""
    async for batch in stream.batches():
        if _COALESCE:
            yield batch
        else:
            for event in batch:
                yield [event]


async def choice_batches(streams: list[EventStream]):
    """(choice index, events) of one request's n choices (one: its own stream, no merging)."""
    if len(streams) == 1:
        async for batch in event_batches(streams[0]):
            yield 0, batch
    else:
        async for item in merged([event_batches(s) for s in streams]):
            yield item


async def collect_all(state: ServerState, http: HTTPRequest, requests: list[Request], accs: list) -> None:
    """Non-streamed: every event of each choice into its ``accs`` entry (an Accumulator); a 503 if
    one was cancelled."""
    await collect(state.engine, requests, accs, http.is_disconnected)
    if not all(acc.is_complete for acc in accs):
        raise APIError(503, "the request was cancelled before it finished (server shutting down?)")


async def stream_one(stream: EventStream, renderer):
    """Streamed, one choice: ``renderer`` (its ``acc``, ``start``, ``step``, ``error``) frames each event."""
    yield renderer.start()
    async for batch in event_batches(stream):
        for event in batch:
            if event.finish_reason is FinishReason.ERROR:
                yield renderer.error(APIError(500, event.error or "generation failed", code="engine_error"))
                return
            yield renderer.step(renderer.acc.add(event))
