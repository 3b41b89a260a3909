"""Links the batch lane staged behind its last decode step are published when the lane stops (shutdown,
a preemption, a flush) instead of lost with the step that would have published them: the checkpoint
then holds the newest tokens, and its pending token is the one the uninterrupted run emits next."""

from __future__ import annotations

from mlxq.engine.checkpointing import Checkpointing
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.kv.projection import measure_footprint
from mlxq.kv.scheme import NATIVE
from mlxq.store.checkpoints import CheckpointStore
from mlxq.store.mlxkv import Identity

INTERVAL = 8


def scheduler_for(model, tokenizer, checkpoints=None) -> tuple[BatchScheduler, dict]:
    finished: dict[str, list[int]] = {}
    config = SchedulerConfig(4, 2, 2048, None, True)
    scheduler = BatchScheduler(model, tokenizer, measure_footprint(model, 2048, NATIVE), config, scheme=NATIVE,
                               on_finish=lambda row: finished.__setitem__(row.request.request_id, row.output.tokens),
                               checkpoints=checkpoints)
    return scheduler, finished


def requests() -> list[Request]:
    return [Request(f"r{i}", [1, 5 + i, 9, 13 + 2 * i], SamplingParams(), 40, ignore_eos=True) for i in range(2)]


def test_a_shutdown_publishes_the_links_its_last_step_staged(load_tiny, tmp_path):
    model, tokenizer = load_tiny("llama")
    reference, finished = scheduler_for(model, tokenizer)
    for request in requests():
        reference.add(request, lambda event: None)
    while not reference.is_idle:
        reference.step()

    checkpointing = Checkpointing(CheckpointStore(tmp_path, Identity("f" * 16, NATIVE.key, "")), INTERVAL,
                                  NATIVE.key)
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
        tokens = finished[request.request_id]
        assert len(record.emitted) == taken[request.request_id]  # the newest state, not an interval older
        assert list(record.emitted) == tokens[: len(record.emitted)]
        assert record.pending == tokens[len(record.emitted)]
