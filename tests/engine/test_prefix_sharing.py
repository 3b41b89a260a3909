"""Which running rows form the shared-prefix group, decided from their leases as plain data."""

from __future__ import annotations

from mlxq.engine.prefix_sharing import (
    Group,
    GroupTally,
    SharingPolicy,
    TailsGroup,
    choose_group,
    choose_groups,
    join_in_place,
    row_groups,
    tails_group,
)
from mlxq.kv.sharing_plan import SharingPlan
from mlxq.store.lease import Lease
from mlxq.store.prefix_tree import Node

PLAN = SharingPlan((True,), None)


def tree():
    root = Node((), None, [None])
    a = Node(tuple(range(40)), root, [None], depth=0)
    b = Node(tuple(range(60)), a, [None], depth=40)
    c = Node(tuple(range(30)), a, [None], depth=40)
    return a, b, c


def leases():
    a, b, c = tree()
    return [Lease(100, None, b), Lease(80, None, b), Lease(60, None, c), None, Lease(0, None, None)]


def test_the_group_is_the_node_with_most_rows_times_common_prefix():
    group = choose_group(leases(), SharingPolicy("on", PLAN))
    # a: 3 rows x 40 tokens = 120; b: 2 rows x min(100, 100, 80) = 160
    assert group.prefix_length == 80 and group.shares == (True, True, False, False, False)
    assert group.rows == 2 and group.keep([1, 2, 4]).shares == (True, False, False)


def test_a_longer_minimum_prefix_or_a_lone_row_means_no_group():
    assert choose_group(leases(), SharingPolicy("on", PLAN, min_prefix=81)) is None
    assert choose_group(leases()[:1] + [None], SharingPolicy("on", PLAN)) is None


def test_off_auto_on_the_cpu_and_a_declined_model_never_group():
    assert choose_group(leases(), SharingPolicy("off", None)) is None
    assert choose_group(leases(), SharingPolicy("auto", PLAN)) is None  # worth_sharing: never on the CPU
    declined = SharingPlan((False,), "layers [0] compute attention outside mlx-lm's scaled_dot_product_attention")
    policy = SharingPolicy("on", declined)
    assert choose_group(leases(), policy) is None and policy.declined() == declined.declined


def test_joiners_on_the_groups_prefix_join_it_in_place_the_others_as_strays():
    a, b, c = tree()
    running = [Lease(100, None, b), Lease(80, None, b), Lease(60, None, c)]
    group = choose_group(running, SharingPolicy("on", PLAN))
    assert (group.node, group.prefix_length, group.shares) == (b, 80, (True, True, False))
    joining = [Lease(90, None, b), Lease(50, None, b), Lease(60, None, c), None]
    # 90 cached tokens through b hold the group's 80; 50 stop short of its last token.
    assert join_in_place((group,), running, joining, SharingPolicy("on", PLAN)) == (0, -1, -1, -1)
    assert join_in_place((), running, joining, SharingPolicy("on", PLAN)) is None


def test_a_better_group_among_the_joiners_asks_for_a_rebuild():
    a, b, c = tree()
    running = [Lease(40, None, a), Lease(40, None, a)]
    group = Group(a, 40, (True, True))  # 2 rows x 40 = 80
    joining = [Lease(100, None, b), Lease(100, None, b)]  # b: 2 rows x 100 = 200 > 4 rows x 40 = 160
    # The joiners hold a's 40 tokens too, but b (2 x 100) plus a's rest (2 x 40) beat a alone (4 x 40).
    assert join_in_place((group,), running, joining, SharingPolicy("on", PLAN)) is None
    few = [Lease(50, None, b)]  # 3 rows x 40 = 120 beats b's 1 row: joins in place
    assert join_in_place((group,), running, few, SharingPolicy("on", PLAN)) == (0,)


def test_agents_of_two_prompts_form_two_groups_under_on_and_one_under_auto():
    a, b, c = tree()
    leases = [Lease(100, None, b), Lease(60, None, c), Lease(100, None, b), None, Lease(60, None, c)]
    groups = choose_groups(leases, SharingPolicy("on", PLAN))
    # b: 2 rows x 100 first; among the rest, c (2 x 60) beats a (2 x 40).
    assert [(g.node, g.prefix_length) for g in groups] == [(b, 100), (c, 60)]
    assert row_groups(groups, len(leases)) == [0, 1, 0, -1, 1]
    assert SharingPolicy("auto", PLAN).max_groups == 1 and SharingPolicy("on", PLAN).max_groups == 4
    late = [Lease(70, None, c), Lease(100, None, b)]
    assert join_in_place(groups, leases, late, SharingPolicy("on", PLAN)) == (1, 0)



def test_joiners_read_by_reference_the_prefix_they_all_lease_from_one_chain():
    a, b, c = tree()
    on = SharingPolicy("on", PLAN)
    # b: 3 rows x min(100, 80, 90) = 240 beats a's 3 x 40: the tails start past 80 tokens of b's chain.
    choice = tails_group((), [], [Lease(100, None, b), Lease(80, None, b), Lease(90, None, b)], [], on)
    assert (choice.group.node, choice.group.prefix_length, choice.group.shares, choice.into) == (b, 80, (), None)
    # Leases that part after a: the prefix is a's 40 tokens; what each holds past it is its own tail.
    choice = tails_group((), [], [Lease(100, None, b), Lease(60, None, c)], [], on)
    assert (choice.group.node, choice.group.prefix_length) == (a, 40)
    assert tails_group((), [], [Lease(100, None, b), None], [], on) is None  # one found nothing stored
    assert tails_group((), [], [Lease(100, None, b)], [], on) is None  # a lone joiner
    assert tails_group((), [], [Lease(100, None, b), Lease(80, None, b)], [], SharingPolicy("off", None)) is None
    assert tails_group((), [], [Lease(100, None, b), Lease(80, None, b)], [], None) is None


def test_tails_join_the_running_rows_on_their_prefix_grouping_them_first_if_need_be():
    a, b, c = tree()
    on = SharingPolicy("on", PLAN)
    joining = [Lease(90, None, b), Lease(85, None, b)]
    # Rows decoding on copies of b's prefix (and one on c's): those on b are grouped with the joiners.
    choice = tails_group((), [Lease(100, None, b), Lease(60, None, c), Lease(80, None, b)], joining, [], on)
    assert (choice.group.node, choice.group.prefix_length, choice.group.shares) == (b, 80, (True, False, True))
    assert choice.into is None
    assert tails_group((), [Lease(60, None, c), None], joining, [], on) is None  # no running row on it
    # A running group on b: the joiners append to it.
    running = [Lease(100, None, b), Lease(80, None, b)]
    group = Group(b, 80, (True, True))
    assert tails_group((group,), running, joining, [], on) == TailsGroup(group, 0)
    assert tails_group((group,), running, joining + [Lease(60, None, c)], [], on) is None  # not all of them


def test_auto_counts_the_joiners_still_waiting_on_the_prefix(monkeypatch):
    from mlxq.engine import prefix_sharing

    a, b, c = tree()
    monkeypatch.setattr(prefix_sharing, "worth_sharing", lambda rows, length: rows * length >= 5 * 80)
    auto = SharingPolicy("auto", PLAN)
    joining, waiting = [Lease(100, None, b), Lease(80, None, b)], [Lease(90, None, b)] * 3
    assert tails_group((), [], joining, [], auto) is None  # 2 x 80: per-row copies decode faster
    assert tails_group((), [], joining, waiting, auto).group.prefix_length == 80  # the wave's other three follow


def test_a_tally_kept_over_growing_leases_picks_what_choose_groups_picks():
    """Admission counts a burst's leases once (GroupTally) and asks with each arrival on top: every
    prefix of every order of these leases, with none, one or two asking, gives choose_groups' answer
    (the same node, length and rows; ties to the row met first)."""
    import itertools

    a, b, c = tree()
    pool = [Lease(100, None, b), Lease(80, None, b), Lease(60, None, c), None, Lease(0, None, None),
            Lease(40, None, a), Lease(70, None, c), Lease(45, None, b)]
    policies = [SharingPolicy("on", PLAN), SharingPolicy("on", PLAN, min_prefix=61), SharingPolicy("off", None)]
    orders = [pool, pool[::-1], pool[2:] + pool[:2], [pool[i] for i in (5, 2, 6, 0, 7, 1, 3, 4)]]
    checked = 0
    for policy, order in itertools.product(policies, orders):
        tally = GroupTally()
        for counted in range(len(order) + 1):
            for extra in (0, 1, 2):
                leases = order[: counted + extra]
                if counted + extra > len(order):
                    continue
                expected = choose_groups(leases, policy)
                got = choose_groups(leases, policy, tally)
                assert [(g.node, g.prefix_length, g.shares) for g in got] == \
                    [(g.node, g.prefix_length, g.shares) for g in expected], (policy.mode, counted, extra)
                checked += 1
            if counted < len(order):
                tally.add(order[counted])
    assert checked > 200
