"""Replaying MLX's global key for a resumed seeded request, and the serial lane's requeue decisions."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler

from mlxq.engine.preempt import MAX_PREEMPTIONS
from mlxq.engine.serial_resume import MAX_DELAY_S, DrawLedger, InexactResume, requeue_delay

LOGPROBS = mx.random.normal((1, 64), key=mx.random.key(3))
LOGPROBS = LOGPROBS - mx.logsumexp(LOGPROBS, keepdims=True)


def _draws(sampler, ledger: DrawLedger | None, first: int, n: int) -> list[int]:
    tokens = []
    for i in range(first, first + n):
        if ledger is not None:
            ledger.before_draw(i)
        tokens.append(sampler(LOGPROBS).item())
        if ledger is not None:
            ledger.handed_out(i + 1)
    return tokens


@pytest.mark.parametrize("xtc, per_draw", [(0.0, 1), (0.5, 2)])
def test_a_replayed_key_continues_the_undisturbed_draws(xtc, per_draw):
    sampler = make_sampler(0.9, top_p=0.95, xtc_probability=xtc, xtc_threshold=0.05)
    mx.random.seed(21)
    undisturbed = _draws(sampler, None, 0, 12)

    mx.random.seed(21)
    ledger = DrawLedger(21, per_draw)
    head = _draws(sampler, ledger, 0, 5)
    ledger.before_draw(5)  # draw 5 was made (a pipelined step) but its token never went out
    sampler(LOGPROBS)
    expected = ledger.key_before(5)
    mx.random.seed(999)  # other requests move the global key meanwhile
    sampler(LOGPROBS)
    ledger.replay(5, expected)
    assert head + _draws(sampler, ledger, 5, 7) == undisturbed


def test_a_replay_that_misses_the_recorded_key_fails_instead_of_diverging():
    sampler = make_sampler(0.9, xtc_probability=0.5, xtc_threshold=0.05)  # two global draws per token
    mx.random.seed(5)
    ledger = DrawLedger(5, per_draw=1)  # wrong on purpose
    _draws(sampler, ledger, 0, 3)
    with pytest.raises(InexactResume):
        ledger.replay(3, ledger.key_before(3))


def test_requeue_back_off_grows_and_is_capped():
    delays = [requeue_delay(n) for n in range(1, MAX_PREEMPTIONS + 1)]
    assert delays == sorted(delays) and delays[0] < 0.1 and delays[-1] == MAX_DELAY_S
    assert sum(delays) < 10  # a request that cannot fit fails within seconds, not minutes
