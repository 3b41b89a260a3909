"""Tool calls out of generated text, with the model's own mlx-lm tool parser.

The model writes ``<start>payload<end>`` (markers from the tokenizer, e.g.
``<tool_call>``/``</tool_call>``); the parser turns a payload into
a ``ToolCall`` (name, arguments as JSON text). While streaming, text before a start marker goes
out as content, and everything from the marker on is held until the call
closes, then goes out as one ``tool_calls`` delta.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote, parsed by the model's own tool parser."""

    id: str  # call_...; each protocol may prefix it its own way
    name: str
    arguments: str  # a JSON text (OpenAI sends arguments as a string)

    @property
    def input(self) -> dict:
        """The arguments as an object (Anthropic's ``input``): {} when they are not a JSON object."""
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass
class ToolCallSplitter:
    start: str  # e.g. "<tool_call>"
    end: str  # e.g. "</tool_call>"
    parse: Callable[[str, list | None], dict]  # mlx-lm's parse_tool_call(text, tools)
    tools: list | None
    _buffer: str = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Returns (content to emit now, tool calls completed by this text)."""
        self._buffer += text
        content, found = "", []
        while True:
            at = self._buffer.find(self.start)
            if at < 0:
                keep = _partial_suffix(self._buffer, self.start)
                cut = len(self._buffer) - keep
                content += self._buffer[:cut]
                self._buffer = self._buffer[cut:]
                return content, found
            content += self._buffer[:at]
            close = self._buffer.find(self.end, at + len(self.start))
            if close < 0:
                self._buffer = self._buffer[at:]
                return content, found
            payload = self._buffer[at + len(self.start) : close]
            self._buffer = self._buffer[close + len(self.end) :]
            call = self._to_call(payload)
            if call is None:  # unparseable: give the text back as content
                content += self.start + payload + self.end
            else:
                found.append(call)

    def flush(self) -> str:
        """An unclosed call at the end of the output is plain text."""
        rest, self._buffer = self._buffer, ""
        return rest

    def _to_call(self, payload: str) -> ToolCall | None:
        try:
            parsed = self.parse(payload, self.tools)
        except Exception:
            return None
        if not isinstance(parsed, dict) or "name" not in parsed:
            return None
        arguments = parsed.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", str(parsed["name"]), arguments)


def make_splitter(tokenizer, tools) -> ToolCallSplitter | None:
    if not tools or not tokenizer.has_tool_calling or tokenizer.tool_parser is None:
        return None
    return ToolCallSplitter(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser, tools)


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
