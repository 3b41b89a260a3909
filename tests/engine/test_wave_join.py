"""A burst of agents on a cached system prompt joins in the batch its tails prefilled in: no row copied whole.

Each row's cache holds its own copy of the prefix; every further copy of it
(extracting a row from a batch, merging rows again) is a new buffer of the
row's whole KV. The scheduler counts them (/stats.batch.row_copies), and
every row still computes exactly what the serial lane computes on the same
prompt cache.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxq.engine import prefill, tail_placement
from mlxq.engine.scheduler import SchedulerConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.golden.cases import LONG
from mlxq.kv.batch_ops import view_row
from tests.engine.test_shared_prefill import recording_scheduler, serial_with_cache


def wave(tokenizer, shared: list[int], name: str, agents: int, lead: str) -> list[Request]:
    """Agents on one system prompt, each with its own question (tails of different lengths)."""
    return [Request(f"{name}-{i}", shared + tokenizer.encode(f" {lead}" + " number" * i + f" {i} asks about {name}?"),
                    SamplingParams(), 6, ignore_eos=True, snapshot_at=len(shared)) for i in range(agents)]


def run_wave(scheduler, requests: list[Request]) -> None:
    for r in requests:  # all at once, before a step: one burst
        scheduler.add(replace(r), lambda e: None)
    while not scheduler.is_idle:
        scheduler.step()


def token0_scheduler(load_tiny):
    """The tiny llama, a system prompt of two LONG paragraphs, and a recording scheduler computing token 0
    in the decode step: the set-up of a cached wave's tests."""
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    config = SchedulerConfig(8, 4, 2048, None, token0_in_decode=True)
    scheduler, finished = recording_scheduler(model, tokenizer, config)
    return model, tokenizer, shared, scheduler, finished


def cached_prompt_on_a_clock(load_tiny, rows: int, burst):
    """A scheduler holding bursts by ``burst`` whose system prompt one agent already stored, on a clock
    the test moves (``now[0]``)."""
    import time

    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    config = SchedulerConfig(rows, 4, 2048, None, token0_in_decode=True, burst=burst)
    scheduler, finished = recording_scheduler(model, tokenizer, config)
    run_wave(scheduler, wave(tokenizer, shared, "cold", 1, "Agent"))
    now = [time.monotonic() + 100.0]
    scheduler.clock = lambda: now[0]
    return scheduler, finished, tokenizer, shared, now


@pytest.mark.parametrize("token0_in_decode", [True, False])
def test_a_cached_wave_joins_in_its_prefill_batch_and_leaves_through_views(load_tiny, token0_in_decode, monkeypatch):
    model, tokenizer = load_tiny("llama")
    moved = []  # rows moved by their padding after a forward (engine/tail_placement.py places them instead)
    monkeypatch.setattr(prefill, "finalize_chunks", lambda cache, shifts: moved.append(shifts))
    shared = tokenizer.encode(LONG + " " + LONG)
    config = SchedulerConfig(8, 4, 2048, None, token0_in_decode=token0_in_decode)
    scheduler, finished = recording_scheduler(model, tokenizer, config)
    # The cached wave's questions share no token with the stored ones: each leases the system prompt alone.
    cold, cached = wave(tokenizer, shared, "cold", 3, "Agent"), wave(tokenizer, shared, "cached", 5, "Please")
    run_wave(scheduler, cold)
    before, puts = scheduler.batch.copies.as_dict(), scheduler.prompt_cache.stats.puts
    moved.clear()
    viewed = []  # per-row views of the kept batch: built only if something reads a joiner's caches
    monkeypatch.setattr(tail_placement, "view_row", lambda *args: viewed.append(args) or view_row(*args))
    run_wave(scheduler, cached)
    after = scheduler.batch.copies.as_dict()
    assert not moved  # tails of different lengths, each written where it stays
    assert not viewed  # they joined in the batch they prefilled in: nobody read a row of it
    # The system prompt was stored: each agent stores once, when it ends, not also at its prompt boundary.
    assert scheduler.prompt_cache.stats.puts - puts == len(cached)
    delta = {k: after[k] - before[k] for k in after}
    # One forward for the five tails on one merged copy of the stored prefix (each row placed where its
    # tail starts: tails of five lengths, five writes), the batch kept for the join, rows stored from
    # views as they leave.
    assert delta == {"kept": 5, "referenced": 0, "broadcast": 0, "gathered": 0, "extracted": 0, "batch_extends": 0,
                     "extended_rows": 0}
    assert scheduler._prefilled_together is None  # the kept batch is the running batch's now, not held twice
    for r in cached:
        assert finished[r.request_id][1] >= len(shared)  # the prefix came from the RAM tier
    expected = serial_with_cache(model, tokenizer, cold + cached)
    for r in cold + cached:
        assert finished[r.request_id][0] == expected[r.request_id][0], r.request_id


def record_placed_rows(monkeypatch) -> list:
    """From here on, a weak reference to every joiners' row view the prefill makes
    (tail_placement.PlacedRows): which of them are still alive at a given moment."""
    import weakref

    made = []

    class Recorded(tail_placement.PlacedRows):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(weakref.ref(self))

    monkeypatch.setattr(prefill, "PlacedRows", Recorded)
    return made


def test_no_view_into_the_placed_batch_is_alive_when_its_first_decode_step_writes(load_tiny, monkeypatch):
    """The joiners' lazy row views (tail_placement.PlacedRows) hold slices of the batch's arrays: were
    one alive at the decode step that computes token 0, MLX could not write that step's K/V in place
    and would copy every layer's whole batch. They are gone by then."""
    _, tokenizer, shared, scheduler, _ = token0_scheduler(load_tiny)
    run_wave(scheduler, wave(tokenizer, shared, "cold", 2, "Agent"))
    made = record_placed_rows(monkeypatch)
    alive_at_decode = []
    decode = scheduler._decode_or_shed
    monkeypatch.setattr(scheduler, "_decode_or_shed",
                        lambda: alive_at_decode.append(sum(r() is not None for r in made)) or decode())
    for r in wave(tokenizer, shared, "cached", 4, "Please"):
        scheduler.add(replace(r), lambda e: None)
    scheduler.step()  # the tails' forward, the join, and the decode step of token 0
    assert len(made) == 1 and alive_at_decode == [0]


def test_no_view_into_the_placed_batch_is_alive_when_the_token0_forward_writes(load_tiny, monkeypatch):
    """On the CPU token 0 comes from a forward of the joiners before they join (joining._first_tokens),
    on the batch their tails prefilled in: the joiners' row views of it are let go of before that
    forward writes, so MLX writes its K/V in place, and every row still computes the serial lane's
    tokens."""
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    config = SchedulerConfig(8, 4, 2048, None, token0_in_decode=False)
    scheduler, finished = recording_scheduler(model, tokenizer, config)
    cold = wave(tokenizer, shared, "cold", 2, "Agent")
    run_wave(scheduler, cold)
    made = record_placed_rows(monkeypatch)
    alive_at_token0 = []

    class Watched:
        def __call__(self, tokens, cache):
            if tokens.shape[1] == 1 and made and not alive_at_token0:  # the first one-token forward
                alive_at_token0.append(sum(r() is not None for r in made))
            return model(tokens, cache=cache)

        def __getattr__(self, name):
            return getattr(model, name)

    monkeypatch.setattr(scheduler, "model", Watched())
    cached = wave(tokenizer, shared, "cached", 4, "Please")
    run_wave(scheduler, cached)
    assert len(made) == 1 and alive_at_token0 == [0]
    expected = serial_with_cache(model, tokenizer, cold + cached)
    for r in cold + cached:
        assert finished[r.request_id][0] == expected[r.request_id][0], r.request_id


def test_rows_move_right_by_their_padding_as_mlx_lm_rolls_them():
    import mlx.core as mx
    from mlx_lm.models.cache import dynamic_roll

    from mlxq.engine.wave_caches import roll_rows

    x = mx.random.normal((6, 2, 11, 3))
    for shifts in ([0, 3, 3, 10, 0, 1], [0] * 6, [2] * 6, [11, 12, 0, 5, 5, 5]):
        assert mx.array_equal(roll_rows(x, shifts), dynamic_roll(x, mx.array(shifts)[:, None], axis=2)), shifts


def test_a_burst_still_arriving_waits_for_the_rest_and_prefills_as_one_forward(load_tiny):
    """With a burst window (a GPU server's), tails admitted moments apart are held until the burst
    stops arriving: after its first request the rest prefill in one step, not in groups each
    waiting behind the one before."""
    import time

    from mlxq.engine.burst_hold import BurstHold

    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    config = SchedulerConfig(8, 4, 2048, None, token0_in_decode=True, burst=BurstHold(window_s=0.15, gap_s=0.02))
    scheduler, finished = recording_scheduler(model, tokenizer, config)
    cold, cached = wave(tokenizer, shared, "cold", 2, "Agent"), wave(tokenizer, shared, "cached", 6, "Please")
    run_wave(scheduler, cold)  # a cold wave follows a leader: never held
    now = [time.monotonic() + 100.0]  # from here the test's clock: the cold wave came long ago
    scheduler.clock = lambda: now[0]
    steps = scheduler.phases.prefill_iterations
    scheduler.add(replace(cached[0]), lambda e: None)
    now[0] += 0.005
    scheduler.step()  # the burst's first request: nothing says more are coming, it prefills at once
    assert scheduler.phases.prefill_iterations == steps + 1
    for first, last in ((1, 3), (3, 5)):
        for r in cached[first:last]:
            scheduler.add(replace(r), lambda e: None)
            now[0] += 0.005  # a request parsed every 5 ms
        scheduler.step()
        assert scheduler.phases.prefill_iterations == steps + 1 and scheduler.num_prefilling == last - 1  # held
    scheduler.add(replace(cached[5]), lambda e: None)
    now[0] += 0.025  # 25 ms without an arrival: the burst has come
    scheduler.step()
    assert scheduler.phases.prefill_iterations == steps + 2 and scheduler.num_rows == 6  # five tails at once
    while not scheduler.is_idle:
        scheduler.step()
    expected = serial_with_cache(model, tokenizer, cold + cached)
    for r in cold + cached:
        assert finished[r.request_id][0] == expected[r.request_id][0], r.request_id


def test_a_chat_sent_again_whole_waits_with_its_burst_instead_of_splitting_it(load_tiny):
    """A request whose whole prompt is cached (an agent's chat sent again) has nothing to prefill. In a
    burst it is held with the new tails and joins with them in one step: were it taken at once, it
    would join and decode alone while the burst's tails queue behind it (on the H200, 64 such rows
    arriving over ~0.15 s took 0.7-4.8 s to their first tokens)."""
    from mlxq.engine.burst_hold import BurstHold

    burst = BurstHold(window_s=0.15, gap_s=0.02)
    scheduler, finished, tokenizer, shared, now = cached_prompt_on_a_clock(load_tiny, 8, burst)
    cached = wave(tokenizer, shared, "cached", 4, "Please")
    run_wave(scheduler, cached[:1])  # its prompt and answer are stored
    again = replace(cached[0], request_id="again")
    now[0] += 10.0
    steps, rows_before = scheduler.phases.prefill_iterations, scheduler.num_rows
    for r in (again, replace(cached[1])):
        scheduler.add(r, lambda e: None)
        now[0] += 0.005
    scheduler.step()
    assert scheduler.num_rows == rows_before == 0 and scheduler.num_prefilling == 2  # held, the chat sent again too
    assert scheduler.phases.prefill_iterations == steps
    for r in cached[2:]:
        scheduler.add(replace(r), lambda e: None)
        now[0] += 0.005
    now[0] += 0.025  # the burst has come
    scheduler.step()
    assert scheduler.phases.prefill_iterations == steps + 1 and scheduler.num_rows == 4  # one forward, one join
    while not scheduler.is_idle:
        scheduler.step()
    model, _ = load_tiny("llama")
    cold = wave(tokenizer, shared, "cold", 1, "Agent")  # what cached_prompt_on_a_clock ran first
    expected = serial_with_cache(model, tokenizer, cold + cached + [again])
    for r in cached + [again]:
        assert finished[r.request_id][0] == expected[r.request_id][0], r.request_id


def test_a_request_cancelled_while_its_burst_is_held_ends_at_the_next_step_and_the_rest_stay_held(load_tiny):
    """A client that goes away while its tail is held for the rest of the burst is not kept for the
    hold's window: the next step (when the burst has stopped arriving for ``gap_s`` and the engine
    thread takes it in) ends it, cancelled, without a prefill; the others wait for the burst as before."""

    from mlxq.engine.burst_hold import BurstHold
    from mlxq.engine.types import FinishReason

    burst = BurstHold(window_s=0.15, gap_s=0.02)
    scheduler, finished, tokenizer, shared, now = cached_prompt_on_a_clock(load_tiny, 8, burst)
    cached = [replace(r) for r in wave(tokenizer, shared, "cached", 4, "Please")]
    events: dict[str, list] = {r.request_id: [] for r in cached}
    steps = scheduler.phases.prefill_iterations
    for r in cached[:3]:
        scheduler.add(r, events[r.request_id].append)
        now[0] += 0.005
    scheduler.step()
    assert scheduler.num_prefilling == 3 and scheduler.phases.prefill_iterations == steps  # held
    cached[1].cancel()
    scheduler.add(cached[3], events[cached[3].request_id].append)
    now[0] += 0.005
    scheduler.step()
    assert [e.finish_reason for e in events[cached[1].request_id]] == [FinishReason.CANCELLED]
    assert scheduler.num_prefilling == 3 and scheduler.phases.prefill_iterations == steps  # the rest still held
    now[0] += 0.025
    scheduler.step()
    assert scheduler.phases.prefill_iterations == steps + 1 and scheduler.num_rows == 3
    while not scheduler.is_idle:
        scheduler.step()
    assert finished[cached[1].request_id][0] == []  # never prefilled, never sampled
    assert all(len(finished[r.request_id][0]) == r.max_tokens for r in cached if r is not cached[1])


def test_a_held_burst_works_out_each_joiners_chunk_once_not_at_every_arrival(load_tiny, monkeypatch):
    """While a burst is held, the engine thread plans a step at every arrival; each joiner's next chunk
    (snapshot points, cache kinds) is worked out once, and a step whose intake changes nobody takes the
    joiners' views once: the engine's work per arrival does not grow with the burst already there."""

    from mlxq.engine.burst_hold import BurstHold

    scheduler, _, tokenizer, shared, now = cached_prompt_on_a_clock(load_tiny, 32, BurstHold(window_s=10.0, gap_s=1.0))
    worked_out, views = [], []
    split_at, take_views = scheduler._split_at, scheduler.joiners.views
    monkeypatch.setattr(scheduler, "_split_at", lambda joiner: worked_out.append(joiner) or split_at(joiner))
    monkeypatch.setattr(scheduler.joiners, "views", lambda chunk_len: views.append(1) or take_views(chunk_len))
    cached = wave(tokenizer, shared, "cached", 12, "Please")
    for r in cached:
        scheduler.add(replace(r), lambda e: None)
        now[0] += 0.005
        scheduler.step()
    assert scheduler.num_prefilling == 11  # the first went at once (nothing said more were coming), the rest held
    # Once per joiner (and once more for the first, whose chunk ran), not per joiner per arrival.
    assert len(worked_out) == 13
    assert len(views) == 12  # one per held step


def test_an_engine_that_holds_bursts_prefills_a_submitted_wave_in_one_step(tiny_model_dirs, monkeypatch):
    """The engine thread as a GPU server runs it (burst window on): a wave submitted a request at
    a time, as a server hands them over, is held while it arrives and prefilled together; every
    request ends. (The gap is widened from 20 ms so that a loaded CPU cannot split the wave.)"""
    import queue
    import time

    from mlxq.engine import engine as engine_module
    from mlxq.engine.burst_hold import BurstHold
    from mlxq.engine.engine import Engine, EngineConfig
    from mlxq.models.loader import load_model

    monkeypatch.setattr(engine_module, "_on_gpu", lambda: True)
    engine = Engine(lambda: load_model(str(tiny_model_dirs["llama"])),
                    EngineConfig(max_rows=8, prompt_cache_bytes=1 << 28))
    engine.start()
    assert engine.ready.wait(120)
    try:
        assert engine.scheduler.config.burst.window_s > 0
        engine.scheduler.config = replace(engine.scheduler.config, burst=BurstHold(window_s=10.0, gap_s=0.5))
        tokenizer = engine.loaded.tokenizer
        shared = tokenizer.encode(LONG + " " + LONG)
        events: queue.Queue = queue.Queue()
        for r in wave(tokenizer, shared, "cold", 1, "Agent"):  # stores the system prompt
            engine.submit(r, events.put)
        while events.get(timeout=60).finish_reason is None:
            pass
        steps = engine.scheduler.phases.prefill_iterations
        stepped = []  # the engine thread's scheduler steps: while a burst is held it waits on its inbox
        step = engine.scheduler.step
        monkeypatch.setattr(engine.scheduler, "step", lambda: stepped.append(1) or step())
        cached = wave(tokenizer, shared, "cached", 6, "Please")
        for r in cached:
            engine.submit(r, events.put)
            time.sleep(0.02)  # without the hold the engine starts on the first ones meanwhile
        ended = 0
        while ended < len(cached):
            ended += events.get(timeout=60).finish_reason is not None
        assert engine.scheduler.phases.prefill_iterations - steps <= 2  # at most the first alone, then the rest
        assert len(stepped) < 60  # ~0.6 s held: polled each millisecond it would be hundreds of steps
    finally:
        engine.stop(10)
