"""A request body to JSON, where every malformed shape is a 400: bad UTF-8, deep nesting, huge integers,
lone surrogates (valid JSON escapes that no tokenizer or UTF-8 encoder accepts)."""

from __future__ import annotations

import json
import re

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from mlxq.server.errors import APIError, invalid
from mlxq.server.json_pieces import loads_in_pieces

LARGE_REQUEST_BYTES = 1 << 20  # bodies this big are parsed off the event loop, and memory is trimmed after
MAX_DEPTH = 128  # objects/arrays inside each other; JSON Schemas in tools stay far below it
# A surrogate can only reach a string through a \uD800-\uDFFF escape (the bytes are decoded strictly).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json(http: HTTPRequest, limit: int):
    """The body as JSON; bodies over ``limit`` bytes are refused before parsing (413); a large one is
    parsed in a worker thread (server/offload.py does the rest of a request's work there too)."""
    raw = await read_body(http, limit)
    if len(raw) >= LARGE_REQUEST_BYTES:
        return await run_in_threadpool(parse_json_body, raw)
    return parse_json_body(raw)


async def read_body(http: HTTPRequest, limit: int) -> bytes:
    """The raw body; over ``limit`` bytes is a 413 (before reading it all when the length is declared)."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-body (or cut by --request-read-timeout): nobody reads the answer
        raise APIError(408, "the client disconnected before sending the whole body", code="body_incomplete") \
            from None
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body larger than the server's limit of {limit} bytes (--max-request-bytes)",
                    code="request_too_large")


def parse_json_body(raw: bytes):
    if not raw:
        raise invalid("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid UTF-8: {exc}") from None
    try:
        body = loads_in_pieces(text) if len(raw) >= LARGE_REQUEST_BYTES else json.loads(text)
    except RecursionError:
        raise invalid(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError; an integer over Python's 4300-digit conversion limit
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    _check_tree(body, check_strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def _check_tree(body, *, check_strings: bool) -> None:
    """Depth bound and lone surrogates, without recursion (the tree may be as deep as the parser allowed)."""
    stack = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = list(node.values()) + (list(node) if check_strings else [])
        elif isinstance(node, list):
            children = node
        else:
            if check_strings and isinstance(node, str) and _LONE_SURROGATE.search(node):
                raise invalid("the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff) in a string")
            continue
        if depth > MAX_DEPTH:
            raise invalid(f"the request body nests deeper than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children if check_strings or isinstance(child, (dict, list)))
