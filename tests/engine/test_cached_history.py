"""A row starting from the prompt cache: its logits processors still see the whole prompt, and a row
without processors keeps no token history (engine/joiners.py ``Joiner.start_from``)."""

from __future__ import annotations

from dataclasses import replace

from mlxq.engine.scheduler import SchedulerConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.golden.cases import LONG
from tests.engine.test_shared_prefill import recording_scheduler, serial_with_cache

PENALIZED = SamplingParams(repetition_penalty=1.8, repetition_context_size=4096, presence_penalty=1.0)


def test_processors_see_the_cached_prefix_and_plain_rows_keep_no_history(load_tiny):
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    first = Request("first", shared + tokenizer.encode(" What is it?"), SamplingParams(), 8, ignore_eos=True)
    penalized = Request("penalized", shared + tokenizer.encode(" Who are you?"), PENALIZED, 8, ignore_eos=True)
    plain = Request("plain", shared + tokenizer.encode(" Why?"), SamplingParams(), 8, ignore_eos=True)
    scheduler, finished = recording_scheduler(model, tokenizer, SchedulerConfig(4, 4, 2048, None))
    histories = {}
    for request in (first, penalized, plain):  # one after another: the later two start from the cache
        scheduler.add(replace(request), lambda e: None)
        joiner = list(scheduler.joiners)[0]
        histories[request.request_id] = joiner.row.history
        while not scheduler.is_idle:
            scheduler.step()
    expected = serial_with_cache(model, tokenizer, [first, penalized, plain])
    for request in (penalized, plain):
        assert finished[request.request_id][1] >= len(shared)  # its prefix came from the RAM tier
        assert finished[request.request_id] == expected[request.request_id], request.request_id
    # The penalty weighed on the prompt's tokens: the history held the cached prefix from admission on.
    assert histories["penalized"] is not None and histories["penalized"].size >= len(shared)
    assert histories["plain"] is None
    unpenalized = serial_with_cache(model, tokenizer, [first, replace(penalized, params=SamplingParams())])
    assert unpenalized["penalized"][0] != finished["penalized"][0]  # the processors changed the tokens
