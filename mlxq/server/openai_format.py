"""OpenAI chat and text completions: objects and stream chunks rendered from an Accumulator."""

from __future__ import annotations

import json
import time

from mlxq.engine.types import TokenEvent, Usage
from mlxq.server.accumulator import Accumulator, LogprobEntry, Step
from mlxq.server.tools import ToolCall


def combined_usage(usages: list[Usage]) -> Usage:
    """One response's usage over its n choices: the prompt once (as it was computed for the first
    choice; the others took it from the prompt cache), every choice's completion tokens."""
    first = usages[0]
    return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=first.cached_tokens, queue_s=first.queue_s, ttft_s=first.ttft_s,
                 decode_s=max(u.decode_s for u in usages),
                 checkpoint_tokens=sum(u.checkpoint_tokens for u in usages))


def merged_final(builders: list[ChoiceBuilder]) -> dict:
    """The non-streamed response of a request's choices (one or n): each builder's choice, one usage."""
    finals = [b.final() for b in builders]
    body = finals[0]
    body["choices"] = [final["choices"][0] for final in finals]
    usages = [b.usage for b in builders]
    body["usage"] = usage_json(combined_usage(usages)) if all(usages) else None
    return body


def merged_usage_chunk(builders: list[ChoiceBuilder]) -> dict:
    """The stream's last chunk (``stream_options.include_usage``): the choices' usage, combined."""
    body = builders[0].usage_chunk()
    body["usage"] = usage_json(combined_usage([b.usage for b in builders]))
    return body


def usage_json(usage: Usage) -> dict:
    body = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.checkpoint_tokens:  # resumed from a generation checkpoint: these were not generated again
        body["completion_tokens_details"] = {"checkpoint_tokens": usage.checkpoint_tokens}
    return body


def checkpoint_details(usage: Usage | None) -> dict:
    """``{"checkpoint_tokens": n}`` when n completion tokens came from a generation checkpoint, else nothing."""
    return {"checkpoint_tokens": usage.checkpoint_tokens} if usage is not None and usage.checkpoint_tokens else {}


def sse_line(payload: dict) -> str:
    """OpenAI's SSE framing: data lines only, the stream ends with ``data: [DONE]``."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def tool_call_json(call: ToolCall, index: int) -> dict:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def chat_logprob_json(entry: LogprobEntry) -> dict:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode("utf-8")),
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8"))}
                         for t in entry.top],
    }


def text_logprobs_json(entries: list[LogprobEntry]) -> dict:
    """Legacy completions' column form."""
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": [e.offset for e in entries]}


class ChoiceBuilder:
    """One choice of a chat or text completion: an Accumulator plus OpenAI's shapes for it."""

    def __init__(self, spec, tokenizer, request_id: str, model: str, index: int = 0):
        self.spec = spec
        self.index = index  # the choice's place among the request's n
        self.kind = spec.kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        tools = spec.tools if spec.kind == "chat" else None
        self.acc = Accumulator(tokenizer, tools, spec.logprobs)
        self._sent_role = False

    @property
    def usage(self) -> Usage | None:
        return self.acc.usage

    @property
    def finish_reason(self) -> str | None:
        if self.acc.finish is None:
            return None
        return "tool_calls" if self.acc.called_tools else self.acc.finish.value

    def add(self, event: TokenEvent) -> Step:
        return self.acc.add(event)

    # --- rendering --------------------------------------------------------------
    def chunk(self, text: str, calls: list[ToolCall], entry: LogprobEntry | None, finish: str | None) -> dict:
        if self.kind == "chat":
            delta: dict = {}
            if not self._sent_role:
                delta["role"] = "assistant"
                self._sent_role = True
            if text:
                delta["content"] = text
            if calls:
                first = len(self.acc.calls) - len(calls)
                delta["tool_calls"] = [tool_call_json(c, first + i) for i, c in enumerate(calls)]
            logprobs = {"content": [chat_logprob_json(entry)], "refusal": None} if entry else None
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": self.index, "text": text, "logprobs": text_logprobs_json([entry]) if entry else None,
                  "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage_json(self.usage) if self.usage else None
        return body

    def final(self) -> dict:
        acc = self.acc
        if self.kind == "chat":
            message: dict = {"role": "assistant", "content": acc.text if (acc.text or not acc.calls) else None,
                             "refusal": None}
            if acc.calls:
                message["tool_calls"] = [tool_call_json(c, i) for i, c in enumerate(acc.calls)]
            logprobs = ({"content": [chat_logprob_json(e) for e in acc.logprobs], "refusal": None}
                        if self.spec.logprobs else None)
            choice = {"index": self.index, "message": message, "logprobs": logprobs,
                      "finish_reason": self.finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            logprobs = text_logprobs_json(acc.logprobs) if self.spec.logprobs else None
            choice = {"index": self.index, "text": acc.text, "logprobs": logprobs,
                      "finish_reason": self.finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage_json(self.usage) if self.usage else None
        return body

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "mlxq", "choices": choices}

