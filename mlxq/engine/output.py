"""Turn one request's sampled tokens into TokenEvents: detokenize, stop, count, time.

Shared by every lane so that EOS, stop strings, max_tokens, logprobs and
usage mean the same thing wherever a request runs. Runs on the engine thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mlxq.engine.stops import StopStringMatcher
from mlxq.engine.ttft_phases import FirstTokenPhases
from mlxq.engine.types import FinishReason, Request, TokenEvent, TopLogprob, Usage

EmitFn = Callable[[TokenEvent], None]


class RequestOutput:
    def __init__(self, request: Request, tokenizer, emit: EmitFn, *, cached_tokens: int = 0):
        self.request = request
        self._tokenizer = tokenizer
        self._emit = emit
        self._detokenizer = tokenizer.detokenizer
        self._stops = StopStringMatcher(request.stop)
        self._eos = frozenset() if request.ignore_eos else frozenset(tokenizer.eos_token_ids)
        self.cached_tokens = cached_tokens
        self.checkpoint_tokens = 0  # tokens replayed from a generation checkpoint (engine/checkpointing.py)
        self.num_generated = 0
        self.tokens: list[int] = []  # generated ids, EOS excluded
        self.finished: FinishReason | None = None
        self._started_at = time.monotonic()
        self.phases = FirstTokenPhases(self._started_at)  # the batch lane marks its way to token 0
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._gaps: list[float] = []  # seconds between successive tokens (inter-token latency)

    def is_eos(self, token: int) -> bool:
        """``token`` would end the request as its end-of-sequence."""
        return token in self._eos

    def add_token(self, token: int, logprobs=None) -> bool:
        """Account one sampled token; returns True when the request is finished."""
        now = time.monotonic()
        if self._first_token_at is None:
            self._first_token_at = now
        else:
            self._gaps.append(now - self._last_token_at)
        self._last_token_at = now
        if token in self._eos:
            self.finish(FinishReason.STOP)
            return True
        self.num_generated += 1
        self.tokens.append(token)
        self._detokenizer.add_token(token)
        cut = self._stops.feed(self._detokenizer.last_segment)
        logprob, tops = self._logprobs(token, logprobs)
        if cut.stopped:
            # Whatever the detokenizer still holds comes after the stop: drop it.
            self.finish(FinishReason.STOP, text=cut.text, token=token, logprob=logprob, tops=tops, flush=False,
                        stop_sequence=cut.matched)
            return True
        if self.num_generated >= self.request.max_tokens:
            self.finish(FinishReason.LENGTH, text=cut.text, token=token, logprob=logprob, tops=tops)
            return True
        self._emit(TokenEvent(self.request.request_id, cut.text, token, logprob, tops))
        return False

    def finish(
        self, reason: FinishReason, *, text="", token=None, logprob=None, tops=(), error=None, flush=True,
        stop_sequence: str | None = None,
    ) -> None:
        """Send the final event: remaining text, the finish reason and usage."""
        if self.finished is not None:
            return
        self.finished = reason
        if flush and reason in (FinishReason.LENGTH, FinishReason.STOP):
            self._detokenizer.finalize()
            tail = self._stops.feed(self._detokenizer.last_segment)
            text += tail.text if tail.stopped else tail.text + self._stops.flush()
            stop_sequence = tail.matched
        event = TokenEvent(
            self.request.request_id, text, token, logprob, tops, reason, self.usage(), error, stop_sequence
        )
        self._emit(event)

    def usage(self) -> Usage:
        submitted = self.request.submitted_at
        first = self._first_token_at
        last = self._last_token_at
        return Usage(
            prompt_tokens=len(self.request.prompt_ids),
            completion_tokens=self.num_generated,
            cached_tokens=self.cached_tokens,
            queue_s=self._started_at - submitted,
            ttft_s=(first - submitted) if first else 0.0,
            decode_s=(last - first) if first and last else 0.0,
            inter_token_s=tuple(self._gaps),
            checkpoint_tokens=self.checkpoint_tokens,
            ttft_phases_ms=self.phases.durations_ms(first),
            parse_s=None if self.request.received_at is None else submitted - self.request.received_at,
        )

    def _logprobs(self, token: int, logprobs) -> tuple[float | None, tuple[TopLogprob, ...]]:
        if not self.request.logprobs or logprobs is None:
            return None, ()
        import mlx.core as mx

        chosen = logprobs[token].item()
        k = self.request.top_logprobs
        if k <= 0:
            return chosen, ()
        top_ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
        values = logprobs[top_ids].tolist()
        pairs = sorted(zip(top_ids.tolist(), values, strict=True), key=lambda p: -p[1])
        tops = tuple(TopLogprob(i, self._tokenizer.decode([i]), v) for i, v in pairs)
        return chosen, tops
