"""The serial lane with checkpoints, in process: a cancelled run's checkpoint resumes an identical request
to the undisturbed tokens; a checkpoint whose key does not replay is left unused, never followed."""

from __future__ import annotations

from dataclasses import replace

from mlxq.engine.checkpoint_key import checkpoint_key
from mlxq.engine.checkpointing import Checkpointing, owned_layers
from mlxq.engine.serial import run_serial
from mlxq.engine.types import FinishReason, Request, SamplingParams
from mlxq.store.checkpoints import CheckpointStore
from mlxq.store.mlxkv import Identity

PARAMS = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=5)


def generate(model, tokenizer, request: Request, checkpoints: Checkpointing, cancel_after: int | None = None):
    def emit(event) -> None:
        if cancel_after is not None and event.token_id is not None and len(events) >= cancel_after:
            request.cancel()
        events.append(event)

    events: list = []
    output = run_serial(model, tokenizer, request, emit, prefill_step_size=64, checkpoints=checkpoints)
    if output.finished in (FinishReason.STOP, FinishReason.LENGTH):
        checkpoints.finished(request)  # as the engine does when a request ends
    return output


def test_a_cancelled_run_resumes_to_the_undisturbed_tokens_and_a_bad_key_is_not_followed(load_tiny, tmp_path):
    model, tokenizer = load_tiny("llama")
    store = CheckpointStore(tmp_path, Identity("f" * 16, "native", ""))
    checkpoints = Checkpointing(store, 8, "native")
    prompt = tokenizer.encode("Once upon a time")

    def new(request_id: str) -> Request:  # each its own cancellation flag
        return Request(request_id, prompt, PARAMS, 48, ignore_eos=True)

    request = new("a")
    undisturbed = generate(model, tokenizer, new("u"), checkpoints).tokens
    assert store.flush(10).files == 0  # completion removed its checkpoint

    cancelled = generate(model, tokenizer, new("c"), checkpoints, cancel_after=21)
    assert cancelled.finished is FinishReason.CANCELLED and store.flush(10).requests == 1
    resumed = generate(model, tokenizer, new("r"), checkpoints)
    # Its last checkpoint, at the cancel: every token handed out, the one drawn then, and the pending one.
    assert resumed.tokens == undisturbed and resumed.checkpoint_tokens == cancelled.num_generated + 2 == 24

    generate(model, tokenizer, new("c2"), checkpoints, cancel_after=21)
    assert store.flush(10).requests == 1  # written by the store's thread: durable only after a flush
    key = checkpoint_key(request, "native").digest
    record, caches = store.load(key)
    store.publish(replace(record, rng_key=(1, 2)), request.prompt_ids + list(record.emitted), owned_layers(caches),
                  True)
    assert store.flush(10).durable
    fresh = generate(model, tokenizer, new("f"), checkpoints)
    assert fresh.tokens == undisturbed and fresh.checkpoint_tokens == 0
