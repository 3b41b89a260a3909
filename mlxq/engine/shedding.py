"""The batch lane under memory pressure: shed rows before a step, requeue them after a fault.

A mixin of BatchScheduler (engine/scheduler.py), kept apart because it is one
idea: what happens to rows when memory runs short. The decisions are plain
data in engine/preempt.py; here they are carried out on the scheduler's rows,
caches and pending tokens (its RunningBatch). A preempted row keeps its output and PRNG key and
waits (oldest first, ahead of new requests) until the scheduler's ``_readmit``
resumes it as a joiner whose prompt holds its emitted tokens (rows.resume_row).
"""

from __future__ import annotations

import logging

import mlx.core as mx

from mlxq.engine.faults import MemoryFault, release_cached_memory
from mlxq.engine.preempt import MAX_PREEMPTIONS, plan_decode_preemption, rows_that_fit
from mlxq.engine.rows import Row
from mlxq.engine.shared_accounting import running_credits
from mlxq.engine.step_plan import Extent
from mlxq.engine.transient import decode_step_bytes
from mlxq.engine.types import FinishReason

log = logging.getLogger("mlxq.scheduler")


def resumed_size(row: Row) -> tuple[int, int]:
    """(prompt, max_tokens) of a preempted row once resumed (rows.resume_row), without resuming it."""
    first, done = row.output.request, row.output.num_generated
    return len(first.prompt_ids) + done, max(1, first.max_tokens - done)


class MemoryShedding:
    """Rows give way when memory runs short (mixed into BatchScheduler)."""

    def _preempt_running(self, keys: list, fault: MemoryFault) -> None:
        """A decode step failed twice for memory: every running row's KV went with it.

        Tokens computed before the step but not yet handed out are emitted first, the
        sampler state goes back to before the step, and the rows are requeued to be
        recomputed from their tokens; the most recently admitted wait for room.
        """
        self.publish_staged()  # links staged by the previous step: a row that fails now keeps its newest
        pending = self.batch.pending
        tokens = pending.tokens.tolist()  # evaluated by the previous step
        rows = self.batch.clear()
        release_cached_memory()
        requeue = []
        for i, row in enumerate(rows):
            row.key = keys[i]
            if not pending.emitted[i] and not self._emit(row, tokens[i], pending.logprobs[i]):
                self._on_finish(row)
                continue
            requeue.append(row)
        plan = plan_decode_preemption([self._times_preempted.get(r.request.request_id, 0) for r in requeue],
                                      self.caps.rows)
        log.warning("decode step out of memory (%s): %d rows requeued, row cap %d",
                    fault.cause, len(requeue), plan.row_cap)
        self.caps.lower_rows(plan.row_cap)
        self._requeue([requeue[i] for i in plan.resume_first + plan.held_back])
        self._fail_out_of_memory([requeue[i] for i in plan.failed], fault)

    def _shed_before_decode(self) -> None:
        """Preempt the newest rows before a decode step that would pass the memory limit."""
        limit = self.config.memory_limit_bytes
        if limit is None:
            return
        lengths = [len(r.output.request.prompt_ids) + r.output.num_generated for r in self.batch.rows]
        shared = running_credits(self.batch.groups, len(lengths))  # a group's prefix is held once
        kv_now = self.sizing.kv_bytes([Extent(n, 0, *credit) for n, credit in zip(lengths, shared, strict=True)])
        grown = self.sizing.kv_bytes([Extent(n, 1, *credit) for n, credit in zip(lengths, shared, strict=True)])
        growth = grown - kv_now + kv_now // len(self.footprint.layers)
        keep = rows_that_fit(mx.get_active_memory(), limit, len(lengths), kv_now, growth,
                             decode_step_bytes(self.config.shape, max(lengths)))
        if keep < len(self.batch):
            log.warning("decode step would pass the memory limit: %d newest of %d rows preempted",
                        len(self.batch) - keep, len(self.batch))
            self._drop_newest(keep)

    def _drop_newest(self, keep: int) -> None:
        """Requeue rows[keep:] (their KV dropped, tokens computed but not handed out emitted first)."""
        pending = self.batch.pending
        tokens = pending.tokens.tolist() if not all(pending.emitted[keep:]) else None
        requeue = []
        for i in range(keep, len(self.batch)):
            row = self.batch.rows[i]
            if not pending.emitted[i] and not self._emit(row, tokens[i], pending.logprobs[i]):
                self._on_finish(row)
                continue
            requeue.append(row)
        self.batch.keep(list(range(keep)))
        self.caps.lower_rows(keep)
        self._requeue(requeue)

    def _requeue(self, rows: list[Row]) -> None:
        """Rows without KV wait ahead of new requests, in submission order, to be recomputed;
        they let go of their prompt-cache lease (a new one is taken when they come back)."""
        for row in rows:
            self._let_go(row)
            rid = row.request.request_id
            times = self._times_preempted.get(rid, 0)
            if times >= MAX_PREEMPTIONS:
                self._fail_out_of_memory([row], None)
                continue
            self._times_preempted[rid] = times + 1
            self.faults.counters.preemptions += 1
            self._preempted.append(row)
        self._preempted.sort(key=lambda r: r.request.submitted_at)

    def _fail_out_of_memory(self, rows: list[Row], fault: MemoryFault | None) -> None:
        for row in rows:
            self.faults.counters.failed_out_of_memory += 1
            cause = f": {fault.cause}" if fault is not None else ""
            row.output.finish(FinishReason.ERROR, error=f"out of memory after {MAX_PREEMPTIONS} requeues{cause}")
            self._on_finish(row)
