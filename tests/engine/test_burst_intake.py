"""A burst taken in one pass: what admission keeps between two steps answers as reading everything anew."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxq.engine.burst_hold import BurstHold
from mlxq.engine.step_plan import Extent
from mlxq.golden.cases import LONG
from mlxq.kv import attention_route
from tests.engine.test_shared_tails import sharing_scheduler
from tests.engine.test_wave_join import run_wave, wave


@pytest.fixture(autouse=True)
def routed():
    yield
    attention_route.uninstall()


def admit_in_one_pass(scheduler, requests) -> list[tuple]:
    """Each request asked in and added, as the engine takes a held burst in; per request, the load
    admission reads with what it kept and read anew."""
    seen = []
    for r in requests:
        held = scheduler.prompt_cache.held_path(r.namespace, r.prompt_ids)
        extent = Extent(len(r.prompt_ids), r.max_tokens)
        seen.append((scheduler._kv_load(extent, held, between=True), scheduler._kv_load(extent, held)))
        assert scheduler.can_admit(r)
        scheduler.add(r, lambda e: None)
    return seen


def test_a_burst_admitted_in_one_pass_reads_the_load_as_if_anew(load_tiny):
    """Cold (followers change their leader's terms), then cached while a row still decodes, then a
    cached wave again after a step: the kept terms equal the ones built from scratch every time."""
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    cold = wave(tokenizer, shared, "cold", 4, "Agent")
    for kept, anew in admit_in_one_pass(scheduler, [replace(r) for r in cold]):
        assert kept == anew
    while not scheduler.is_idle:
        scheduler.step()
    lone = replace(wave(tokenizer, shared, "lone", 1, "Solo")[0], max_tokens=40)
    scheduler.add(lone, lambda e: None)
    scheduler.step()
    scheduler.step()
    assert scheduler.num_rows == 1  # decoding while the next burst is taken in
    cached = [replace(r) for r in wave(tokenizer, shared, "cached", 6, "Please")]
    for kept, anew in admit_in_one_pass(scheduler, cached):
        assert kept == anew
    scheduler.step()
    again = [replace(r) for r in wave(tokenizer, shared, "again", 3, "Then")]
    for kept, anew in admit_in_one_pass(scheduler, again):
        assert kept == anew
    while not scheduler.is_idle:
        scheduler.step()
    last = replace(wave(tokenizer, shared, "last", 1, "Last")[0], max_tokens=3)
    scheduler.add(last, lambda e: None)
    scheduler.step()
    probe, held = Extent(len(last.prompt_ids), 4), scheduler.prompt_cache.held_path("", last.prompt_ids)
    assert scheduler._kv_load(probe, held, between=True) == scheduler._kv_load(probe, held)  # a row runs
    while not scheduler.is_idle:  # the row ends; no joiner changes meanwhile
        scheduler.step()
    assert scheduler._kv_load(probe, held, between=True) == scheduler._kv_load(probe, held)
    assert all(len(finished[r.request_id][0]) == r.max_tokens for r in cold + cached + again + [lone, last])
    run_wave(scheduler, [replace(r, request_id=f"{r.request_id}-next") for r in cached])


def test_steps_that_only_hold_a_burst_keep_what_admission_read(load_tiny):
    """A burst taken in as it arrives: a step that only holds it (nothing decodes, no joiner changed)
    keeps admission's terms for the next take-in, which still read as if anew; the burst then runs."""
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    run_wave(scheduler, [replace(r) for r in wave(tokenizer, shared, "cold", 2, "Agent")])  # the prefix stored
    config = scheduler.config
    scheduler.config = replace(config, burst=BurstHold(window_s=600.0, gap_s=600.0))
    scheduler.await_arrival = lambda held: None  # the engine thread would sleep through the rest here
    cached = [replace(r) for r in wave(tokenizer, shared, "cached", 6, "Please")]
    for start in range(0, 6, 2):
        for kept, anew in admit_in_one_pass(scheduler, cached[start : start + 2]):
            assert kept == anew
        read = scheduler._between
        scheduler.step()  # held
        assert scheduler.num_rows == 0 and len(scheduler.joiners) == start + 2
        assert read.key == (scheduler.joiners.version, scheduler._steps)  # still true: the next take-in reads on
    scheduler.config = config
    scheduler.step()  # the hold ends: the burst runs, and what admission kept is read anew next time
    assert read.key != (scheduler.joiners.version, scheduler._steps)
    while not scheduler.is_idle:
        scheduler.step()
    assert all(len(finished[r.request_id][0]) == r.max_tokens for r in cached)
