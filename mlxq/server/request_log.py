"""One log line per finished request: who, which lane, how many tokens, how fast, why it ended.

Plain or JSON (``--log-format``). Prompt text is never logged unless
``--log-prompts`` is set: prompts are user data. Either way a line stays one
line: control characters, line separators, bidi overrides and lone
surrogates from a prompt or an error are escaped, so a client cannot forge
log lines or drive the terminal that shows them.
"""

from __future__ import annotations

import json
import logging
import re

from mlxq.engine.types import RequestDone

log = logging.getLogger("mlxq.requests")

# C0, DEL, C1, Unicode line/paragraph separators, zero-width and bidi controls, surrogates.
_UNSAFE = r"\x00-\x1f\x7f-\x9f\u2028\u2029\u200b-\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_ESCAPE_IN_JSON = re.compile(r"[\x7f-\x9f\u2028\u2029\u200b-\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NEEDS_QUOTES = re.compile(r'[\s"\\=' + _UNSAFE + "]")
_ESCAPE_IN_QUOTES = re.compile(r'["\\' + _UNSAFE + "]")
_NAMED = {'"': r"\"", "\\": r"\\", "\n": r"\n", "\r": r"\r", "\t": r"\t"}


def _escape_char(match: re.Match) -> str:
    c = match.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def plain_value(value) -> str:
    """A value as one space-free token: plain text as is, anything else quoted with escapes."""
    text = str(value)
    if text and not _NEEDS_QUOTES.search(text):
        return text
    return '"' + _ESCAPE_IN_QUOTES.sub(_escape_char, text) + '"'


def json_line(fields: dict) -> str:
    """JSON that keeps non-ASCII text readable, with what a terminal or log reader would act on escaped."""
    return _ESCAPE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(fields, ensure_ascii=False))


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
            "parse_ms": round(usage.parse_s * 1000, 1) if usage and usage.parse_s is not None else None,
            # When the route began reading it, on CLOCK_MONOTONIC (time.monotonic): a client on the same
            # host lines its own times up with it (its send = this - when it sent).
            "received_monotonic_s": None if done.request.received_at is None else round(done.request.received_at, 4),
            # When the event loop read its headers off the socket: the route began reading it this much later.
            "read_monotonic_s": None if done.request.read_at is None else round(done.request.read_at, 4),
            "queue_ms": round(usage.queue_s * 1000, 1) if usage else None,  # submit -> the engine picked it up
            "ttft_ms": round(usage.ttft_s * 1000, 1) if usage else None,
            "decode_tok_s": round(usage.decode_tok_s, 1) if usage else None,
        }
        for phase, ms in ((usage.ttft_phases_ms if usage else None) or {}).items():  # engine/ttft_phases.py
            fields[f"ttft_{phase}_ms"] = ms
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
            log.info(json_line(fields), extra={"fields": fields})  # the JSON formatter puts them top level
        else:
            log.info(" ".join(f"{k}={plain_value(v)}" for k, v in fields.items()))
