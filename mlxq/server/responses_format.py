"""OpenAI Responses: the Response object and its typed SSE events, rendered from an Accumulator.

Output items come in the order the model wrote them: a ``message`` item for
text, a ``function_call`` (or ``custom_tool_call``) item per call. A stream
opens with ``response.created`` and ``response.in_progress``, opens and closes
each item (``output_item.added``/``done``, with ``content_part`` and
``output_text.delta``/``done`` for text, ``function_call_arguments.delta``/``done``
for calls) and ends with ``response.completed`` or ``response.incomplete``.
Field names follow the ``openai`` SDK's types (openai/types/responses).
"""

from __future__ import annotations

import json
import time
import uuid

from mlxq.engine.types import FinishReason
from mlxq.server.accumulator import Accumulator, Step
from mlxq.server.errors import APIError
from mlxq.server.openai_format import checkpoint_details
from mlxq.server.responses_request import ResponsesRequest, ToolName
from mlxq.server.tools import ToolCall


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(payload: dict) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseRenderer:
    """One response: its items as they complete, the whole object, and the stream's events."""

    def __init__(self, acc: Accumulator, request: ResponsesRequest, model: str):
        self.acc = acc
        self.request = request
        self.model = model
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.items: list[dict] = []  # output items, finished ones complete
        self._message: dict | None = None  # the text item being written
        self._seq = 0

    # --- the object -------------------------------------------------------------
    def response(self) -> dict:
        acc = self.acc
        status = "in_progress"
        if acc.finish is FinishReason.LENGTH:
            status = "incomplete"
        elif acc.finish is not None:
            status = "completed"
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": self.items, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "store": False, "previous_response_id": None, "reasoning": None,
                "truncation": "disabled", **self.request.echo}
        if acc.usage is not None:  # absent until the end: the spec allows no null here
            u = acc.usage
            body["usage"] = {"input_tokens": u.prompt_tokens,
                             "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                             "output_tokens": u.completion_tokens,
                             "output_tokens_details": {"reasoning_tokens": 0,
                                                       **checkpoint_details(u)},
                             "total_tokens": u.prompt_tokens + u.completion_tokens}
        return body

    def final(self) -> dict:
        """The non-streamed Response: every item, completed."""
        if self.acc.text:
            self.items.append(self._message_item(self.acc.text, "completed"))
        self.items.extend(self._call_item(c, "completed") for c in self.acc.calls)
        return self.response()

    # --- the stream ------------------------------------------------------------
    def start(self) -> str:
        return self._event("response.created", response=self.response()) + \
            self._event("response.in_progress", response=self.response())

    def step(self, step: Step) -> str:
        out = []
        if step.text:
            if self._message is None:
                out.append(self._open_message())
            self._message["content"][0]["text"] += step.text
            out.append(self._event("response.output_text.delta", **self._text_at(), delta=step.text, logprobs=[]))
        for call in step.calls:
            out.append(self._close_message())
            out.append(self._call_events(call))
        if step.finished:
            out.append(self._close_message())
            kind = "response.incomplete" if self.acc.finish is FinishReason.LENGTH else "response.completed"
            out.append(self._event(kind, response=self.response()))
        return "".join(out)

    def error(self, err: APIError) -> str:
        return self._event("error", code=err.code, message=err.message, param=err.param)

    def _open_message(self) -> str:
        self._message = self._message_item("", "in_progress")
        self.items.append(self._message)
        part = _text_part("")
        added = self._event("response.output_item.added", output_index=len(self.items) - 1,
                            item={**self._message, "content": []})
        return added + self._event("response.content_part.added", **self._text_at(), part=part)

    def _close_message(self) -> str:
        if self._message is None:
            return ""
        message, self._message = self._message, None
        message["status"] = "completed"
        index = self.items.index(message)
        where = {"item_id": message["id"], "output_index": index, "content_index": 0}
        text = message["content"][0]["text"]
        return (self._event("response.output_text.done", **where, text=text, logprobs=[])
                + self._event("response.content_part.done", **where, part=message["content"][0])
                + self._event("response.output_item.done", output_index=index, item=message))

    def _call_events(self, call: ToolCall) -> str:
        item = self._call_item(call, "completed")
        self.items.append(item)
        index = len(self.items) - 1
        if item["type"] == "custom_tool_call":
            return (self._event("response.output_item.added", output_index=index, item={**item, "input": ""})
                    + self._event("response.custom_tool_call_input.delta", output_index=index, item_id=item["id"],
                                  delta=item["input"])
                    + self._event("response.custom_tool_call_input.done", output_index=index, item_id=item["id"],
                                  input=item["input"])
                    + self._event("response.output_item.done", output_index=index, item=item))
        where = {"item_id": item["id"], "output_index": index}
        return (self._event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"})
                + self._event("response.function_call_arguments.delta", **where, delta=call.arguments)
                + self._event("response.function_call_arguments.done", **where, arguments=call.arguments,
                              name=item["name"])
                + self._event("response.output_item.done", output_index=index, item=item))

    # --- items -----------------------------------------------------------------
    def _message_item(self, text: str, status: str) -> dict:
        return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
                "content": [_text_part(text)]}

    def _call_item(self, call: ToolCall, status: str) -> dict:
        tool = self.request.tool_names.get(call.name, ToolName(call.name))
        call_id = call.id
        if tool.custom:
            return {"type": "custom_tool_call", "id": _id("ctc"), "call_id": call_id, "name": tool.name,
                    "input": str(call.input.get("input", call.arguments))}
        item = {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": tool.name,
                "arguments": call.arguments, "status": status}
        if tool.namespace:
            item["namespace"] = tool.namespace
        return item

    def _text_at(self) -> dict:
        return {"item_id": self._message["id"], "output_index": self.items.index(self._message), "content_index": 0}

    def _event(self, kind: str, **fields) -> str:
        self._seq += 1
        return sse_event({"type": kind, "sequence_number": self._seq - 1, **fields})
