"""One log line per finished request: who, which lane, how many tokens, how fast, why it ended.

Plain or JSON (``--log-format``). Prompt text is never logged unless
``--log-prompts`` is set: prompts are user data.
"""

from __future__ import annotations

import json
import logging

from mlxq.engine.types import RequestDone

log = logging.getLogger("mlxq.requests")


class RequestLogger:
    def __init__(self, fmt: str = "plain", log_prompts: bool = False, tokenizer_of=lambda: None):
        if fmt not in ("plain", "json"):
            raise ValueError(f"log format must be plain or json, got {fmt!r}")
        self.fmt = fmt
        self.log_prompts = log_prompts
        self._tokenizer_of = tokenizer_of  # the tokenizer, once loaded (prompts are decoded only on demand)

    def record(self, done: RequestDone) -> dict:
        usage = done.usage
        fields = {
            "id": done.request.request_id,
            "lane": done.lane,
            "finish_reason": done.finish_reason.value,
            "prompt_tokens": len(done.request.prompt_ids),
            "cached_tokens": usage.cached_tokens if usage else 0,
            "generated_tokens": usage.completion_tokens if usage else 0,
            "ttft_ms": round(usage.ttft_s * 1000, 1) if usage else None,
            "decode_tok_s": round(usage.decode_tok_s, 1) if usage else None,
        }
        if done.error:
            fields["error"] = done.error
        if self.log_prompts and (tokenizer := self._tokenizer_of()) is not None:
            fields["prompt"] = tokenizer.decode(done.request.prompt_ids)
        return fields

    def __call__(self, done: RequestDone) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        fields = self.record(done)
        if self.fmt == "json":
            log.info(json.dumps(fields, ensure_ascii=False))
        else:
            log.info(" ".join(f"{k}={v}" for k, v in fields.items()))
