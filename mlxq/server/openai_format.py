"""Shape engine events into OpenAI chat/text completion objects and stream chunks."""

from __future__ import annotations

import time

from mlxq.engine.types import FinishReason, TokenEvent, Usage
from mlxq.server.tools import make_splitter


def combined_usage(usages: list[Usage]) -> Usage:
    """One response's usage over its n choices: the prompt once (as it was computed for the first
    choice; the others took it from the prompt cache), every choice's completion tokens."""
    first = usages[0]
    return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=first.cached_tokens, queue_s=first.queue_s, ttft_s=first.ttft_s,
                 decode_s=max(u.decode_s for u in usages))


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
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class ChoiceBuilder:
    """Accumulates one request's events; renders stream deltas and the final object."""

    def __init__(self, spec, tokenizer, request_id: str, model: str, index: int = 0):
        self.spec = spec
        self.index = index  # the choice's place among the request's n
        self.kind = spec.kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._splitter = make_splitter(tokenizer, spec.tools) if spec.kind == "chat" else None
        self.text = ""
        self._chat_logprobs: list[dict] = []
        self._text_logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self._sent_role = False

    # --- accumulation ----------------------------------------------------------
    def add(self, event: TokenEvent) -> tuple[str, list[dict], dict | None]:
        """Fold an event in; returns (content delta, new tool calls, logprob entry)."""
        text = event.text
        calls: list[dict] = []
        if self._splitter is not None:
            text, calls = self._splitter.feed(text)
            if event.finish_reason is not None:
                text += self._splitter.flush()
        offset = len(self.text)
        self.text += text
        entry = self._logprob_entry(event, offset)
        if event.finish_reason is not None:
            self.usage = event.usage
            self.finish_reason = self._finish_reason(event.finish_reason)
        return text, calls, entry

    def _finish_reason(self, reason: FinishReason) -> str:
        if self._splitter is not None and self._splitter.calls and reason is FinishReason.STOP:
            return "tool_calls"
        return reason.value

    def _logprob_entry(self, event: TokenEvent, offset: int) -> dict | None:
        if not self.spec.logprobs or event.token_id is None or event.logprob is None:
            return None
        token = self._tokenizer.decode([event.token_id])
        if self.kind == "chat":
            entry = {
                "token": token,
                "logprob": event.logprob,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8"))}
                    for t in event.top_logprobs
                ],
            }
            self._chat_logprobs.append(entry)
            return entry
        lp = self._text_logprobs
        lp["tokens"].append(token)
        lp["token_logprobs"].append(event.logprob)
        lp["top_logprobs"].append({t.token: t.logprob for t in event.top_logprobs})
        lp["text_offset"].append(offset)
        return {"tokens": [token], "token_logprobs": [event.logprob],
                "top_logprobs": [lp["top_logprobs"][-1]], "text_offset": [offset]}

    # --- rendering --------------------------------------------------------------
    def chunk(self, text: str, calls: list[dict], entry: dict | None, finish: str | None) -> dict:
        if self.kind == "chat":
            delta: dict = {}
            if not self._sent_role:
                delta["role"] = "assistant"
                self._sent_role = True
            if text:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": self.index, "delta": delta,
                      "logprobs": {"content": [entry]} if entry else None, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": self.index, "text": text, "logprobs": entry, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage_json(self.usage) if self.usage else None
        return body

    def final(self) -> dict:
        if self.kind == "chat":
            calls = self._splitter.calls if self._splitter else []
            message: dict = {"role": "assistant", "content": self.text if (self.text or not calls) else None}
            if calls:
                message["tool_calls"] = calls
            logprobs = {"content": self._chat_logprobs} if self.spec.logprobs else None
            choice = {"index": self.index, "message": message, "logprobs": logprobs,
                      "finish_reason": self.finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            logprobs = self._text_logprobs if self.spec.logprobs else None
            choice = {"index": self.index, "text": self.text, "logprobs": logprobs,
                      "finish_reason": self.finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage_json(self.usage) if self.usage else None
        return body

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "mlxq", "choices": choices}
