"""The batch lane's scheduling rules on step plans alone: plain numbers in, decisions out, no model."""

from __future__ import annotations

from mlxq.engine.burst_hold import BurstHold, OnTheWay, burst_quiet_at, held_until, hold_for_burst, hold_left
from mlxq.engine.preempt import plan_decode_preemption, rows_that_fit
from mlxq.engine.step_plan import (
    MIN_SHARED_PREFILL,
    SHORT_PREFILL,
    Extent,
    JoinerView,
    Limits,
    Load,
    PrefixView,
    Sizing,
    can_admit,
    choose_leader,
    load_of,
    plan_intake,
    plan_prefill,
)
from mlxq.engine.transient import ModelShape
from mlxq.kv.capabilities import CacheKind
from mlxq.kv.projection import GROWTH_STEP, KvFootprint, LayerFootprint

# Two full-attention layers of 1 KiB per token: a row of up to 256 tokens costs 512 KiB.
FOOTPRINT = KvFootprint((LayerFootprint(CacheKind.FULL, 1024, 0, None),) * 2, prefill_chunk=512)
SIZING = Sizing(FOOTPRINT)
ROW = 2 * 1024 * GROWTH_STEP  # bytes of one row of <= 256 tokens


def limits(**overrides) -> Limits:
    base = dict(row_cap=8, prompt_concurrency=4, group_cap=4, prefill_budget=512)
    return Limits(**(base | overrides))


def joiner(prompt: int, done: int = 0, chunk: int | None = None, **kw) -> JoinerView:
    return JoinerView(Extent(prompt, 16), done, min(512, prompt - 1 - done) if chunk is None else chunk, **kw)


# --- admission ------------------------------------------------------------------------
def test_admission_fills_the_kv_budget_and_stops_at_the_row_that_would_pass_it():
    load, request = Load((), ()), Extent(100, 100)
    admitted = 0
    while can_admit(load, request, limits(kv_budget=3 * ROW), SIZING):
        load, admitted = load.with_joiner(request), admitted + 1
    assert admitted == 3
    # The padded layout: one long row makes every row cost its length.
    long_row = Load((Extent(600, 100),), ())
    assert SIZING.projected_bytes(long_row) == 3 * ROW
    assert not can_admit(long_row, Extent(10, 10), limits(kv_budget=5 * ROW), SIZING)
    assert can_admit(long_row, Extent(10, 10), limits(kv_budget=6 * ROW), SIZING)


def test_admission_respects_row_cap_prompt_concurrency_and_waits_behind_preempted_rows():
    one = Extent(10, 10)
    assert not can_admit(Load((one,) * 7, (one,)), one, limits(), SIZING)  # 8 rows: the cap
    assert not can_admit(Load((), (one,) * 4), one, limits(), SIZING)  # 4 joiners prefilling
    assert can_admit(Load((one,) * 3, (one,) * 3), one, limits(), SIZING)
    assert not can_admit(Load((), (), preempted=1), one, limits(), SIZING)  # FIFO: requeued rows first


def test_short_prefills_take_no_prompt_concurrency_slot():
    one = Extent(500, 64)
    waiting = Load((), (one,) * 6, short=5)  # one long prefill, five short ones
    assert can_admit(waiting, one, limits(prompt_concurrency=2), SIZING)  # a second long prefill
    assert not can_admit(Load((), (one,) * 6, short=4), one, limits(prompt_concurrency=2), SIZING)
    assert can_admit(Load((), (one,) * 6), one, limits(prompt_concurrency=2), SIZING, own_tokens=SHORT_PREFILL)
    assert not can_admit(Load((), (one,) * 6), one, limits(prompt_concurrency=2), SIZING,
                         own_tokens=SHORT_PREFILL + 1)
    assert not can_admit(Load((one,), (one,) * 7, short=7), one, limits(), SIZING, own_tokens=0)  # the row cap holds


def test_a_joiners_own_prefill_is_what_neither_the_cache_nor_its_leader_gives_it():
    views = [joiner(500),  # a leader, all its own
             joiner(500, leader=0, following=True, wait_until=499, shared=450),  # waits: 49 of its own
             joiner(900, leader=0, following=True, wait_until=499, shared=450),  # a long tail after the share
             joiner(500, done=460),  # a cached prefix
             joiner(500, done=300)]  # a long prompt most of the way through
    assert [v.own_tokens for v in views] == [499, 49, 449, 39, 199]
    assert load_of([], views).short == 2
    # The leader holds the one slot; its waiting follower takes none: a preempted row waits for the slot.
    plan = plan_intake(views[:2], [(Extent(500, 64), False)], [], limits(prompt_concurrency=1), SIZING)
    assert plan.released == () and plan.readmit == 0


def test_released_tails_advance_together_within_the_step_budget():
    tails = [joiner(500, done=460) for _ in range(12)]  # 39 tokens each
    plan = plan_prefill(tails, limits(group_cap=16, prefill_budget=2048))
    assert plan.advance == tuple(range(12)) and plan.together
    assert plan_prefill(tails, limits(group_cap=16, prefill_budget=200)).advance == tuple(range(6))


def test_a_wave_of_short_tails_prefills_as_one_forward_within_the_tail_budget():
    def cached(n):  # agents whose 2195-token system prompt is cached: 52 tokens of their own each
        return [joiner(2248, done=2195) for _ in range(n)]

    wide = dict(group_cap=128, prefill_budget=2048)
    assert plan_prefill(cached(64), limits(**wide)).advance == tuple(range(40))  # one chunk's worth (the last passes)
    plan = plan_prefill(cached(64), limits(**wide, tail_budget=4096))
    assert plan.advance == tuple(range(64)) and plan.together and set(plan.chunks) == {52}
    assert plan_prefill(cached(100), limits(**wide, tail_budget=4096)).advance == tuple(range(78))  # never past it
    # A long chunk among them: one chunk's worth again, FIFO (no tail passes it).
    mixed = cached(50) + [joiner(3000)] + cached(5)
    assert plan_prefill(mixed, limits(**wide, tail_budget=4096)).advance == tuple(range(50))
    long_first = [joiner(1000)] + cached(40)
    assert plan_prefill(long_first, limits(**wide, tail_budget=4096)).advance == tuple(range(31))


def test_memory_room_holds_newcomers_only_while_busy():
    one = Extent(100, 100)
    tight = limits(memory_room=ROW // 2)
    assert can_admit(Load((), ()), one, tight, SIZING)  # idle: never refused for memory, it runs alone
    assert not can_admit(Load((one,), ()), one, tight, SIZING)  # busy: it waits for room
    assert can_admit(Load((one,), ()), one, limits(memory_room=ROW), SIZING)


def test_a_shared_prefix_counts_once_in_the_kv_budget_but_joiners_copies_in_the_memory_room():
    """Rows of one group count the prefix once and their tails (padded to the longest tail); joiners
    of the group prefilling more than a short tail hold a copy while they prefill: the memory room
    takes those copies (short tails read the prefix by reference: no copy)."""
    shared = tuple(Extent(1000, 24, shared=990, prefix=0) for _ in range(4))
    plain = tuple(Extent(1000, 24) for _ in range(4))
    grouped = Sizing(FOOTPRINT, shared_layers=(True, True))
    tail = 2 * 1024 * GROWTH_STEP  # 34 own tokens padded to 256, two layers
    assert grouped.projected_bytes(Load(shared, ())) == 4 * tail + 2 * 1024 * 990
    assert grouped.projected_bytes(Load(plain, ())) == SIZING.projected_bytes(Load(plain, ())) == 16 * tail
    assert SIZING.projected_bytes(Load(shared, ())) == 16 * tail  # no layer shares: counted whole
    half_shared = (Extent(1000, 24, 990, 0), Extent(1000, 24))  # a stray pads the tails to its length
    assert grouped.projected_bytes(Load(half_shared, ())) == 2 * 4 * tail + 2 * 1024 * 990

    newcomer = Extent(1000, 24, 990, 0)
    long_tails = tuple(Extent(1000, 24, shared=500, prefix=0) for _ in range(4))  # 500 own tokens: a copy
    room = limits(memory_room=3 * 4 * tail + 4 * tail, row_cap=16, prompt_concurrency=8)  # 3 copies + newcomer
    assert can_admit(Load(shared, long_tails[:3]), newcomer, room, grouped)
    assert not can_admit(Load(shared, long_tails), newcomer, room, grouped)  # a fourth copy in flight
    assert can_admit(Load(shared, shared), newcomer, room, grouped)  # short tails on the prefix: no copies
    assert can_admit(Load(shared, plain), newcomer, room, grouped)  # others' KV is in the room already


def test_a_lone_joiner_always_prefills_but_joiners_together_keep_to_the_transient_reserve():
    sizing = Sizing(FOOTPRINT, ModelShape(hidden=64, intermediate=128, heads=4, vocab=1000, dtype_bytes=2))
    long_prompt, reserve = Extent(2000, 10), limits(transient_budget=1)
    assert can_admit(Load((), ()), long_prompt, reserve, sizing)
    assert not can_admit(Load((), (long_prompt,)), long_prompt, reserve, sizing)
    # A reserve of 0: the memory plan set nothing aside for transients, so nobody is held to one.
    assert can_admit(Load((), (long_prompt,)), long_prompt, limits(transient_budget=0), sizing)


# --- the per-step prefill budget, FIFO ------------------------------------------------
def test_joiners_advance_fifo_within_one_chunks_worth_of_tokens():
    plan = plan_prefill([joiner(100), joiner(300), joiner(200), joiner(50)], limits())
    assert plan.advance == (0, 1, 2) and plan.together  # 99 + 299 < 512: the third may pass it
    assert plan.chunks == (99, 299, 199)  # each its own prompt[:-1], chunk boundaries as the serial lane's
    assert plan_prefill([joiner(2000), joiner(20)], limits()).advance == (0,)  # a whole chunk spends the step
    assert plan_prefill([joiner(20), joiner(2000)], limits()).advance == (0, 1)


def test_prefill_skips_prefilled_waiting_and_restoring_joiners_and_keeps_to_the_group_cap():
    views = [joiner(40, done=39), joiner(300, restoring=True), joiner(300, leader=0, following=True),
             joiner(30), joiner(30), joiner(30)]
    plan = plan_prefill(views, limits(group_cap=2))
    assert plan.restore == (1,) and plan.advance == (3, 4) and plan.together
    assert not plan_prefill(views, limits(group_cap=1)).together
    assert not plan_prefill(views, limits(), quantized=True).together  # quantized joiners advance one by one


# --- intake: cancelled, released, readmitted ------------------------------------------
def test_intake_drops_cancelled_and_releases_followers_whose_leader_is_done_or_gone():
    views = [joiner(300, done=100, cancelled=True),  # a leader, cancelled
             joiner(300, leader=0, following=True, wait_until=299),
             joiner(400, done=399),  # a leader that is done
             joiner(400, leader=2, following=True, wait_until=399),
             joiner(400, done=100),
             joiner(400, leader=4, following=True, wait_until=399),  # still waiting
             joiner(400, leader=None, following=True, wait_until=399)]  # its leader already joined
    plan = plan_intake(views, [], [], limits(), SIZING)
    assert plan.cancelled_joiners == (0,) and plan.released == (1, 3, 6) and plan.readmit == 0


def test_preempted_rows_come_back_oldest_first_while_slots_and_memory_allow():
    rows = [(Extent(100, 50), False), (Extent(100, 50), True), (Extent(100, 50), False), (Extent(100, 50), False)]
    plan = plan_intake([], rows, [], limits(prompt_concurrency=2), SIZING)
    assert plan.cancelled_preempted == (1,) and plan.readmit == 2  # rows 0 and 2: two prefill slots
    busy = plan_intake([], rows, [Extent(100, 50)], limits(memory_room=ROW // 2), SIZING)
    assert busy.readmit == 0  # a running row and no room for another's KV: they wait


# --- shared prefill: who leads ---------------------------------------------------------
def view(prompt, done=0, trimmable=True, snapshot_at=None, namespace="m", can_lead=True) -> PrefixView:
    return PrefixView(namespace, prompt, done, trimmable, snapshot_at, can_lead)


SHARED = list(range(1000, 1000 + 2 * MIN_SHARED_PREFILL))


def test_the_first_joiner_still_prefilling_the_shared_prefix_leads():
    me = view(SHARED + [1, 2, 3])
    leaders = [view([5] * 300), view(SHARED + [7, 8], can_lead=False), view(SHARED + [9, 9, 9]),
               view(SHARED + [4, 4])]
    choice = choose_leader(me, leaders)
    assert choice.leader == 2 and choice.wait_until == len(SHARED) + 2  # its whole prompt[:-1] state
    assert choice.shared == len(SHARED)  # what the follower then takes


def test_no_leader_for_a_short_share_another_namespace_or_a_leader_already_past_it():
    short = view(SHARED[: MIN_SHARED_PREFILL - 1] + [1, 2])
    assert choose_leader(short, [view(SHARED[: MIN_SHARED_PREFILL - 1] + [3, 4])]) is None
    assert choose_leader(view(SHARED + [1]), [view(SHARED + [2, 3], namespace="other")]) is None
    done = view(SHARED + [2, 3], done=len(SHARED) + 2)
    assert choose_leader(view(SHARED + [1]), [done]) is None
    # A joiner that has the shared part already (from the prompt cache) follows nobody.
    assert choose_leader(view(SHARED + [1], done=len(SHARED)), [view(SHARED + [2, 3])]) is None


def test_an_agents_short_tail_looks_at_no_candidate():
    def unread():
        raise AssertionError("candidates read")
        yield

    tail = view(SHARED + [1] * (MIN_SHARED_PREFILL - 1), done=len(SHARED) + 1)  # 63 tokens of its own left
    assert choose_leader(tail, unread()) is None


def test_rings_and_recurrent_state_follow_only_to_the_leaders_system_prompt_snapshot():
    at = len(SHARED)
    leader = view(SHARED + [2] * 50, trimmable=False, snapshot_at=at)
    choice = choose_leader(view(SHARED + [1] * 50, trimmable=False, snapshot_at=at), [leader])
    assert choice.wait_until == at
    assert choose_leader(view(SHARED + [1]), [view(SHARED + [2] * 50, trimmable=False)]) is None


# --- who gives way: eviction and preemption order ---------------------------------------
def test_the_newest_rows_are_shed_first_and_one_always_runs():
    limit = 100 * ROW
    assert rows_that_fit(active=50 * ROW, limit=limit, rows=8, kv_now=8 * ROW, kv_growth=0, step_per_row=0) == 8
    kept = rows_that_fit(active=99 * ROW, limit=limit, rows=8, kv_now=8 * ROW, kv_growth=0, step_per_row=0)
    assert 1 <= kept < 8
    assert rows_that_fit(active=200 * ROW, limit=limit, rows=8, kv_now=8 * ROW, kv_growth=0, step_per_row=0) == 1
    plan = plan_decode_preemption([0, 0, 0, 0], row_cap=8)
    assert plan.resume_first == (0, 1) and plan.held_back == (2, 3)  # the oldest resume first


def test_common_prefix_is_exact_across_compare_blocks_and_sequence_types():
    from mlxq.store.prefix import COMPARE_BLOCK, common_prefix

    a = list(range(3 * COMPARE_BLOCK + 7))
    for cut in (0, 1, COMPARE_BLOCK - 1, COMPARE_BLOCK, COMPARE_BLOCK + 1, 2 * COMPARE_BLOCK + 5, len(a) - 1):
        b = a[:cut] + [-1] + a[cut + 1 :]
        assert common_prefix(a, b, len(a)) == cut
        assert common_prefix(a, tuple(b), len(a)) == cut  # a list against a tuple: token by token
        assert common_prefix(a, b, cut // 2) == cut // 2
    assert common_prefix(a, a[:10], len(a)) == 10 and common_prefix(a, a, 5) == 5


def test_a_burst_on_a_cached_prefix_follows_no_leader_and_a_cold_one_follows_the_first():
    """Candidates that differ within MIN_SHARED_PREFILL tokens past the joiner's cached part are skipped."""
    system = list(range(1000, 3200))
    agents = [system + [i] * 50 for i in range(4)]
    cached = [PrefixView("ns", p, len(system), True, len(system)) for p in agents]
    assert all(choose_leader(view, cached[:i]) is None for i, view in enumerate(cached))
    cold = [PrefixView("ns", p, 0, True, len(system)) for p in agents]
    choice = choose_leader(cold[3], cold[:3])
    assert choice is not None
    assert (choice.leader, choice.shared, choice.wait_until) == (0, len(system), len(agents[0]) - 1)


# --- a burst still arriving -----------------------------------------------------------
def tail(at: float, **kw) -> JoinerView:
    """A fresh agent's 40-token tail after a cached 2,000-token prefix, admitted at ``at`` seconds."""
    return JoinerView(Extent(2041, 16), 2000, 40, admitted_at=at, **kw)


def test_a_burst_of_tails_is_held_while_it_arrives_and_at_most_its_window():
    hold = BurstHold(window_s=0.15, gap_s=0.02)
    arriving = [tail(0.004), tail(0.009)]  # the burst's first (at 0.000) was prefilled alone
    assert hold_for_burst(arriving, (0.004, 0.009), now=0.010, hold=hold)  # more may follow
    assert not hold_for_burst(arriving, (0.004, 0.009), now=0.030, hold=hold)  # 21 ms without one: all came
    steady = [tail(0.01 * i) for i in range(20)]
    assert hold_for_burst(steady, (0.18, 0.19), now=0.145, hold=hold)
    assert not hold_for_burst(steady, (0.18, 0.19), now=0.151, hold=hold)  # the first waited its window


def test_a_held_burst_says_how_long_it_waits_without_another_arrival():
    hold = BurstHold(window_s=0.15, gap_s=0.02)
    arriving = [tail(0.004), tail(0.009)]
    left = hold_left(arriving, (0.004, 0.009), now=0.010, hold=hold)
    assert abs(left - 0.019) < 1e-9  # the newest arrival's 20 ms gap
    assert not hold_for_burst(arriving, (0.004, 0.009), now=0.010 + left + 1e-6, hold=hold)  # then it goes
    steady = [tail(0.01 * i) for i in range(20)]
    assert abs(hold_left(steady, (0.18, 0.19), now=0.145, hold=hold) - 0.005) < 1e-9  # the first's window ends
    assert hold_left(steady, (0.18, 0.19), now=0.2, hold=hold) == 0.0


def test_no_hold_for_a_lone_request_a_long_prefill_or_without_a_window():
    hold = BurstHold(window_s=0.15, gap_s=0.02)
    assert not hold_for_burst([tail(5.0)], (1.0, 5.0), now=5.001, hold=hold)  # alone: it prefills at once
    assert not hold_for_burst([tail(5.0)], (5.0,), now=5.001, hold=hold)  # the first request ever
    cold = JoinerView(Extent(2041, 16), 0, 512, admitted_at=0.001)
    assert not hold_for_burst([tail(0.0), cold], (0.0, 0.001), now=0.002, hold=hold)  # a long prefill waits not
    assert not hold_for_burst([tail(0.0), tail(0.001, following=True, leader=0)], (0.0, 0.001), now=0.002,
                              hold=hold)
    assert not hold_for_burst([tail(0.0), tail(0.001)], (0.0, 0.001), now=0.002, hold=BurstHold())  # default


def test_requests_on_their_way_hold_even_the_bursts_first_within_its_window():
    """The server read more requests than it submitted: the first arrival waits for them (not prefilled
    alone while they queue behind its forward); nothing on the way, a lone request goes at once."""
    hold = BurstHold(window_s=0.15, gap_s=0.02)
    first = [tail(5.0)]
    assert hold_for_burst(first, (1.0, 5.0), now=5.001, hold=hold, on_the_way=3)
    assert hold_for_burst(first, (5.0,), now=5.001, hold=hold, on_the_way=1)  # the first request ever, too
    assert not hold_for_burst(first, (1.0, 5.0), now=5.001, hold=hold, on_the_way=0)
    assert hold_for_burst(first, (1.0, 5.0), now=5.149, hold=hold, on_the_way=3)  # past the gap: still coming
    assert not hold_for_burst(first, (1.0, 5.0), now=5.15, hold=hold, on_the_way=3)  # its window is the limit
    cold = JoinerView(Extent(2041, 16), 0, 512, admitted_at=5.0)
    assert not hold_for_burst([cold], (5.0,), now=5.001, hold=hold, on_the_way=3)  # a long prefill waits not
    assert not hold_for_burst(first, (5.0,), now=5.001, hold=BurstHold(), on_the_way=3)  # no window, no hold


def test_a_held_burst_sleeps_until_arrivals_stop_for_its_gap_or_its_window_ends():
    """The engine thread sleeping through a held burst: each newer submission (taken in or not) moves
    the end to its gap; requests on their way keep it to the window; the window always ends it."""
    hold = BurstHold(window_s=0.15, gap_s=0.02)
    held = held_until([tail(0.0), tail(0.004)], (0.0, 0.004), hold)
    assert (held.gap_ends, held.window_ends) == (0.024, 0.15)
    assert burst_quiet_at(held, newest_arrival=0.004, gap_s=0.02) == 0.024  # nothing newer came
    assert burst_quiet_at(held, newest_arrival=0.05, gap_s=0.02) == 0.07  # a newer arrival moves it
    assert burst_quiet_at(held, newest_arrival=0.14, gap_s=0.02) == 0.15  # never past the window
    assert burst_quiet_at(held, newest_arrival=0.004, gap_s=0.02, on_the_way=2) == 0.15
    first_ever = held_until([tail(1.0)], (1.0,), hold)
    assert first_ever.window_ends == 1.15 and burst_quiet_at(first_ever, 1.0, 0.02) == 1.02


def test_requests_on_their_way_are_counted_once_until_settled_and_forgotten_when_stale():
    way = OnTheWay(stale_s=1.0)
    a, b = {}, {}
    way.read(a, 10.0)
    way.read(a, 10.1)  # more of the same request: counted once
    way.read(b, 10.2)
    assert way.pending(10.3) == 2
    way.settled(a)
    way.settled(a)  # its route, then its response's end: settled once
    assert way.pending(10.3) == 1 and way.settled_at > 0
    way.read(a, 10.4)  # a settled request read again (a late body chunk) does not count again
    assert way.pending(10.5) == 1
    assert way.pending(11.2) == 0  # read over a second ago: it no longer holds anything
    way.settled(b)
    assert way.pending(10.5) == 0
