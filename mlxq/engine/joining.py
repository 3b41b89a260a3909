"""Prefilled joiners become running rows: token 0, then the join into the running batch.

A mixin of BatchScheduler (engine/scheduler.py). On a GPU a joiner joins
with its last prompt token as pending input, so the batch's next decode step
computes its token 0 together with every running row's next token (one
forward and one host sync per burst of arrivals; a separate token-0 forward
would stream all the weights again). On the compute-bound CPU a forward of
the joiners alone is cheaper than a batch step, so token 0 comes from that
forward before they join (``SchedulerConfig.token0_in_decode``). One-token
prompts have empty caches, which do not merge: they always take that path.
Either way the row's math is the serial lane's: the last prompt token fed on
caches holding the rest of the prompt. After each join the rows on one
leased prefix may be grouped to read it once (engine/prefix_sharing.py);
joiners on a running group's prefix join it by reference, before any merge.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlxq.engine.faults import MemoryFault, is_allocation_failure, release_cached_memory
from mlxq.engine.joiners import Joiner
from mlxq.engine.prefix_sharing import choose_groups, join_in_place
from mlxq.engine.rows import Row
from mlxq.engine.running_batch import Pending
from mlxq.engine.types import FinishReason
from mlxq.kv.batch_ops import extract_row, keep_rows, merge_solo_rows
from mlxq.models.multi_lora import adapter_rows
from mlxq.store.prefix import finish_tokens

log = logging.getLogger("mlxq.scheduler")


def _gathered(joiners: list[Joiner]) -> tuple[list, bool]:
    """(caches, batched): a lone joiner's own caches (the serial lane's graph), or all merged."""
    if len(joiners) == 1:
        return joiners[0].caches, False
    return merge_solo_rows([j.caches for j in joiners]), True


def _let_go_of_solo_caches(joiners: list[Joiner]) -> None:
    """Joiners about to take token 0 in one batch let go of their own caches: nothing reads them after
    (a row that ends at token 0 is stored only when it ran alone; a failed forward requeues rows, which
    recompute their KV). Those of a wave that joins in the batch its tails prefilled in are views into
    that batch (tail_placement.PlacedRows): alive at the token-0 forward, they made MLX copy every
    layer's whole batch instead of writing its K/V in place (on the CPU, 7 agents on a ~520-token
    prompt: 124-169 ms for the forward against 55-58 ms without them, docs/benchmarks.md)."""
    for joiner in joiners:
        joiner.caches = None


class Joining:
    """Token 0 and the join (mixed into BatchScheduler)."""

    def _start_decoding(self, ready: list[Joiner]) -> None:
        """Prefilled joiners join the batch, their token 0 from its next decode step or from their own forward."""
        if not self.config.token0_in_decode:
            self._first_tokens(ready)
            return
        empty = [j for j in ready if j.done == 0]
        if empty:
            self._first_tokens(empty)
        joining = self._join_shared_tails([j for j in ready if j.done > 0])
        if not joining:
            return
        pending = Pending.prompt_ends([j.prompt for j in joining])
        if self._join_group([j.row for j in joining], lambda: [j.caches for j in joining], pending):
            return
        if not self.batch and self._start_grouped([j.row for j in joining], lambda: [j.caches for j in joining],
                                                  pending):
            return
        try:
            caches, batched = self._joining_caches(joining)
        except Exception as exc:
            self._fail_joiners(joining, "join", exc)
            return
        self.batch.join([j.row for j in joining], caches, batched, pending)
        self._share_prefix()

    def _first_tokens(self, ready: list[Joiner]) -> None:
        """Token 0 of ready joiners from one forward of their last prompt tokens, then join.

        One joiner runs on its own caches (the serial lane's graph); several are merged
        first, so a burst of arrivals costs one forward, not one each. Token 0 is emitted
        before the rows join; a row that ends there never joins.
        """
        if self.scheme.quantized and len(ready) > 1 and any(j.done == 0 for j in ready):
            # One-token prompts reach token 0 with empty caches, which the serial lane quantizes
            # only after this forward: run each of those alone, in the same order.
            for joiner in ready:
                self._first_tokens([joiner])
            return
        keys = [j.row.key for j in ready]
        try:
            caches, batched = self._joining_caches(ready)
            if batched:
                _let_go_of_solo_caches(ready)
            lasts = mx.array([j.prompt[-1] for j in ready])
            with mx.stream(generation_stream), adapter_rows(self.model, [j.row.request.adapter for j in ready]):
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
        if batched and len(alive) == 1 and not self.batch:
            caches, batched = extract_row(caches, 0), False
        rows = [ready[i].row for i in alive]
        pending = Pending(tokens[mx.array(alive)], [logprobs[i] for i in alive], [True] * len(alive))
        solo = (lambda: [extract_row(caches, i) for i in range(len(alive))]) if batched else (lambda: [caches])
        if self._join_group(rows, solo, pending):
            return
        self.batch.join(rows, caches, batched, pending)
        self._share_prefix()

    def _joining_caches(self, joiners: list[Joiner]) -> tuple[list, bool]:
        """(caches, batched) for ``joiners``: the batch their last chunks ran in when it holds exactly
        them (engine/wave_caches.py: no copy), else their own caches gathered."""
        kept, self._prefilled_together = self._prefilled_together, None
        copies = self.batch.copies
        if kept is not None and len(joiners) > 1 and kept.serves(joiners):
            copies.kept += len(joiners)
            return kept.caches, True
        if len(joiners) > 1:
            copies.gathered += len(joiners)
        return _gathered(joiners)

    def _join_group(self, rows: list[Row], solo_caches, pending: Pending) -> bool:
        """Rows join the running shared-prefix groups in place (``solo_caches()``: their solo cache
        lists); False when there is no group to keep, or better ones need a rebuild."""
        if not self.batch.groups or self.sharing is None:
            return False
        leases = lambda rs: [self._leases.get(row.request.request_id) for row in rs]  # noqa: E731
        into = join_in_place(self.batch.groups, leases(self.batch.rows), leases(rows), self.sharing)
        if into is None:
            return False
        try:
            self.batch.join_group(rows, solo_caches(), into, pending, self.sharing.plan)
        except Exception:  # nothing changed yet (join_group checks first): join the usual way
            log.warning("%d row(s) not joined to the shared-prefix groups", len(rows), exc_info=True)
            return False
        self.sharing_stats.rows_joined += sum(g >= 0 for g in into)
        return True

    def _start_grouped(self, rows: list[Row], solo, pending: Pending) -> bool:
        """Into an empty batch, rows on a leased prefix are grouped straight from their solo caches
        (``solo()``): a burst of agents never holds a merged copy of every row's prefix
        (``RunningBatch.start_grouped``)."""
        policy = self.sharing
        if policy is None or policy.mode == "off" or len(rows) < 2:
            return False
        groups = choose_groups([self._leases.get(row.request.request_id) for row in rows], policy)
        if not groups:
            return False
        try:
            self.batch.start_grouped(rows, solo(), groups, policy.plan, pending)
        except Exception:  # nothing changed yet: the usual join, then the usual grouping
            log.warning("shared-prefix groups of %d joiners not built", len(rows), exc_info=True)
            return False
        self.sharing_stats.groups += len(self.batch.groups)
        return True

    def _share_prefix(self) -> None:
        """After a join: let the rows on a leased prefix read it once (engine/prefix_sharing.py)."""
        policy = self.sharing
        if policy is None or policy.mode == "off" or not self.batch.batched:
            return
        leases = [self._leases.get(row.request.request_id) for row in self.batch.rows]
        groups = choose_groups(leases, policy)
        if not groups:
            self.sharing_stats.note_declined(policy.auto_declines(leases) if not self.batch.groups else None)
            return
        try:
            self.batch.share(groups, policy.plan)
        except Exception:  # an optimization: the per-row caches the join left stay in place
            log.warning("shared-prefix groups of %d rows not built", sum(g.rows for g in groups), exc_info=True)
            return
        self.sharing_stats.groups += len(self.batch.groups)

    @contextlib.contextmanager
    def _puts_together(self, views: bool) -> Iterator[None]:
        """The finishing rows' puts inside it evaluated once, when it ends, if they store from ``views``
        into the batch (``PromptCache.defer_evaluation``: one device sync for a step's rows, where each
        put waited for its own); rows copied out of the batch (a shared-prefix group's, each its prefix
        and tail joined) are evaluated one by one, so no two such copies are held at once. Short of
        memory, the puts are skipped as one put is (``_put``)."""
        if self.prompt_cache is None or not views:
            yield
            return
        self.prompt_cache.defer_evaluation()
        try:
            yield
        finally:
            try:
                self.prompt_cache.evaluate_deferred()
            except Exception as exc:
                if not is_allocation_failure(exc):
                    raise
                log.warning("prompt cache puts skipped: %s", exc)
                release_cached_memory()

    def _put(self, row: Row, caches: list) -> None:
        """Store a finished row's prefix as the prefix policy says (store/prefix.py)."""
        if self.prompt_cache is None:
            return
        first = row.output.request  # the request as submitted (a resumed row's prompt holds its tokens)
        tokens = finish_tokens(first.prompt_ids + row.output.tokens, caches)
        if tokens is None:
            return
        try:
            self.prompt_cache.put(first.namespace, tokens, caches)
        except Exception as exc:  # storing is an optimization: short of memory, skip it
            if not is_allocation_failure(exc):
                raise
            log.warning("prompt cache put skipped: %s", exc)
            release_cached_memory()

    def _fail_joiners(self, joiners: list[Joiner], phase: str, exc: Exception) -> None:
        log.error("%s failed for %d joiner(s)", phase, len(joiners), exc_info=True)
        for joiner in joiners:
            self.joiners.remove(joiner)
            joiner.row.output.finish(FinishReason.ERROR, error=f"{phase} failed: {type(exc).__name__}: {exc}")
            self._on_finish(joiner.row)
        release_cached_memory()
