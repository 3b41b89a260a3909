"""The continuous-batching scheduler: joiners prefill solo, then decode together.

One ``step()`` is a short list of phases:

    _purge_cancelled -> _prefill (one chunk per joiner, bounded) -> _start_decoding (join)
    -> _decode_step

- A joiner prefills prompt[:-1] on its own solo caches, in the serial lane's
  chunks (the chunks of joiners advancing in one step run as one forward).
  Once prefilled it joins with its last prompt token as pending input, so the
  batch's next decode step computes its token 0 with everyone's next token
  (GPU); on the CPU, where a forward of the joiners alone is cheaper than a
  batch step, token 0 comes from that forward before they join.
- A row joining an empty batch *adopts* its caches: the B=1 step is the
  serial lane's graph. A second row merges both into mlx-lm's batched
  caches; when only one row is left it is extracted back to solo caches.
- Decode is pipelined: step n+1 is built and ``async_eval``ed before step
  n's tokens are read, in one transfer, and emitted.
- Faults: an allocation failure is retried once after releasing MLX's cache,
  then the scheduler sheds work and recomputes it later (engine/faults.py,
  engine/preempt.py, engine/shedding.py); before a decode step that would
  pass the memory limit it sheds the newest rows: no request fails for a
  memory shortage. Any other
  prefill error fails that joiner; a row whose output handling raises is
  evicted alone; any other forward error fails every running row and drops
  the batch, and the scheduler goes on with new requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from mlxq.engine.faults import Evaluator, MemoryFault, is_allocation_failure, release_cached_memory
from mlxq.engine.grammar_timing import GrammarTiming
from mlxq.engine.preempt import LoadCaps, split_prefill_group
from mlxq.engine.rows import Row, make_row, resume_row
from mlxq.engine.shedding import MemoryShedding, resumed_size
from mlxq.engine.step_sampling import sample_step
from mlxq.engine.step_timing import DecodeTiming, PhaseTiming
from mlxq.engine.transient import ModelShape, joiners_transient
from mlxq.engine.types import FinishReason, Request
from mlxq.kv.batch_ops import extend_batch, extract_row, keep_rows, merge_solo_rows
from mlxq.kv.projection import KvFootprint
from mlxq.kv.scheme import NATIVE, KvScheme
from mlxq.store.prefix import common_prefix
from mlxq.store.prompt_cache import MIN_SNAPSHOT_TOKENS, is_trimmable

if TYPE_CHECKING:
    from mlxq.store.cold_tier import PendingRestore

log = logging.getLogger("mlxq.scheduler")

CLEAR_CACHE_EVERY = 256  # decode steps between mx.clear_cache() calls (mlx-lm's serial cadence)


@dataclass(frozen=True)
class SchedulerConfig:
    max_rows: int  # --batch: rows decoding together
    prompt_concurrency: int  # joiners prefilling at once
    prefill_step_size: int  # tokens per prefill chunk, and the per-step prefill budget
    kv_budget_bytes: int | None  # admission cap on projected KV bytes; None = unlimited
    # Token 0 from the batch's decode step (True: on a GPU a forward of the joiners alone streams
    # all the weights again) or from a forward of the joiners alone (False: on the compute-bound
    # CPU that smaller forward gives the earlier first token). Same tokens either way.
    token0_in_decode: bool = True
    transient_budget_bytes: int | None = None  # prefill transients of joiners together (engine/transient.py)
    memory_limit_bytes: int | None = None  # MLX's memory limit: decode sheds rows before passing it
    shape: ModelShape | None = None  # what those transients are computed from


# A joiner waits for another joiner's prefill only when they share at least this many new tokens.
MIN_SHARED_PREFILL = 64


@dataclass(eq=False)
class _Joiner:
    row: Row
    caches: list
    done: int = 0  # prompt tokens already prefilled
    leader: _Joiner | None = None  # prefilling the prefix this joiner shares: wait for it, then take
    wait_until: int = 0  # the leader's ``done`` at which the shared prefix is in the prompt cache
    followers: int = 0  # joiners waiting on this one
    restore: PendingRestore | None = None  # reading a longer prefix from disk
    resumed: bool = False  # a preempted row recomputing its KV: its usage keeps its first cached count

    def start_from(self, caches: list, cached: int) -> None:
        """Continue from a cached prefix of ``cached`` tokens. Only before the joiner advanced:
        its own caches are then untouched and can simply be replaced."""
        prompt = self.row.request.prompt_ids
        if cached > self.done:
            self.row.feed_history(mx.array(prompt[self.done : cached]))  # processors see the whole prompt
        self.caches, self.done = caches, cached
        if not self.resumed:
            self.row.output.cached_tokens = cached

    @property
    def is_prefilled(self) -> bool:
        """All but the last prompt token are in the caches: ready for token 0."""
        return self.done >= len(self.row.request.prompt_ids) - 1




def _gathered(joiners: list[_Joiner]) -> tuple[list, bool]:
    """(caches, batched): a lone joiner's own caches (the serial lane's graph), or all merged."""
    if len(joiners) == 1:
        return joiners[0].caches, False
    return merge_solo_rows([j.caches for j in joiners]), True


class BatchScheduler(MemoryShedding):
    def __init__(self, model, tokenizer, footprint: KvFootprint, config: SchedulerConfig,
                 on_finish: Callable[[Row], None] = lambda row: None, prompt_cache=None,
                 scheme: KvScheme = NATIVE, evaluator: Evaluator | None = None,
                 grammar_timing: GrammarTiming | None = None):
        self.model = model
        self.scheme = scheme  # KV representation: joiners convert where the serial lane does
        self.prompt_cache = prompt_cache  # store.PromptCache: joiners take at admission, rows put at finish
        self.tokenizer = tokenizer
        self.grammar_timing = grammar_timing  # rows with a grammar add their mask time here
        self.footprint = footprint
        self.config = config

        def finished(row: Row) -> None:
            self._times_preempted.pop(row.request.request_id, None)
            on_finish(row)

        self._on_finish = finished
        self._joiners: list[_Joiner] = []
        self._rows: list[Row] = []
        self._caches: list | None = None  # solo caches when one row runs, batched otherwise
        self._batched = False
        self._pending: tuple[mx.array, list, list[bool]] | None = None  # (tokens, logprobs, already emitted)
        self.timing = DecodeTiming()  # each decode step timed in its parts (/stats.batch.decode_timing)
        self.phases = PhaseTiming()  # prefill and join wall time (/stats.batch.phase_timing)
        self.submitted_rows = 0
        self.shared_prefills = 0  # joiners that waited for another joiner's prefill instead of repeating it
        self.faults = evaluator or Evaluator()  # evaluations retried once on an allocation failure
        self.caps = LoadCaps(config.max_rows, config.prompt_concurrency)  # lowered by memory faults
        self._preempted: list[Row] = []  # rows whose KV was dropped, oldest first: readmitted before new work
        self._times_preempted: dict[str, int] = {}  # request id -> requeues so far

    # --- state the engine reads -------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self._rows)

    @property
    def num_prefilling(self) -> int:
        return len(self._joiners)

    @property
    def num_preempted(self) -> int:
        return len(self._preempted)

    @property
    def is_idle(self) -> bool:
        return not self._rows and not self._joiners and not self._preempted

    def projected_bytes(self, extra: Request | None = None) -> int:
        """Worst-case KV bytes of every row (and ``extra``) at prompt + max_tokens, plus prefill transients."""
        lengths = [len(r.request.prompt_ids) + r.request.max_tokens for r in self._all_rows()]
        prefilling = [len(j.row.request.prompt_ids) for j in self._joiners]
        if extra is not None:
            lengths.append(len(extra.prompt_ids) + extra.max_tokens)
            prefilling.append(len(extra.prompt_ids))
        return self.footprint.batch_bytes(lengths) + sum(self.footprint.prefill_bytes(n) for n in prefilling)

    def can_admit(self, request: Request) -> bool:
        if self._preempted or len(self._rows) + len(self._joiners) >= self.caps.rows:
            return False
        if len(self._joiners) >= self.config.prompt_concurrency:
            return False
        if self._joiners and self.transient_bytes(request) > (self.config.transient_budget_bytes or float("inf")):
            return False  # a lone joiner always runs: only joiners together are held to the reserve
        if not self._fits_memory_now(len(request.prompt_ids), request.max_tokens, request):
            return False
        budget = self.config.kv_budget_bytes
        return budget is None or self.projected_bytes(request) <= budget

    def transient_bytes(self, extra: Request | None = None) -> int:
        """The worst prefill step of the joiners (and ``extra``): activations, logits, attention scores."""
        prompts = [len(j.row.request.prompt_ids) for j in self._joiners]
        if extra is not None:
            prompts.append(len(extra.prompt_ids))
        return joiners_transient(self.config.shape, prompts, self.config.prefill_step_size, self.caps.group)

    def _all_rows(self) -> list[Row]:
        return self._rows + [j.row for j in self._joiners]

    # --- intake -------------------------------------------------------------------
    def add(self, request: Request, emit) -> None:
        self._enter(_Joiner(make_row(request, self.tokenizer, emit, self.grammar_timing), []))
        self.submitted_rows += 1

    def _enter(self, joiner: _Joiner) -> None:
        request = joiner.row.request
        if self.prompt_cache is None:
            joiner.caches = make_prompt_cache(self.model)
        else:
            # RAM now; a longer prefix on disk is read a tensor per step (running rows keep decoding).
            caches, cached = self.prompt_cache.take(request.namespace, request.prompt_ids, cold=False)
            joiner.start_from(caches or make_prompt_cache(self.model), cached)
            if self.prompt_cache.cold is not None:
                joiner.restore = self.prompt_cache.cold.begin_restore(request.namespace, request.prompt_ids, cached)
            if joiner.restore is None:
                self._follow_a_leader(joiner)
        self._joiners.append(joiner)

    def _follow_a_leader(self, joiner: _Joiner) -> None:
        """Agents that arrive together with the same long prefix: prefill it once.

        If a joiner still prefilling shares at least MIN_SHARED_PREFILL uncached tokens
        with this one, this one waits until that prefix reaches the prompt cache and
        takes it from there. Full-attention caches trim, so the leader's whole prompt
        state serves any shared prefix (put when the leader's prefill ends, computed in
        the chunks it would have used anyway). Sliding-window and recurrent state exists
        only at the points the leader snapshots: the end of its system prompt.
        """
        request = joiner.row.request
        prompt = request.prompt_ids
        for leader in self._joiners:
            if (leader.leader is not None or leader.restore is not None
                    or leader.row.request.namespace != request.namespace):
                continue
            theirs = leader.row.request.prompt_ids
            shared = common_prefix(prompt, theirs, min(len(prompt), len(theirs)) - 1)
            if is_trimmable(leader.caches):
                wait_until = len(theirs) - 1
            else:
                split = leader.row.request.snapshot_at
                wait_until = shared = split if split is not None and split <= shared else 0
            if shared - joiner.done >= MIN_SHARED_PREFILL and leader.done < wait_until:
                joiner.leader, joiner.wait_until = leader, wait_until
                leader.followers += 1
                self.shared_prefills += 1
                return

    def _waiting(self, joiner: _Joiner) -> bool:
        """Still waiting for its leader? Once released, take the shared prefix from the prompt cache."""
        leader = joiner.leader
        if leader is None:
            return False
        if leader in self._joiners and leader.done < joiner.wait_until:
            return True
        joiner.leader = None
        request = joiner.row.request
        caches, cached = self.prompt_cache.take(request.namespace, request.prompt_ids, cold=False)
        if caches is not None and cached > joiner.done:  # it never advanced while it waited
            joiner.start_from(caches, cached)
        return False

    def fail_all(self, message: str) -> None:
        for row in self._all_rows() + self._preempted:
            row.output.finish(FinishReason.ERROR, error=message)
            self._on_finish(row)
        self._joiners, self._rows, self._caches, self._pending, self._batched = [], [], None, None, False
        self._preempted = []

    # --- memory faults: requeue, recompute later (engine/preempt.py decides) ------------
    def _readmit(self) -> None:
        while (self._preempted and len(self._rows) + len(self._joiners) < self.caps.rows
               and len(self._joiners) < self.config.prompt_concurrency
               and self._fits_memory_now(*resumed_size(self._preempted[0]), self._preempted[0].request)):
            row = self._preempted.pop(0)
            self._enter(_Joiner(resume_row(row), [], resumed=True))

    # --- one iteration ------------------------------------------------------------
    def step(self) -> None:
        self._purge_cancelled()
        self._readmit()
        if self._joiners:
            self.timing.interrupt()  # prefill work sits between these decode steps
        ready = self._prefill()
        if ready:
            start = time.perf_counter()
            self._start_decoding(ready)
            self.phases.add_join(time.perf_counter() - start)
        if len(self._rows) > 1:
            self._shed_before_decode()
        if self._rows:
            keys = [row.key for row in self._rows]  # sampler state before this step, should it be redone
            try:
                self._decode_step()
                self.caps.step_ok()
            except MemoryFault as fault:
                self._preempt_running(keys, fault)
            except Exception as exc:
                log.error("decode step failed; failing %d rows", len(self._rows), exc_info=True)
                rows = self._rows
                self._rows, self._caches, self._pending, self._batched = [], None, None, False
                for row in rows:
                    row.output.finish(FinishReason.ERROR, error=f"batch decode failed: {type(exc).__name__}: {exc}")
                    self._on_finish(row)
                release_cached_memory()
        if self.is_idle and self.caps.lowered:
            self.caps.reset()

    def _purge_cancelled(self) -> None:
        for joiner in [j for j in self._joiners if j.row.request.cancelled.is_set()]:
            self._joiners.remove(joiner)
            joiner.row.output.finish(FinishReason.CANCELLED)
            self._on_finish(joiner.row)
        for row in [r for r in self._preempted if r.request.cancelled.is_set()]:
            self._preempted.remove(row)
            row.output.finish(FinishReason.CANCELLED)
            self._on_finish(row)
        # Running rows are cancelled at emit time, where their pending token is dropped.

    def _prefill(self) -> list[_Joiner]:
        """Advance joiners one chunk each, FIFO, within one chunk's worth of tokens per step.

        The chunks of several joiners run as one forward (right-padded, as mlx-lm's
        BatchGenerator prompts a batch with history), each with the chunk boundaries
        it would have alone. Returns the joiners whose prompt, all but its last token,
        is now in their caches.
        """
        budget = self.config.prefill_step_size
        group = []
        for joiner in self._joiners:
            if joiner.restore is not None:
                self._restore_step(joiner)
                continue
            if self._waiting(joiner) or joiner.is_prefilled or budget <= 0 or len(group) >= self.caps.group:
                continue
            group.append(joiner)
            budget -= self._chunk_len(joiner)
        start = time.perf_counter()
        together = len(group) > 1 and not self.scheme.quantized
        if together:
            try:
                self._advance_together(group)
            except MemoryFault:
                # Their own caches are untouched (the batch was a merged copy): the newest sit out.
                keep, _ = split_prefill_group(len(group))
                log.warning("batched prefill of %d joiners out of memory; %d go on, one by one", len(group), keep)
                self.caps.lower_group(keep)
                self.caps.lower_rows(len(self._rows) + len(self._joiners))  # admit no more until it drains
                group, together = group[:keep], False
            except Exception:
                # Find the joiner at fault: each one alone (their caches are untouched until success).
                log.warning("batched prefill of %d joiners failed; retrying one by one", len(group), exc_info=True)
                together = False
        if not together:
            for joiner in group:
                try:
                    self._advance(joiner)
                except MemoryFault:
                    self.caps.lower_rows(len(self._rows) + len(self._joiners) - 1)  # admit no more until it drains
                    self._joiners.remove(joiner)  # its caches took part of the failed forward: start over
                    self._requeue([joiner.row])
                except Exception as exc:
                    self._fail_joiners([joiner], "prefill", exc)
        if group:
            self.phases.add_prefill(time.perf_counter() - start)
        ready = []
        for joiner in list(self._joiners):
            if joiner in group and joiner.is_prefilled:
                self._snapshot(joiner)
            if joiner.is_prefilled and joiner.leader is None and joiner.restore is None:
                self._joiners.remove(joiner)
                ready.append(joiner)
        return ready

    def _restore_step(self, joiner: _Joiner) -> None:
        """Read one more tensor of the joiner's prefix from disk; once all are in, start from there."""
        try:
            done = self.prompt_cache.cold.advance_restore(joiner.restore)
        except Exception:  # a restore never fails the request: it prefills instead
            log.exception("SSD restore failed; prefilling instead")
            joiner.restore = None
            return
        if not done:
            return
        pending, joiner.restore = joiner.restore, None
        if pending.entry is None:
            return  # the file was bad (and is gone): prefill from what RAM gave
        caches = self.prompt_cache.adopt_restored(joiner.row.request.namespace, pending.entry, pending.n, joiner.done)
        joiner.start_from(caches, pending.n)  # it never advanced while it restored

    def _chunk_len(self, joiner: _Joiner) -> int:
        """The next chunk: the serial lane's boundaries (mlx-lm generate_step), cut at a snapshot point."""
        n = min(self.config.prefill_step_size, len(joiner.row.request.prompt_ids) - 1 - joiner.done)
        split = self._split_at(joiner)
        return n if split is None else min(n, split - joiner.done)

    def _advance(self, joiner: _Joiner) -> None:
        """One chunk of prompt[:-1] on the joiner's own caches."""
        prompt = joiner.row.request.prompt_ids
        n = self._chunk_len(joiner)
        with mx.stream(generation_stream):
            chunk = mx.array(prompt[joiner.done : joiner.done + n])
            self.model(chunk[None], cache=joiner.caches)
            self.scheme.convert(joiner.caches)  # the serial lane's (mlx-lm's) conversion point
            self.faults.run("prefill", lambda: mx.eval([c.state for c in joiner.caches]))
        self._advanced(joiner, n)

    def _advance_together(self, group: list[_Joiner]) -> None:
        """One chunk for each joiner in ``group`` from one forward, then back to solo caches.

        Rows are merged (history right-aligned), the chunks right-padded and the
        caches told the real lengths (``prepare``/``finalize``, so padding never
        displaces a ring's tokens or a recurrent state), then each row is extracted.
        """
        lengths = [self._chunk_len(j) for j in group]
        longest = max(lengths)
        chunks = [j.row.request.prompt_ids[j.done : j.done + n] for j, n in zip(group, lengths, strict=True)]
        with mx.stream(generation_stream):
            caches = merge_solo_rows([j.caches for j in group])
            padding = [longest - n for n in lengths]
            if any(padding):
                for cache in caches:
                    cache.prepare(lengths=lengths, right_padding=padding)
            tokens = mx.array([c + [0] * (longest - len(c)) for c in chunks])
            self.model(tokens, cache=caches)
            if any(padding):
                for cache in caches:
                    cache.finalize()
            self.faults.run("prefill", lambda: mx.eval([c.state for c in caches]))
            rows = [extract_row(caches, i) for i in range(len(group))]
        for joiner, row_caches, n in zip(group, rows, lengths, strict=True):  # only once everything succeeded
            joiner.caches = row_caches
            self._advanced(joiner, n)

    def _advanced(self, joiner: _Joiner, n: int) -> None:
        """Bookkeeping after a chunk: processor history, snapshot at a system-prompt end, allocator."""
        prompt = joiner.row.request.prompt_ids
        split = self._split_at(joiner)
        joiner.row.feed_history(mx.array(prompt[joiner.done : joiner.done + n]))
        joiner.done += n
        if split is not None and joiner.done == split:
            # The end of a shared system prompt: other agents start from this entry.
            self.prompt_cache.put(joiner.row.request.namespace, prompt[:split], joiner.caches)
        if n == self.config.prefill_step_size:
            # A long prompt: release the chunk's transient buffers (the serial lane does
            # the same). Short prompts skip it, so a burst of joiners does not make the
            # allocator give back and re-acquire the running batch's buffers each time.
            mx.clear_cache()

    def _start_decoding(self, ready: list[_Joiner]) -> None:
        """Prefilled joiners join the batch with their last prompt token as pending input.

        The batch's next decode step then computes their token 0 together with every
        running row's next token, and hands it out as soon as that step is done: one
        forward and one host sync per burst of arrivals (on a GPU a separate token-0
        forward streams all the weights again). The row's math is the serial lane's:
        the last prompt token fed on caches holding the rest of the prompt. One-token
        prompts have empty caches, which do not merge: they take ``_first_tokens``,
        as every joiner does when ``token0_in_decode`` is off (the CPU).
        """
        if not self.config.token0_in_decode:
            self._first_tokens(ready)
            return
        empty = [j for j in ready if j.done == 0]
        if empty:
            self._first_tokens(empty)
        joining = [j for j in ready if j.done > 0]
        if not joining:
            return
        try:
            caches, batched = _gathered(joining)
        except Exception as exc:
            self._fail_joiners(joining, "join", exc)
            return
        lasts = mx.array([j.row.request.prompt_ids[-1] for j in joining], dtype=mx.uint32)
        self._join([j.row for j in joining], caches, batched, lasts, [None] * len(joining))

    def _first_tokens(self, ready: list[_Joiner]) -> None:
        """Token 0 of ready joiners from one forward of their last prompt tokens, then join.

        Used for every joiner when ``token0_in_decode`` is off, and for one-token
        prompts always. One joiner runs on its own caches (the serial lane's graph);
        several are merged first, so a burst of arrivals costs one forward, not one
        each. Token 0 is emitted before the rows join; a row that ends there never joins.
        """
        if self.scheme.quantized and len(ready) > 1 and any(j.done == 0 for j in ready):
            # One-token prompts reach token 0 with empty caches, which the serial lane quantizes
            # only after this forward: run each of those alone, in the same order.
            for joiner in ready:
                self._first_tokens([joiner])
            return
        keys = [j.row.key for j in ready]
        try:
            caches, batched = _gathered(ready)
            lasts = mx.array([j.row.request.prompt_ids[-1] for j in ready])
            with mx.stream(generation_stream):
                logits = self.model(lasts[:, None], cache=caches)[:, -1, :]
                if not batched:
                    self.scheme.convert(caches)  # a one-token prompt: converted after this forward
                drawn = [j.row.sample(logits[i : i + 1], lasts[i : i + 1]) for i, j in enumerate(ready)]
                tokens = mx.concatenate([token for token, _ in drawn])
                logprobs = [lp.squeeze(0) for _, lp in drawn]
                self.faults.run("token0", lambda: mx.eval(tokens, logprobs))
        except MemoryFault:
            for joiner, key in zip(ready, keys, strict=True):
                joiner.row.key = key  # nothing was emitted: they draw again from the same state
            self._requeue([j.row for j in ready])
            return
        except Exception as exc:
            self._fail_joiners(ready, "first token", exc)
            return
        alive = []
        for i, (joiner, token) in enumerate(zip(ready, tokens.tolist(), strict=True)):
            if self._emit(joiner.row, token, logprobs[i]):
                alive.append(i)
            else:
                if not batched:
                    self._put(joiner.row, caches)
                self._on_finish(joiner.row)  # ended at token 0: never joins the batch
        if not alive:
            return
        if batched and len(alive) < len(ready):
            keep_rows(caches, alive)
        if batched and len(alive) == 1 and not self._rows:
            caches, batched = extract_row(caches, 0), False
        self._join([ready[i].row for i in alive], caches, batched,
                   tokens[mx.array(alive)], [logprobs[i] for i in alive])

    def _join(self, rows: list[Row], caches: list, batched: bool, tokens: mx.array, logprobs: list) -> None:
        """Add rows whose pending input (``tokens``) needs no emission: a token 0 already
        emitted, or the last prompt token. Their caches hold everything before it."""
        if not self._rows:
            # Adopt: a lone joiner keeps its own caches, zero copy, and runs the serial graph.
            self._caches, self._batched, self._rows = caches, batched, rows
            self._pending = (tokens, logprobs, [True] * len(rows))
            return
        if not self._batched:
            self._caches, self._batched = merge_solo_rows([self._caches]), True
        extend_batch(self._caches, caches if batched else merge_solo_rows([caches]))
        pending_tokens, pending_lps, emitted = self._pending
        self._pending = (
            mx.concatenate([pending_tokens, tokens]),
            pending_lps + logprobs,
            emitted + [True] * len(rows),
        )
        self._rows += rows

    def _split_at(self, joiner: _Joiner) -> int | None:
        """Where to stop a chunk for a system-prompt snapshot (the serial lane stops at the same place)."""
        split = joiner.row.request.snapshot_at
        prompt = joiner.row.request.prompt_ids
        if (self.prompt_cache is None or split is None or is_trimmable(joiner.caches)
                or not joiner.done < split < len(prompt) - 1 or split < MIN_SNAPSHOT_TOKENS):
            return None
        return split

    def _snapshot(self, joiner: _Joiner) -> None:
        """Sliding-window / recurrent models: store the state at the prompt boundary (all but its last token).

        Full-attention models store at finish, unless joiners wait on this prompt now."""
        boundary = len(joiner.row.request.prompt_ids) - 1
        if self.prompt_cache is None or boundary < MIN_SNAPSHOT_TOKENS:
            return
        if is_trimmable(joiner.caches) and not joiner.followers:
            return
        self.prompt_cache.put(joiner.row.request.namespace, joiner.row.request.prompt_ids[:boundary], joiner.caches)

    def _put(self, row: Row, caches: list) -> None:
        """Store a finished row's prefix: the tokens its caches hold (prompt, then generated)."""
        if self.prompt_cache is None or not is_trimmable(caches):
            return
        fed = caches[0].offset
        first = row.output.request  # the request as submitted (a resumed row's prompt holds its tokens)
        try:
            self.prompt_cache.put(first.namespace, (first.prompt_ids + row.output.tokens)[:fed], caches)
        except Exception as exc:  # storing is an optimization: short of memory, skip it
            if not is_allocation_failure(exc):
                raise
            log.warning("prompt cache put skipped: %s", exc)
            release_cached_memory()

    def _fail_joiners(self, joiners: list[_Joiner], phase: str, exc: Exception) -> None:
        log.error("%s failed for %d joiner(s)", phase, len(joiners), exc_info=True)
        for joiner in joiners:
            if joiner in self._joiners:
                self._joiners.remove(joiner)
            joiner.row.output.finish(FinishReason.ERROR, error=f"{phase} failed: {type(exc).__name__}: {exc}")
            self._on_finish(joiner.row)
        release_cached_memory()

    def _decode_step(self) -> None:
        start = time.perf_counter()
        inputs, logprobs_now, emitted = self._pending
        with mx.stream(generation_stream):
            logits = self.model(inputs[:, None], cache=self._caches)[:, -1, :]
            next_tokens, next_logprobs = self._sample(logits, inputs)
        built = time.perf_counter()
        self.faults.run("decode", lambda: mx.async_eval(next_tokens, next_logprobs))
        # Read step n while step n+1 runs: one transfer for every row's token.
        submitted = time.perf_counter()
        tokens = inputs.tolist()
        waited = time.perf_counter() - submitted
        keep = []
        for i, row in enumerate(self._rows):
            if emitted[i]:
                keep.append(i)
                continue
            if self._emit(row, tokens[i], logprobs_now[i]):
                keep.append(i)
        done_now = [False] * len(self._rows)
        joined = [i for i in keep if self._rows[i].awaiting_first]
        if joined:
            # This step computed token 0 of rows that joined before it: hand it out now, not one
            # step later (time to first token). Waiting drains the pipeline once per admission.
            read_at = time.perf_counter()
            drawn = next_tokens.tolist()
            waited += time.perf_counter() - read_at
            for i in joined:
                row = self._rows[i]
                done_now[i] = True
                if not self._emit(row, drawn[i], next_logprobs[i]):
                    keep.remove(i)
        self._pending = (next_tokens, next_logprobs, done_now)
        if len(keep) < len(self._rows):
            self._evict(keep)
        self.timing.record(start, built, submitted, waited)
        if self.timing.steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        if not self._rows:
            self.timing.interrupt()  # the batch ran dry: the next step starts after an idle gap

    def _sample(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list]:
        def start(*arrays: mx.array) -> None:  # the forward (and free rows' draws) run while masks are built
            self.faults.run("decode", lambda: mx.async_eval(*arrays))

        return sample_step(self._rows, logits, inputs, start, self.grammar_timing)

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
                if self.prompt_cache is not None:
                    # A merged row is copied out before the filter drops it; a lone row lends its own.
                    self._put(row, extract_row(self._caches, i) if self._batched else self._caches)
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
