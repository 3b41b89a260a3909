"""The continuous-batching scheduler: joiners prefill solo, then decode together.

One ``step()`` is a short list of phases:

    _purge_cancelled -> _prefill (one chunk per joiner, bounded) -> _join -> _decode_step

- A joiner prefills alone on its own solo caches, in the serial lane's
  chunks, and samples token 0 before it joins; so each row's numbers match
  its solo run as far as batching allows, and a row that ends at token 0
  never touches the batch.
- A row joining an empty batch *adopts* its caches: the B=1 step is the
  serial lane's graph. A second row merges both into mlx-lm's batched
  caches; when only one row is left it is extracted back to solo caches.
- Decode is pipelined: step n+1 is built and ``async_eval``ed before step
  n's tokens are read, in one transfer, and emitted.
- Faults: a prefill error fails that joiner; a row whose output handling
  raises is evicted alone; a forward error fails every running row and drops
  the batch, and the scheduler goes on with new requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from mlxq.engine.rows import Row, make_row
from mlxq.engine.types import FinishReason, Request
from mlxq.kv.batch_ops import append_rows, extract_row, keep_rows, merge_solo_rows
from mlxq.kv.projection import KvFootprint

log = logging.getLogger("mlxq.scheduler")

CLEAR_CACHE_EVERY = 256  # decode steps between mx.clear_cache() calls (mlx-lm's serial cadence)


@dataclass(frozen=True)
class SchedulerConfig:
    max_rows: int  # --batch: rows decoding together
    prompt_concurrency: int  # joiners prefilling at once
    prefill_step_size: int  # tokens per prefill chunk, and the per-step prefill budget
    kv_budget_bytes: int | None  # admission cap on projected KV bytes; None = unlimited


@dataclass
class _Joiner:
    row: Row
    caches: list
    done: int = 0  # prompt tokens already prefilled


class BatchScheduler:
    def __init__(self, model, tokenizer, footprint: KvFootprint, config: SchedulerConfig,
                 on_finish: Callable[[Row], None] = lambda row: None):
        self.model = model
        self.tokenizer = tokenizer
        self.footprint = footprint
        self.config = config
        self._on_finish = on_finish
        self._joiners: list[_Joiner] = []
        self._rows: list[Row] = []
        self._caches: list | None = None  # solo caches when one row runs, batched otherwise
        self._batched = False
        self._pending: tuple[mx.array, list, list[bool]] | None = None  # (tokens, logprobs, already emitted)
        self._steps = 0
        self.submitted_rows = 0

    # --- state the engine reads -------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self._rows)

    @property
    def num_prefilling(self) -> int:
        return len(self._joiners)

    @property
    def is_idle(self) -> bool:
        return not self._rows and not self._joiners

    def projected_bytes(self, extra: Request | None = None) -> int:
        """Worst-case KV bytes of every row (and ``extra``) at prompt + max_tokens, plus prefill transients."""
        lengths = [len(r.request.prompt_ids) + r.request.max_tokens for r in self._all_rows()]
        prefilling = [len(j.row.request.prompt_ids) for j in self._joiners]
        if extra is not None:
            lengths.append(len(extra.prompt_ids) + extra.max_tokens)
            prefilling.append(len(extra.prompt_ids))
        return self.footprint.batch_bytes(lengths) + sum(self.footprint.prefill_bytes(n) for n in prefilling)

    def can_admit(self, request: Request) -> bool:
        if len(self._rows) + len(self._joiners) >= self.config.max_rows:
            return False
        if len(self._joiners) >= self.config.prompt_concurrency:
            return False
        budget = self.config.kv_budget_bytes
        return budget is None or self.projected_bytes(request) <= budget

    def _all_rows(self) -> list[Row]:
        return self._rows + [j.row for j in self._joiners]

    # --- intake -------------------------------------------------------------------
    def add(self, request: Request, emit) -> None:
        row = make_row(request, self.tokenizer, emit)
        self._joiners.append(_Joiner(row, make_prompt_cache(self.model)))
        self.submitted_rows += 1

    def fail_all(self, message: str) -> None:
        for row in self._all_rows():
            row.output.finish(FinishReason.ERROR, error=message)
            self._on_finish(row)
        self._joiners, self._rows, self._caches, self._pending, self._batched = [], [], None, None, False

    # --- one iteration ------------------------------------------------------------
    def step(self) -> None:
        self._purge_cancelled()
        ready = self._prefill()
        if ready:
            self._join(ready)
        if self._rows:
            try:
                self._decode_step()
            except Exception as exc:
                log.error("decode step failed; failing %d rows", len(self._rows), exc_info=True)
                rows = self._rows
                self._rows, self._caches, self._pending, self._batched = [], None, None, False
                for row in rows:
                    row.output.finish(FinishReason.ERROR, error=f"batch decode failed: {type(exc).__name__}: {exc}")
                    self._on_finish(row)

    def _purge_cancelled(self) -> None:
        for joiner in [j for j in self._joiners if j.row.request.cancelled.is_set()]:
            self._joiners.remove(joiner)
            joiner.row.output.finish(FinishReason.CANCELLED)
            self._on_finish(joiner.row)
        # Running rows are cancelled at emit time, where their pending token is dropped.

    def _prefill(self) -> list[_Joiner]:
        """Advance joiners one chunk each, FIFO, within one chunk's worth of tokens per step."""
        budget = self.config.prefill_step_size
        ready = []
        for joiner in list(self._joiners):
            if budget <= 0:
                break
            try:
                used = self._advance(joiner)
            except Exception as exc:
                log.error("prefill failed for %s", joiner.row.request.request_id, exc_info=True)
                self._joiners.remove(joiner)
                joiner.row.output.finish(FinishReason.ERROR, error=f"prefill failed: {type(exc).__name__}: {exc}")
                self._on_finish(joiner.row)
                continue
            budget -= used
            if joiner.row.output.finished is not None:
                self._joiners.remove(joiner)  # ended at token 0: never joins the batch
                self._on_finish(joiner.row)
            elif joiner.done == len(joiner.row.request.prompt_ids):
                self._joiners.remove(joiner)
                ready.append(joiner)
        return ready

    def _advance(self, joiner: _Joiner) -> int:
        """One chunk of the prompt (all but its last token), or token 0 once that is done.

        Chunk boundaries are the serial lane's (mlx-lm generate_step): chunks of
        prefill_step_size over prompt[:-1], then the last token alone.
        """
        prompt, row = joiner.row.request.prompt_ids, joiner.row
        remaining = len(prompt) - 1 - joiner.done
        with mx.stream(generation_stream):
            if remaining > 0:
                n = min(self.config.prefill_step_size, remaining)
                chunk = mx.array(prompt[joiner.done : joiner.done + n])
                self.model(chunk[None], cache=joiner.caches)
                mx.eval([c.state for c in joiner.caches])
                row.feed_history(chunk)
                joiner.done += n
                mx.clear_cache()
                return n
            last = mx.array(prompt[-1:])
            logits = self.model(last[None], cache=joiner.caches)[:, -1, :]
            token, logprobs = row.sample(logits, last)
            mx.eval(token, logprobs)
        joiner.done = len(prompt)
        row.fed = len(prompt)
        row.output.add_token(token.item(), logprobs.squeeze(0))
        row.extra["token0"], row.extra["logprobs0"] = token, logprobs.squeeze(0)
        return 1

    def _join(self, ready: list[_Joiner]) -> None:
        tokens = [j.row.extra.pop("token0") for j in ready]
        logprobs = [j.row.extra.pop("logprobs0") for j in ready]
        if not self._rows:
            first = ready[0]
            self._caches, self._batched = first.caches, False  # adopt: zero copy, serial graph
            rest = ready[1:]
            self._rows = [first.row]
            self._pending = (tokens[0], [logprobs[0]], [True])
            tokens, logprobs = tokens[1:], logprobs[1:]
        else:
            rest = ready
        if not rest:
            return
        if self._batched:
            append_rows(self._caches, [j.caches for j in rest])
        else:
            self._caches = merge_solo_rows([self._caches] + [j.caches for j in rest])
            self._batched = True
        pending_tokens, pending_lps, emitted = self._pending
        self._pending = (
            mx.concatenate([pending_tokens, *tokens]),
            pending_lps + logprobs,
            emitted + [True] * len(rest),
        )
        self._rows += [j.row for j in rest]

    def _decode_step(self) -> None:
        inputs, logprobs_now, emitted = self._pending
        with mx.stream(generation_stream):
            logits = self.model(inputs[:, None], cache=self._caches)[:, -1, :]
            next_tokens, next_logprobs = self._sample(logits, inputs)
        mx.async_eval(next_tokens, next_logprobs)
        for row in self._rows:
            row.fed += 1
        # Read step n while step n+1 runs: one transfer for every row's token.
        tokens = inputs.tolist()
        keep = []
        for i, row in enumerate(self._rows):
            if emitted[i]:
                keep.append(i)
                continue
            if self._emit(row, tokens[i], logprobs_now[i]):
                keep.append(i)
        self._pending = (next_tokens, next_logprobs, [False] * len(self._rows))
        if len(keep) < len(self._rows):
            self._evict(keep)
        self._steps += 1
        if self._steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()

    def _sample(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list]:
        if all(row.is_plain_greedy for row in self._rows):
            # One vectorized argmax; per row the same math as the serial greedy sampler.
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return mx.argmax(logprobs, axis=-1), list(logprobs)
        tokens, logprobs = [], []
        for i, row in enumerate(self._rows):
            token, lp = row.sample(logits[i : i + 1], inputs[i : i + 1])
            tokens.append(token)
            logprobs.append(lp.squeeze(0))
        return mx.concatenate(tokens), logprobs

    def _emit(self, row: Row, token: int, logprobs) -> bool:
        """Hand one token to the row's output; False when the row is done."""
        if row.request.cancelled.is_set():
            row.output.finish(FinishReason.CANCELLED)
            return False
        try:
            finished = row.output.add_token(token, logprobs if row.request.logprobs else None)
        except Exception as exc:  # this row's output handling failed: evict it alone
            log.error("row %s failed while emitting", row.request.request_id, exc_info=True)
            row.output.finish(FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
            return False
        return not finished

    def _evict(self, keep: list[int]) -> None:
        for i, row in enumerate(self._rows):
            if i not in keep:
                self._on_finish(row)
        tokens, logprobs, emitted = self._pending
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._caches, self._pending, self._batched = None, None, False
            return
        index = mx.array(keep)
        self._pending = (tokens[index], [logprobs[i] for i in keep], [emitted[i] for i in keep])
        if self._batched:
            keep_rows(self._caches, keep)
            if len(keep) == 1:
                # Back to the B=1 fast path: solo caches, the serial lane's graph.
                self._caches, self._batched = extract_row(self._caches, 0), False
