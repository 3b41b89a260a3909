"""Anthropic Messages: the message object and its SSE event sequence, rendered from an Accumulator.

A stream is ``message_start``, ``ping``, then content blocks (``text`` blocks
take ``text_delta``s; a ``tool_use`` block carries its input as one
``input_json_delta``, sent when the call is complete), then ``message_delta``
(stop_reason, usage) and ``message_stop``. The field names follow the
``anthropic`` SDK's types, which is what clients parse with.
"""

from __future__ import annotations

import json
import uuid

from mlxq.engine.types import FinishReason, Usage
from mlxq.server.accumulator import Accumulator, Step
from mlxq.server.errors import APIError
from mlxq.server.openai_format import checkpoint_details
from mlxq.server.tools import ToolCall


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def sse_event(payload: dict) -> str:
    """Anthropic's SSE framing: a named event whose data repeats the type."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def stop_fields(acc: Accumulator) -> dict:
    """stop_reason, and the stop_sequence when a stop sequence is what ended the message."""
    reason = stop_reason(acc)
    return {"stop_reason": reason, "stop_sequence": acc.stop_sequence if reason == "stop_sequence" else None}


def stop_reason(acc: Accumulator) -> str | None:
    if acc.finish is None:
        return None
    if acc.called_tools:
        return "tool_use"
    if acc.finish is FinishReason.LENGTH:
        return "max_tokens"
    return "stop_sequence" if acc.stop_sequence is not None else "end_turn"


def usage_json(usage: Usage | None, prompt_tokens: int) -> dict:
    """Anthropic counts cache reads apart: input_tokens are the prompt tokens computed afresh."""
    cached = usage.cached_tokens if usage else 0
    return {"input_tokens": (usage.prompt_tokens if usage else prompt_tokens) - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": usage.completion_tokens if usage else 0, **checkpoint_details(usage)}


def tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": _tool_use_id(call), "name": call.name, "input": call.input}


def _tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def message_json(acc: Accumulator, message_id: str, model: str, prompt_tokens: int) -> dict:
    content = [{"type": "text", "text": acc.text}] if acc.text else []
    content += [tool_use_block(c) for c in acc.calls]
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            **stop_fields(acc), "usage": usage_json(acc.usage, prompt_tokens)}


class MessageStream:
    """The event sequence of one streamed message; each method returns the SSE text to send."""

    def __init__(self, acc: Accumulator, message_id: str, model: str, prompt_tokens: int):
        self.acc = acc
        self.id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self._blocks = 0  # content blocks started so far
        self._text_open = False

    def start(self) -> str:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage_json(None, self.prompt_tokens)}
        return sse_event({"type": "message_start", "message": message}) + sse_event({"type": "ping"})

    def step(self, step: Step) -> str:
        out = []
        if step.text:
            if not self._text_open:
                out.append(self._block_start({"type": "text", "text": ""}))
                self._text_open = True
            out.append(self._delta({"type": "text_delta", "text": step.text}))
        for call in step.calls:
            out.append(self._close_text())
            out.append(self._block_start({**tool_use_block(call), "input": {}}))
            out.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(call.input)}))
            out.append(self._block_stop())
        if step.finished:
            out.append(self._close_text())
            out.append(sse_event({"type": "message_delta", "delta": stop_fields(self.acc),
                                  "usage": usage_json(self.acc.usage, self.prompt_tokens)}))
            out.append(sse_event({"type": "message_stop"}))
        return "".join(out)

    def error(self, err: APIError) -> str:
        return sse_event(err.anthropic_body())

    def _block_start(self, block: dict) -> str:
        self._blocks += 1
        return sse_event({"type": "content_block_start", "index": self._blocks - 1, "content_block": block})

    def _delta(self, delta: dict) -> str:
        return sse_event({"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})

    def _block_stop(self) -> str:
        return sse_event({"type": "content_block_stop", "index": self._blocks - 1})

    def _close_text(self) -> str:
        if not self._text_open:
            return ""
        self._text_open = False
        return self._block_stop()
