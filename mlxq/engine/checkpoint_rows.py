"""Generation checkpoints in the batch lane: rows publish as they decode, a restored row joins as a joiner.

A mixin of BatchScheduler (engine/scheduler.py). After a decode step a row
that goes on stands where a serial checkpoint does: its caches hold the
prompt and every token it handed out, and the step drew its next (pending)
token. A due row's new span is copied out of the batch through a view of
the row (nothing else of it is copied), staged behind that step and
published in the next one with that token and the row's own PRNG key
(engine/checkpoint_staging.py, engine/checkpointing.py). Rows that joined
together reach their interval together: a step stages a few of them, so
their copies spread over several steps.

An identical request replays its checkpoint through its output, then enters
as a joiner whose prompt is the prompt plus the tokens handed out, whose
caches hold all but the last of them (the pending token) and whose key is
the one recorded: it joins with the pending token as its input, exactly
like a row resumed after a memory fault (rows.resume_row).
"""

from __future__ import annotations

import logging

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlxq.engine.checkpoint_spans import RowSpan, by_kernel, copy_spans, span_arrays, span_layers
from mlxq.engine.checkpoint_staging import IN_FLIGHT_BYTES, STAGE_BYTES_PER_STEP, LinkInFlight
from mlxq.engine.checkpointing import Checkpointing, StagedLink, restore_output
from mlxq.engine.joiners import Joiner
from mlxq.engine.rows import Row, resume_row
from mlxq.engine.types import FinishReason
from mlxq.kv.batch_ops import view_row

log = logging.getLogger("mlxq.checkpoints")

SPREAD_STEPS = 8  # a batch's due rows publish over this many steps


class RowCheckpoints:
    """Publish and restore (mixed into BatchScheduler, which sets ``checkpoints``)."""

    checkpoints: Checkpointing | None = None

    def _restored_joiner(self, row: Row) -> Joiner | None:
        """The row as a joiner continuing its checkpoint; None when it starts afresh (or ended in the replay)."""
        if self.checkpoints is None:
            return None
        row.checkpoint, restored = restore_output(row.output, self.checkpoints)
        if restored is None:
            return None
        if row.output.finished is not None:  # the pending token ended it
            self._on_finish(row)
            return None
        if row.key is not None and restored.rng_key is not None:
            row.key = restored.rng_key
        joiner = Joiner(resume_row(row), [], resumed=True)
        joiner.start_from(restored.caches, len(joiner.prompt) - 1)
        return joiner

    def publish_staged(self) -> None:
        """Hand links staged behind the last decode step to the writer now, not at the next step (which a
        flush, a shutdown or a preemption may not wait for): their pending tokens are read, waiting for
        that step if it still runs. A step that failed leaves them unpublished (the older links stay)."""
        if self.checkpoints is None or not len(self.checkpoints.batch_staged):
            return
        try:
            self.checkpoints.batch_staged.publish()
        except Exception:
            log.warning("checkpoint links staged in the last step not published", exc_info=True)

    def _clear_cache(self, due: bool) -> None:
        """MLX's cache cleared when ``due`` (the periodic clear); checkpoint buffers the host read are let go
        right before it, so it frees them (store/spent_buffers.py), also when too many wait or the batch
        ran dry."""
        spent = None if self.checkpoints is None else self.checkpoints.store.spent
        if spent is not None and spent.nbytes and (due or spent.over_cap() or not self.batch.rows):
            spent.release()
            mx.clear_cache()
        elif due:
            mx.clear_cache()

    def _publish_checkpoints(self, keep: list[int], handed_out: list[bool], next_tokens: mx.array,
                             fed: list[int], fed_emitted: list[bool]) -> None:
        """Links staged in the last step publish (engine/checkpoint_staging.py); rows going on whose
        interval is up stage theirs, the longest without a checkpoint first, at most
        ``publishes_per_step`` of them and ``STAGE_BYTES_PER_STEP`` of copies per step, while fewer than
        ``IN_FLIGHT_BYTES`` are on their way to disk; the others stay due, so rows that reached their
        interval together spread over the next steps. ``handed_out``: their next token already went out
        (token 0 in the step that computed it), so they are not at a checkpoint boundary this step. Rows
        cancelled in this step publish their last checkpoint at once when ``fed[i]``, this step's input,
        was not handed out (``fed_emitted[i]``: it had been); ``next_tokens[i]`` was drawn after it."""
        rows = self.batch.rows
        self.checkpoints.batch_staged.publish()
        kept = set(keep)
        cancelled = [i for i, row in enumerate(rows) if i not in kept and row.checkpoint is not None
                     and not fed_emitted[i] and row.output.finished is FinishReason.CANCELLED]
        pending = next_tokens.tolist() if cancelled else []
        for i in cancelled:
            row = rows[i]
            row.checkpoint.at_cancel(row.output, fed[i], pending[i], _key_of(row), self._row_for_checkpoint(i))
        self._stage_due(keep, handed_out, next_tokens)

    def _stage_due(self, keep: list[int], handed_out: list[bool], next_tokens: mx.array) -> None:
        rows = self.batch.rows
        due = sorted((i for i in keep if rows[i].checkpoint is not None and not handed_out[i]
                      and rows[i].checkpoint.is_due(rows[i].output)),
                     key=lambda i: rows[i].checkpoint.last - rows[i].output.num_generated)
        if not due or self.checkpoints.store.queued_bytes() >= IN_FLIGHT_BYTES:
            return
        due = due[:publishes_per_step(len(rows))]
        try:
            with mx.stream(generation_stream):  # right behind this step's forward, before the next one's
                items = self._staged_links(due, next_tokens)
                self.faults.injector.check("checkpoint")
                self.checkpoints.batch_staged.stage(items)
        except Exception:  # a checkpoint that cannot be copied is dropped, never the rows: they stay due
            log.warning("checkpoint links of %d rows not staged; they stay due", len(due), exc_info=True)
            self.checkpoints.store.note_dropped()
            return
        for item in items:
            item.checkpoint.taken(item.link.output)

    def _staged_links(self, due: list[int], next_tokens: mx.array) -> list[LinkInFlight]:
        """Due rows' links described (copies not evaluated), up to ``STAGE_BYTES_PER_STEP``."""
        rows = self.batch.rows
        arrays = span_arrays(self.batch.caches) if self.batch.batched else None
        aligned = arrays is not None and self._rows_end_together(due)
        links = self._stage_spans(due, arrays) if aligned else self._stage_views(due)
        return [LinkInFlight(rows[i].checkpoint, link, next_tokens, i, rows[i].key) for i, link in links]

    def _rows_end_together(self, due: list[int]) -> bool:
        """Every layer pads rows alike and each due row's tokens end where the batch's do: what the one-pass
        copy assumes (else the per-row copy). A resumed row's request holds the tokens it had emitted in
        its prompt (rows.resume_row): its output's request is the one submitted."""
        caches, rows = self.batch.caches, self.batch.rows
        paddings = self.checkpoints.batch_paddings.of(caches)
        return all(p == paddings[0] for p in paddings) and all(
            paddings[0][i] + len(rows[i].output.request.prompt_ids) + rows[i].output.num_generated == caches[0]._idx
            for i in due)

    def _stage_spans(self, due: list[int], arrays: list[mx.array]) -> list:
        """(row, link) of due rows copied in one pass (engine/checkpoint_spans.py), up to
        ``STAGE_BYTES_PER_STEP``."""
        rows, padding = self.batch.rows, self.checkpoints.batch_paddings.of(self.batch.caches)[0]
        per_token = len(arrays) * arrays[0].shape[1] * arrays[0].shape[3] * arrays[0].itemsize
        taken, nbytes = [], 0
        for i in due:
            if nbytes >= STAGE_BYTES_PER_STEP:
                break
            generated, start = rows[i].checkpoint.plan(rows[i].output)
            length = len(rows[i].output.request.prompt_ids) + len(generated) - start  # the prompt as submitted
            taken.append((i, generated, start, RowSpan(i, padding[i] + start, length)))
            nbytes += length * per_token
        tensors, packs = copy_spans(arrays, [span for *_, span in taken], host_side=True)
        if by_kernel(arrays):
            self.checkpoints.store.counters.kernel_links += len(taken)
        return [(i, StagedLink(rows[i].output, generated, start, span_layers(row_tensors, span.length), packs, True))
                for (i, generated, start, span), row_tensors in zip(taken, tensors, strict=True)]

    def _stage_views(self, due: list[int]) -> list:
        """(row, link) of due rows copied one by one through views of each row, up to
        ``STAGE_BYTES_PER_STEP``."""
        rows, links, nbytes = self.batch.rows, [], 0
        for i in due:
            if nbytes >= STAGE_BYTES_PER_STEP:
                break
            row = rows[i]
            link = row.checkpoint.stage(row.output, self._row_for_checkpoint(i), STAGE_BYTES_PER_STEP, True)
            links.append((i, link))
            nbytes += link.nbytes
        return links

    def _row_for_checkpoint(self, i: int) -> list:
        """Row ``i``'s caches to copy a link from: views into the batch where the layer allows (only the
        link's span is copied), the caches themselves when the row runs alone."""
        if not self.batch.batched:
            return self.batch.caches
        return view_row(self.batch.caches, i, self.checkpoints.batch_paddings.of(self.batch.caches))


def publishes_per_step(rows: int) -> int:
    """How many due rows of a batch of ``rows`` publish in one step: all of a batch's rows reach their
    interval in ``SPREAD_STEPS`` steps at most, so no step copies every row's span at once."""
    return max(1, -(-rows // SPREAD_STEPS))


def _key_of(row: Row) -> tuple[int, ...] | None:
    """The row's own PRNG key before its next draw (seeded rows)."""
    return None if row.key is None else tuple(row.key.tolist())
