"""Links the batch lane staged behind its last decode step are published when the lane stops (shutdown,
a preemption, a flush) instead of lost with the step that would have published them: the checkpoint
then holds the newest tokens, and its pending token is the one the uninterrupted run emits next. A
staging that fails drops its links, never the rows, and the rows stay due."""

from __future__ import annotations

import mlx.core as mx

from mlxq.engine.checkpointing import Checkpointing
from mlxq.engine.faults import Evaluator, FaultInjector, parse_fault_spec
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.kv.projection import measure_footprint
from mlxq.kv.scheme import NATIVE
from mlxq.store.checkpoints import CheckpointStore
from mlxq.store.mlxkv import Identity
from mlxq.store.spent_buffers import SpentBuffers

INTERVAL = 8


def scheduler_for(model, tokenizer, checkpoints=None, faults: str = "") -> tuple[BatchScheduler, dict]:
    finished: dict[str, tuple] = {}
    config = SchedulerConfig(4, 2, 2048, None, True)
    scheduler = BatchScheduler(model, tokenizer, measure_footprint(model, 2048, NATIVE), config, scheme=NATIVE,
                               on_finish=lambda row: finished.__setitem__(row.request.request_id,
                                                                         (row.output.tokens, row.output.finished)),
                               checkpoints=checkpoints, evaluator=Evaluator(FaultInjector(parse_fault_spec(faults))))
    return scheduler, finished


def requests() -> list[Request]:
    return [Request(f"r{i}", [1, 5 + i, 9, 13 + 2 * i], SamplingParams(), 40, ignore_eos=True) for i in range(2)]


def reference_outputs(model, tokenizer) -> dict:
    """What the requests generate with no checkpoints: request id -> (tokens, finish)."""
    reference, finished = scheduler_for(model, tokenizer)
    for request in requests():
        reference.add(request, lambda event: None)
    while not reference.is_idle:
        reference.step()
    return finished


def checkpointing_in(directory) -> Checkpointing:
    return Checkpointing(CheckpointStore(directory, Identity("f" * 16, NATIVE.key, "")), INTERVAL, NATIVE.key)


def test_a_shutdown_publishes_the_links_its_last_step_staged(load_tiny, tmp_path):
    model, tokenizer = load_tiny("llama")
    finished = reference_outputs(model, tokenizer)
    checkpointing = checkpointing_in(tmp_path)
    scheduler, _ = scheduler_for(model, tokenizer, checkpointing)
    for request in requests():
        scheduler.add(request, lambda event: None)
    steps = 0
    while not len(checkpointing.batch_staged) or checkpointing.store.queued_bytes() or steps < 3 * INTERVAL:
        scheduler.step()  # until a step staged links past the first interval, the older ones written
        checkpointing.store.flush(10)
        steps += 1
        assert steps < 200
    taken = {row.request.request_id: row.checkpoint.last for row in scheduler.batch.rows}  # tokens at its newest
    assert any(last == len(row.output.tokens) for row, last in zip(scheduler.batch.rows, taken.values(), strict=True))
    scheduler.fail_all("the server is shutting down")  # a row's link staged in the last step is published

    assert checkpointing.store.flush(10).durable
    for request in requests():
        record, _ = checkpointing.store.load(checkpointing.key_for(request))
        tokens, _ = finished[request.request_id]
        assert len(record.emitted) == taken[request.request_id]  # the newest state, not an interval older
        assert list(record.emitted) == tokens[: len(record.emitted)]
        assert record.pending == tokens[len(record.emitted)]


def test_a_staging_that_fails_drops_its_links_and_the_rows_stay_due(load_tiny, tmp_path):
    """The copy of a link fails after the link was planned (MLXQ_FAULT_INJECT's ``checkpoint`` site, as an
    allocation failure would): the rows decode on to the same tokens, they are still due, so the next
    step stages their link, and what a restart restores is that newest link, token for token."""
    model, tokenizer = load_tiny("llama")
    expected = reference_outputs(model, tokenizer)
    checkpointing = checkpointing_in(tmp_path)
    scheduler, finished = scheduler_for(model, tokenizer, checkpointing, faults="checkpoint:1")
    for request in requests():
        scheduler.add(request, lambda event: None)
    while scheduler.faults.injector.injected == 0:
        scheduler.step()
        assert not finished and scheduler.faults.injector.attempts.get("checkpoint", 0) <= 1
    rows = scheduler.batch.rows
    assert not len(checkpointing.batch_staged) and checkpointing.store.counters.dropped == 1
    assert all(row.checkpoint.is_due(row.output) and row.checkpoint.last == 0 for row in rows)  # none taken
    first = rows[0]  # the longest without a checkpoint (all alike: the first): its staging failed
    at = first.output.num_generated
    scheduler.step()  # staged now, a step later, with the row's state of this step
    assert len(checkpointing.batch_staged) == 1 and first.checkpoint.last == at + 1
    assert not first.checkpoint.is_due(first.output)
    scheduler.step()  # published
    assert not checkpointing.store.flush(10).durable  # the dropped staging is reported once
    assert checkpointing.store.flush(10).durable
    record, _ = checkpointing.store.load(first.checkpoint.key)
    while not scheduler.is_idle:
        scheduler.step()

    assert finished == expected  # every row ran to its end, the same tokens
    tokens, _ = finished[first.request.request_id]
    assert len(record.emitted) == at + 1
    assert list(record.emitted) == tokens[: len(record.emitted)] and record.pending == tokens[len(record.emitted)]


def test_held_checkpoint_buffers_go_when_the_batch_runs_dry(load_tiny, tmp_path):
    """Written links' host-read buffers (store/spent_buffers.py) are let go, with MLX's cache cleared, at the
    latest when the batch runs dry: an idle server holds none."""
    model, tokenizer = load_tiny("llama")
    store = CheckpointStore(tmp_path, Identity("f" * 16, NATIVE.key, ""))
    store.spent = SpentBuffers(hold=True)
    scheduler, finished = scheduler_for(model, tokenizer, Checkpointing(store, INTERVAL, NATIVE.key))
    for request in requests():
        scheduler.add(request, lambda event: None)
    scheduler.step()
    store.spent.add([mx.zeros((4,))], 16)  # as the writer adds a written link's moved Packs
    while len(finished) < 2:
        assert store.spent.nbytes == 16  # held while the batch decodes
        scheduler.step()
    assert store.spent.nbytes == 0
