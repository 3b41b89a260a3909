"""A step's finishing rows are stored with one evaluation for all their puts, and what is stored is right.

When a burst's rows end in one step, each is stored in the prompt cache
(what the tree lacks, cut from a view into the batch). Evaluating each put
alone made the step wait for the device once per row while the next wave
queued; the puts of one step are evaluated together, and the stored chains
still serve the next wave the serial lane's tokens.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxq.store.prompt_cache import PromptCache
from tests.engine.test_shared_prefill import serial_with_cache
from tests.engine.test_wave_join import run_wave, token0_scheduler, wave


def test_rows_finishing_in_one_step_are_stored_with_one_evaluation(load_tiny, monkeypatch):
    model, tokenizer, shared, scheduler, finished = token0_scheduler(load_tiny)
    cold, cached = wave(tokenizer, shared, "cold", 1, "Agent"), wave(tokenizer, shared, "cached", 5, "Please")
    run_wave(scheduler, cold)
    evaluations, inside = [], [False]
    real_eval, real_evict = mx.eval, scheduler._evict

    def counting_eval(*args):
        evaluations.append(inside[0])
        return real_eval(*args)

    def evict(keep):
        inside[0] = True
        try:
            return real_evict(keep)
        finally:
            inside[0] = False

    monkeypatch.setattr(mx, "eval", counting_eval)
    monkeypatch.setattr(scheduler, "_evict", evict)
    puts = scheduler.prompt_cache.stats.puts
    run_wave(scheduler, cached)  # five rows of six tokens each: they all end in one step
    monkeypatch.undo()
    assert scheduler.prompt_cache.stats.puts - puts == len(cached)
    assert evaluations.count(True) == 1  # one for the five puts (each put evaluated alone: five)
    again = [r.__class__(r.request_id + "-again", r.prompt_ids + finished[r.request_id][0], r.params, 4,
                         ignore_eos=True, snapshot_at=r.snapshot_at) for r in cached]
    run_wave(scheduler, again)  # each leases the chain its first run stored, whole
    expected = serial_with_cache(model, tokenizer, cold + cached + again)
    for r in cold + cached + again:  # (the serial lane's cached wave, one by one, finds its neighbours')
        assert finished[r.request_id][0] == expected[r.request_id][0], r.request_id
    for r in again:
        assert finished[r.request_id][1] == expected[r.request_id][1] >= len(r.prompt_ids) - 2, r.request_id


def test_a_failed_evaluation_of_deferred_puts_removes_what_they_grew(load_tiny, monkeypatch):
    model, _ = load_tiny("llama")
    caches = make_prompt_cache(model)
    model(mx.array([list(range(3, 40))]), cache=caches)
    mx.eval([c.state for c in caches])
    pc = PromptCache(1 << 30)
    stem, one, two = list(range(3, 20)), list(range(100, 111)), list(range(200, 215))
    pc.put("", stem, caches)
    pc.defer_evaluation()
    pc.put("", stem + one, caches)
    pc.put("", stem + two, caches)
    assert pc.nodes == 3 and len(pc) == 2  # the stem's entry is superseded: the new ones serve its prompts

    def out_of_memory(*args):
        raise RuntimeError("[malloc] Unable to allocate 1024 bytes.")

    monkeypatch.setattr(mx, "eval", out_of_memory)
    with pytest.raises(RuntimeError):
        pc.evaluate_deferred()
    monkeypatch.undo()
    # The leaves go, and the stem with them (no entry names it any more): the tree holds nothing unevaluated.
    assert pc.nodes == 0 and pc.bytes == 0 and len(pc) == 0
    assert pc.take("", stem + one + [1])[1] == 0
    pc.put("", stem + one, caches)  # evaluated by the put again
    assert pc.take("", stem + one + [1])[1] == len(stem + one)
