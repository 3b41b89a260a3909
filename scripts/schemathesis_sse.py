"""schemathesis hooks for scripts/schemathesis_openai.py: streamed answers validated event by event, and counted.

OpenAI's spec documents a stream by the schema of one event's *data*
(`text/event-stream` of chat completions: CreateChatCompletionStreamResponse;
of responses: ResponseStreamEvent). schemathesis 4 reads a
`text/event-stream` schema as the schema of the event envelope
(`{"event", "data", "id"}`, as OpenAPI 3.2 does), so it checked the wrong
object. Before the spec is loaded, ``before_load_schema`` rewrites each such
schema into an envelope whose ``data`` is JSON matching it
(``contentMediaType`` + ``contentSchema``, which schemathesis parses and
validates per event) or the ``[DONE]`` sentinel that ends OpenAI streams.
Streamed completions have no stream schema in the spec; the description of
CreateCompletionResponse says streamed and non-streamed objects share its
shape, so their events get that schema with one change OpenAI's own streams
need: ``finish_reason`` is null until a choice's last chunk.

Generated request bodies rarely set ``stream``; ``before_call`` sends every
second body of the streaming operations with ``"stream": true`` (still a
spec-valid body), so streams are checked about as often as JSON answers.

The ``sse_events`` check counts every answer by status class and every
event by route, and requires a named event's name to equal its data's
``type`` (the Responses convention, which a schema cannot express). The
counts go to the JSON file named by $MLXQ_FUZZ_TALLY when the run ends.
Loaded by ``st`` through SCHEMATHESIS_HOOKS=schemathesis_sse.
"""

from __future__ import annotations

import atexit
import copy
import json
import os
import threading
from collections import Counter

import schemathesis

SSE = "text/event-stream"
DONE = "[DONE]"
STREAMING = frozenset({"/chat/completions", "/completions", "/responses"})  # operations with a ``stream`` flag
COMPLETION_CHUNK = "CreateCompletionStreamChunk"  # added to the spec's components by ``rewrite_streams``
# Operations whose streamed events the spec does not document, and the schema of each event's data.
UNDOCUMENTED_STREAMS = {"/completions": f"#/components/schemas/{COMPLETION_CHUNK}"}

_tally: Counter = Counter()
_lock = threading.Lock()


def event_envelope(data_schema: dict) -> dict:
    """The schema of one SSE event whose ``data`` is JSON matching ``data_schema``, or ``[DONE]``."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": DONE},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": data_schema},
        ]}},
    }


def completion_chunk(completion: dict) -> dict:
    """CreateCompletionResponse as a streamed chunk: ``finish_reason`` may be null (every chunk but the last)."""
    chunk = copy.deepcopy(completion)
    choice = chunk["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    return chunk


def rewrite_streams(spec: dict) -> list[str]:
    """Turn every 200 ``text/event-stream`` schema of ``spec`` (in place) into its event envelope;
    give the streams the spec leaves undocumented theirs. Returns the operations changed."""
    schemas = spec["components"]["schemas"]
    schemas[COMPLETION_CHUNK] = completion_chunk(schemas["CreateCompletionResponse"])
    changed = []
    for path, methods in spec.get("paths", {}).items():
        post = methods.get("post") if isinstance(methods, dict) else None
        if not isinstance(post, dict) or "200" not in post.get("responses", {}):
            continue
        content = post["responses"]["200"].setdefault("content", {})
        if SSE not in content and path in UNDOCUMENTED_STREAMS:
            content[SSE] = {"schema": {"$ref": UNDOCUMENTED_STREAMS[path]}}
        if SSE in content and "schema" in content[SSE]:
            content[SSE]["schema"] = event_envelope(content[SSE]["schema"])
            changed.append(f"POST {path}")
    return changed


@schemathesis.hook
def before_load_schema(context, raw_schema: dict) -> None:
    with _lock:
        _tally["streams_rewritten"] = len(rewrite_streams(raw_schema))


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    if not isinstance(case.body, dict) or case.operation.path not in STREAMING:
        return
    with _lock:
        _tally["bodies"] += 1
        streamed = _tally["bodies"] % 2 == 0
    if streamed:
        case.body = {**case.body, "stream": True}


def parse_events(body: bytes) -> list[tuple[str, str]]:
    """(event name, data) of each SSE event in ``body`` (name "message" when the event has none)."""
    events = []
    for block in body.decode("utf-8").replace("\r\n", "\n").split("\n\n"):
        name, data = "message", []
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        if data:
            events.append((name, "\n".join(data)))
    return events


@schemathesis.check
def sse_events(ctx, response, case) -> bool | None:
    """Count the answer; for a stream, count its events and match each named event to its data's type."""
    content_type = (response.headers.get("content-type") or [""])[0]
    route = f"{case.operation.method.upper()} {case.operation.path}"
    status = f"{response.status_code // 100}xx"
    counts = Counter({"responses": 1, f"status_{status}": 1, f"answers {route} {status}": 1})
    if content_type.startswith(SSE):
        events = parse_events(response.content)
        counts.update({"streams": 1, "events": len(events), f"events {route}": len(events)})
        for name, data in events:
            if name != "message" and data != DONE:
                kind = json.loads(data).get("type")
                assert kind == name, f"event {name!r} carries data of type {kind!r}"
    with _lock:
        _tally.update(counts)
    return None


@atexit.register
def _write_tally() -> None:
    path = os.environ.get("MLXQ_FUZZ_TALLY")
    if path:
        with _lock, open(path, "w") as out:
            json.dump(dict(_tally), out, indent=1, sort_keys=True)
