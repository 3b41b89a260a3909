"""A burst of agents on a cached system prompt prefills its tails on that prompt by reference.

With ``--shared-prefix-attention`` grouping them (``on`` here, on the CPU),
joiners whose leases lend the same stored prefix run their tails as one
forward over SharedPrefixBatchCache layers (engine/shared_tails.py) and
join the batch as its group: no row's caches ever hold a copy of the
prefix (/stats.batch.row_copies ``referenced``), the wave's tails take one
prefill step (the tail budget, engine/step_plan.py), and every row's greedy
tokens equal the serial lane's on the same prompt cache.
"""

from __future__ import annotations

import pytest

from mlxq.engine.prefix_sharing import SharingPolicy
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.golden.cases import LONG
from mlxq.kv import attention_route, packed_tails
from mlxq.kv.projection import measure_footprint
from mlxq.kv.sharing_plan import plan_sharing
from mlxq.store.prompt_cache import PromptCache
from tests.engine.test_shared_prefill import serial_with_cache
from tests.engine.test_wave_join import run_wave, wave


@pytest.fixture(autouse=True)
def routed():
    yield
    attention_route.uninstall()


@pytest.fixture(autouse=True, params=[True, False], ids=["packed", "padded"])
def packed(request, monkeypatch) -> bool:
    """Every test both ways: the tails' forward packed (one position per row, kv/packed_tails.py; the
    default) and left-padded to the longest tail (MLXQ_PACKED_TAILS=0)."""
    monkeypatch.setattr(packed_tails, "PACKED_TAILS", request.param)
    monkeypatch.setattr(packed_tails, "MIN_PADDING_SHARE", 0.0)  # however little padding these waves have
    return request.param


def sharing_scheduler(model, tokenizer):
    finished: dict[str, tuple] = {}  # request id -> (tokens, cached tokens, finish reason)
    scheduler = BatchScheduler(
        model, tokenizer, measure_footprint(model), SchedulerConfig(32, 4, 2048, None, token0_in_decode=True),
        prompt_cache=PromptCache(1 << 30), sharing=SharingPolicy("on", plan_sharing(model)),
        on_finish=lambda row: finished.__setitem__(row.request.request_id, (row.output.tokens,
                                                                            row.output.cached_tokens,
                                                                            row.output.finished)))
    return scheduler, finished


def counters(scheduler) -> dict:
    return scheduler.batch.copies.as_dict() | {"prefill_steps": scheduler.phases.prefill_iterations,
                                               "packed": scheduler.sharing_stats.tails_packed,
                                               "tokens": scheduler.phases.batched_tokens,
                                               "positions": scheduler.phases.batched_positions,
                                               "groups": scheduler.sharing_stats.groups,
                                               "joined": scheduler.sharing_stats.rows_joined}


def assert_serial_tokens(model, tokenizer, requests: list, finished: dict) -> None:
    """Every request's tokens are the serial lane's on the same prompt cache."""
    expected = serial_with_cache(model, tokenizer, requests)
    for r in requests:
        assert finished[r.request_id][0] == expected[r.request_id][0], r.request_id


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def test_a_cached_burst_prefills_its_tails_on_the_stored_prefix_and_decodes_as_one_group(load_tiny, packed):
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    cold, cached = wave(tokenizer, shared, "cold", 2, "Agent"), wave(tokenizer, shared, "cached", 12, "Please")
    run_wave(scheduler, cold)
    before = counters(scheduler)
    run_wave(scheduler, cached)
    change = delta(counters(scheduler), before)
    # One forward for twelve tails on the prefix by reference, adopted as the batch's group: no copy of it.
    assert change["prefill_steps"] == 1 and change["referenced"] == 12 and change["kept"] == 12, change
    assert change["broadcast"] == change["gathered"] == change["batch_extends"] == 0, change
    assert change["groups"] == 1, change
    assert scheduler._prefilled_together is None
    assert change["packed"] == packed  # the one forward, packed or padded
    assert_serial_tokens(model, tokenizer, cold + cached, finished)
    for r in cached:
        assert finished[r.request_id][1] >= len(shared)  # the prefix came from the RAM tier


def test_agents_arriving_while_their_group_decodes_join_it_by_reference(load_tiny):
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    cold, cached = wave(tokenizer, shared, "cold", 2, "Agent"), wave(tokenizer, shared, "cached", 10, "Please")
    run_wave(scheduler, cold)
    before = counters(scheduler)
    for r in cached[:6]:
        scheduler.add(r, lambda e: None)
    scheduler.step()  # the first six prefill on the prefix, join as a group and decode a step
    assert len(scheduler.batch.groups) == 1 and scheduler.batch.groups[0].rows == 6
    run_wave(scheduler, cached[6:])  # four more while the group runs: appended to it, the prefix not copied
    change = delta(counters(scheduler), before)
    assert change["referenced"] == 10 and change["joined"] == 4 and change["groups"] == 1, change
    assert change["gathered"] == change["batch_extends"] == 0, change
    assert_serial_tokens(model, tokenizer, cold + cached, finished)


def test_a_lone_agent_on_its_own_copy_is_grouped_when_a_burst_on_its_prefix_arrives(load_tiny):
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    cold, cached = wave(tokenizer, shared, "cold", 2, "Agent"), wave(tokenizer, shared, "cached", 6, "Please")
    run_wave(scheduler, cold)
    scheduler.add(cached[0], lambda e: None)
    scheduler.step()  # alone: it decodes on its own solo caches (a copy of the prefix)
    assert len(scheduler.batch) == 1 and not scheduler.batch.batched and not scheduler.batch.groups
    before = counters(scheduler)
    run_wave(scheduler, cached[1:])  # the burst: the lone row is grouped first, the five tails append to it
    change = delta(counters(scheduler), before)
    assert change["referenced"] == 5 and change["joined"] == 5 and change["groups"] == 1, change
    assert change["gathered"] == change["batch_extends"] == 0, change
    assert_serial_tokens(model, tokenizer, cold + cached, finished)


def test_a_failed_join_of_shared_tails_fails_those_rows_and_the_scheduler_goes_on(load_tiny, monkeypatch):
    from mlxq.engine.types import FinishReason

    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    run_wave(scheduler, wave(tokenizer, shared, "cold", 2, "Agent"))

    def broken(*args, **kwargs):
        raise TypeError("no room for these rows")

    monkeypatch.setattr(scheduler.batch, "adopt_grouped", broken)
    failing = wave(tokenizer, shared, "failing", 4, "Please")
    run_wave(scheduler, failing)  # their KV lived only in the shared batch: they fail, nothing hangs
    assert all(finished[r.request_id][2] is FinishReason.ERROR for r in failing)
    monkeypatch.undo()
    later = wave(tokenizer, shared, "later", 4, "Kindly")
    run_wave(scheduler, later)
    assert all(finished[r.request_id][2] is FinishReason.LENGTH for r in later)
    assert scheduler.batch.copies.referenced == 4


def test_tails_of_different_lengths_move_by_one_take_never_by_mlx_lm_finalize(load_tiny, monkeypatch):
    """mlx-lm's BatchKVCache.finalize (a take_along_axis over the batch) cost 6.3 s of kernel
    compilation the first time a burst's tails ran on a shared prefix on the H200: the tails'
    rows move by the batch lane's own roll, as merged rows do."""
    from mlx_lm.models.cache import BatchKVCache

    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    cold, cached = wave(tokenizer, shared, "cold", 2, "Agent"), wave(tokenizer, shared, "cached", 5, "Please")
    run_wave(scheduler, cold)
    assert len({len(r.prompt_ids) for r in cached}) == len(cached)  # every tail padded by a different amount

    def refused(self):
        raise AssertionError("mlx-lm's finalize ran")

    monkeypatch.setattr(BatchKVCache, "finalize", refused)
    before = counters(scheduler)
    run_wave(scheduler, cached)
    assert delta(counters(scheduler), before)["referenced"] == 5
    assert_serial_tokens(model, tokenizer, cold + cached, finished)


def asking_waves(tokenizer, shared: list[int]):
    """A cold wave of three agents, then eight whose questions begin as one of theirs ("Agent beta"):
    each cached agent leases the prefix plus a few tokens of a stored question, not all the same."""
    from mlxq.engine.types import Request, SamplingParams

    words = ("alpha", "beta", "gamma")

    def asking(name: str, agents: int, question: str) -> list[Request]:
        return [Request(f"{name}-{i}", shared + tokenizer.encode(f" Agent {words[i % 3]} " + question.format(i)),
                        SamplingParams(), 6, ignore_eos=True, snapshot_at=len(shared)) for i in range(agents)]

    return asking("cold", 3, "asks about cold?"), asking("cached", 8, "wants {} things" + " now" * 3)


def test_a_few_own_leased_tokens_past_the_prefix_are_computed_again_not_gathered(load_tiny, monkeypatch, packed):
    """Agents whose questions begin with tokens of another agent's stored question lease the prefix
    plus those few tokens: the tails' forward computes them again (the tails start empty, nothing is
    gathered), they no longer count as cached, and every row's greedy tokens are the serial lane's."""
    from mlxq.engine import tail_placement

    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    cold, cached = asking_waves(tokenizer, shared)
    run_wave(scheduler, cold)
    leased = {r.request_id: scheduler.prompt_cache.held_path(r.namespace, r.prompt_ids)[1] for r in cached}

    def refused(*args, **kwargs):
        raise AssertionError("the tails were gathered")

    monkeypatch.setattr(tail_placement, "gather_prefixes", refused)
    # Every layer but the last handed to the device while the next is built (the tiny model has 4).
    from mlxq.engine import prefill
    submitted = []

    def counting(caches, submit, every=None):
        return tail_placement.submitted_by_layers(caches, lambda arrays: submitted.append(submit(arrays)), 1)

    monkeypatch.setattr(prefill, "submitted_by_layers", counting)
    before = counters(scheduler)
    run_wave(scheduler, cached)
    change = delta(counters(scheduler), before)
    assert change["prefill_steps"] == 1 and change["referenced"] == 8 and change["groups"] == 1, change
    prefix = scheduler.sharing_stats.as_dict(scheduler.sharing, 1, ())
    recomputed = prefix["tail_tokens_recomputed"]
    assert recomputed == sum(leased.values()) - sum(finished[r.request_id][1] for r in cached) > 0
    assert len({finished[r.request_id][1] for r in cached}) == 1  # each row cached the group's prefix alone
    assert len(set(leased.values())) > 1  # while their leases lent different lengths
    assert len(submitted) == len(model.layers) - 1  # one forward, submitted layer by layer
    assert change["packed"] == packed
    assert (change["positions"] == change["tokens"]) == packed  # packed: no padding computed
    assert_serial_tokens(model, tokenizer, cold + cached, finished)


def test_tails_holding_their_leased_tokens_keep_them_through_the_forward(load_tiny, monkeypatch, packed):
    """Agents whose questions begin with more than ``RECOMPUTED_OWN`` tokens of another's stored
    question lease them: their tails hold those tokens, placed where each row's chunk begins, and
    the forward (packed or padded) writes its chunks around them, the chunks' padding columns keeping
    what they hold; every row's greedy tokens equal the serial lane's."""
    from mlxq.engine import prefill
    from mlxq.engine.shared_tails import RECOMPUTED_OWN
    from mlxq.engine.types import Request, SamplingParams

    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    words = ("alpha", "beta", "gamma")

    def asking(name: str, agents: int, tail: str) -> list[Request]:
        question = " Agent {}, read the whole repository first and then tell me"
        return [Request(f"{name}-{i}", shared + tokenizer.encode(question.format(words[i % 3]) + tail.format(i)
                                                                 + " more" * (5 * i)),
                        SamplingParams(), 6, ignore_eos=True, snapshot_at=len(shared)) for i in range(agents)]

    cold, cached = asking("cold", 3, " about cold {}?"), asking("cached", 6, " what {} means")
    run_wave(scheduler, cold)
    leased = {r.request_id: scheduler.prompt_cache.held_path(r.namespace, r.prompt_ids)[1] for r in cached}
    assert min(leased.values()) - len(shared) > RECOMPUTED_OWN  # placed, not recomputed
    kept = []
    keeping = prefill.tails_in_place
    monkeypatch.setattr(prefill, "tails_in_place", lambda *args: kept.append(args[1]) or keeping(*args))
    before = counters(scheduler)
    run_wave(scheduler, cached)
    change = delta(counters(scheduler), before)
    assert change["prefill_steps"] == 1 and change["referenced"] == 6 and change["packed"] == packed, change
    assert scheduler.sharing_stats.tails_recomputed == 0
    assert len(kept) == 1 and any(kept[0].chunk_padding)  # the leased tokens kept where chunks are padded
    assert_serial_tokens(model, tokenizer, cold + cached, finished)


def test_quantized_tails_are_never_recomputed_on_empty_plain_tails(load_tiny):
    """Under --kv-quant the tails are quantized caches: the same burst keeps its leased tokens."""
    from mlxq.engine.types import FinishReason
    from tests.engine.test_quantized_kv import scheme_for

    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    scheduler.scheme = scheme_for(model, "8")
    cold, cached = asking_waves(tokenizer, shared)
    run_wave(scheduler, cold)
    run_wave(scheduler, cached)
    assert scheduler.sharing_stats.tails_recomputed == 0
    assert all(finished[r.request_id][2] is FinishReason.LENGTH for r in cold + cached)


@pytest.mark.parametrize("token0_in_tails", [False, True])
def test_agents_arriving_during_a_held_bursts_forward_are_admitted_meanwhile_and_join_its_group(
        load_tiny, monkeypatch, token0_in_tails):
    """With bursts held (a GPU's default), the tails' forward of a burst's first part admits what
    arrives while it runs (``take_in_meanwhile``, the engine's inbox): here four agents handed over
    during the forward of the first six. They are joiners when that step ends, prefill on the prefix
    by reference in one more forward once their own hold is over, and join the running group; every
    row's greedy tokens equal the serial lane's. The forward's time per query token is kept for the
    next ones (how long to take in arrivals meanwhile)."""
    import time
    from dataclasses import replace

    from mlxq.engine import prefill
    from mlxq.engine.burst_hold import BurstHold

    monkeypatch.setattr(prefill, "TOKEN0_IN_TAILS", token0_in_tails)  # also: token 0 from each tails' forward
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    scheduler.config = replace(scheduler.config, burst=BurstHold(window_s=0.15, gap_s=0.02))
    cold, cached = wave(tokenizer, shared, "cold", 2, "Agent"), wave(tokenizer, shared, "cached", 10, "Please")
    run_wave(scheduler, cold)
    now = [time.monotonic() + 100.0]
    scheduler.clock = lambda: now[0]
    before = counters(scheduler)
    for r in cached[:6]:
        scheduler.add(replace(r), lambda e: None)
    late = list(cached[6:])
    taken = []

    def meanwhile():
        taken.append(len(scheduler.joiners))
        while late:
            scheduler.add(replace(late.pop(0)), lambda e: None)

    scheduler.take_in_meanwhile = meanwhile
    now[0] += 1.0  # the first six's hold is over
    scheduler.step()
    assert taken == [6] and not late  # called once, during the six's forward (nothing timed before it)
    assert len(scheduler.batch.groups) == 1 and scheduler.batch.groups[0].rows == 6
    assert len(scheduler.joiners) == 4 and not any(j.is_prefilled for j in scheduler.joiners)
    assert [tokens > 0 < seconds for tokens, seconds in scheduler._largest_forward.values()] == [True]
    scheduler.take_in_meanwhile = lambda: None
    now[0] += 1.0
    generated = lambda rows: [row.output.num_generated for row in rows]  # noqa: E731
    first_six = list(scheduler.batch.rows)
    if token0_in_tails:  # token 0 is out: the four's forward runs before the six's next decode step
        assert generated(first_six) == [1] * 6
        scheduler.step()
        assert not scheduler.joiners and generated(first_six) == [1] * 6  # no decode step between
        assert generated(scheduler.batch.rows[6:]) == [1] * 4  # the four's token 0, from their forward
        scheduler.step()
        assert generated(first_six) == [2] * 6
    while not scheduler.is_idle:
        scheduler.step()
    change = delta(counters(scheduler), before)
    assert change["referenced"] == 10 and change["joined"] == 4 and change["groups"] == 1, change
    assert change["prefill_steps"] == 2, change
    assert_serial_tokens(model, tokenizer, cold + cached, finished)


def test_a_forward_without_a_held_burst_takes_nothing_in_meanwhile(load_tiny):
    """Bursts not held (the CPU's default): the engine's inbox is read between steps only."""
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    calls = []
    scheduler.take_in_meanwhile = lambda: calls.append(1)
    run_wave(scheduler, wave(tokenizer, shared, "cold", 2, "Agent"))
    run_wave(scheduler, wave(tokenizer, shared, "cached", 4, "Please"))
    assert not calls and not scheduler._largest_forward


@pytest.mark.parametrize(("ends_at_token0", "with_logprobs"), [(0, False), (3, False), (0, True)])
def test_token_0_drawn_from_the_tails_forward_gives_the_serial_lanes_tokens(load_tiny, monkeypatch, ends_at_token0,
                                                                            with_logprobs, packed):
    """``MLXQ_TAILS_TOKEN0`` (on by default): a cached burst's tails run their last prompt token too and token 0 is
    drawn from that forward's last position, handed out as the rows join (no decode step computes
    it); rows that end at token 0 (``max_tokens`` 1 here) leave at the join. Every row's greedy
    tokens equal the serial lane's, the tails still read the prefix by reference, in one forward."""
    from dataclasses import replace

    from mlxq.engine import prefill

    monkeypatch.setattr(prefill, "TOKEN0_IN_TAILS", True)
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    cold, cached = wave(tokenizer, shared, "cold", 2, "Agent"), wave(tokenizer, shared, "cached", 8, "Please")
    cached = [replace(r, max_tokens=1) if i < ends_at_token0 else r for i, r in enumerate(cached)]
    if with_logprobs:  # rows that are not plain greedy: each drawn by its own sampler, its logprob handed out
        cached = [replace(r, logprobs=True) if i % 2 else r for i, r in enumerate(cached)]
    run_wave(scheduler, cold)
    before = counters(scheduler)
    events: dict[str, list] = {}
    for r in cached:
        scheduler.add(replace(r), lambda e: events.setdefault(e.request_id, []).append(e))
    drawn = []
    draw = scheduler._tails_token0
    monkeypatch.setattr(scheduler, "_tails_token0",
                        lambda group, logits: drawn.append(len(group)) or draw(group, logits))
    decode_steps = scheduler.timing.steps
    scheduler.step()  # the tails' forward with token 0, the join, then one decode step (token 1, handed out next)
    assert drawn == [8] and scheduler.timing.steps - decode_steps == 1
    assert len(scheduler.batch.rows) == 8 - ends_at_token0
    assert all(len(row.output.tokens) == 1 for row in scheduler.batch.rows)
    if with_logprobs:  # token 0's event carries its logprob exactly where it was asked for
        assert all((events[r.request_id][0].logprob is not None) == r.logprobs for r in cached)
    assert all(len(finished[r.request_id][0]) == 1 for r in cached[:ends_at_token0])
    while not scheduler.is_idle:
        scheduler.step()
    change = delta(counters(scheduler), before)
    assert change["prefill_steps"] == 1 and change["referenced"] == 8, change
    assert change["packed"] == packed
    assert_serial_tokens(model, tokenizer, cold + cached, finished)
