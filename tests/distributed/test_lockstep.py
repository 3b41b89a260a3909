"""engine/lockstep.py in one process (a world of one rank): what rank 0 shares, when a cancellation
reaches the engine's copy, and how open requests are failed when a rank is lost."""

from __future__ import annotations

import pickle

import pytest

from mlxq.distributed.world import World
from mlxq.engine.lockstep import Lockstep
from mlxq.engine.types import FinishReason, Request, SamplingParams, TokenEvent


@pytest.fixture
def lockstep():
    import mlx.core as mx

    group = mx.distributed.init()  # no launcher in the environment: a world of one
    assert group.size() == 1
    return Lockstep(World(0, 1, "none", group))


def _request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(temperature=0.5, logit_bias={7: -1.0}), max_tokens=4)


def test_a_cancellation_reaches_the_engine_at_an_iteration(lockstep):
    original = _request("a")
    copy, _ = lockstep.track(original, lambda event: None)
    assert copy is not original and copy.prompt_ids == [1, 2, 3]
    payload = lockstep._payload([copy], stop=False)
    shared = pickle.loads(payload)["arrivals"][0]
    assert Request(**shared).params == original.params  # what the other ranks rebuild
    original.cancel()
    assert not copy.cancelled.is_set()  # set only where every rank sets it
    lockstep.exchange([], stop=False, digest=[0, 0, 0, 0])  # its size in this iteration's gather
    assert not copy.cancelled.is_set() and lockstep.news_in_flight
    lockstep.exchange([], stop=False, digest=[0, 0, 0, 0])  # the gather read: the message queued
    assert not copy.cancelled.is_set() and lockstep.news_in_flight
    assert lockstep.exchange([], stop=False, digest=[0, 0, 0, 0]).taken_at == 1  # the message read
    assert copy.cancelled.is_set() and not lockstep.news_in_flight


def test_an_iteration_with_nothing_new_costs_one_gather(lockstep):
    assert lockstep._payload([], stop=False) == b""
    for _ in range(3):
        assert lockstep.exchange([], stop=False, digest=[0, 0, 0, 0]).stop is False
    assert lockstep.collectives == 3
    assert lockstep.exchange([], stop=True, digest=[0, 0, 0, 0]).stop is False  # taken at iteration 4
    assert lockstep.exchange([], stop=False, digest=[0, 0, 0, 0]).stop is False  # its message queued
    stopped = lockstep.exchange([], stop=False, digest=[0, 0, 0, 0])
    assert stopped.stop is True and stopped.taken_at == 4
    assert lockstep.rank_memory and lockstep.iterations == 6
    assert lockstep.collectives == 6  # a gather each for 1-5, the stop's message; nothing after the stop


def test_a_lost_rank_fails_open_requests_once(lockstep):
    seen = []
    _, emit = lockstep.track(_request("a"), seen.append)
    _, emit_b = lockstep.track(_request("b"), seen.append)
    emit(TokenEvent("a", text="x", token_id=5))
    emit_b(TokenEvent("b", finish_reason=FinishReason.STOP))
    assert lockstep.fail_open("rank 1 exited") == 1  # b had finished
    emit(TokenEvent("a", text="late", token_id=6))  # the engine, after the failure: dropped
    assert [(e.request_id, e.finish_reason) for e in seen] == [("a", None), ("b", FinishReason.STOP),
                                                                  ("a", FinishReason.ERROR)]
    assert seen[-1].error == "rank 1 exited" and lockstep.failure == "rank 1 exited"


def test_ranks_whose_digests_differ_stop_naming_the_rank_and_the_gathered_iteration(lockstep):
    # Rows as the gather returns them: news size, the digest (DIGEST_NAMES), SSD state, memory.
    leader = [0, 2, 4, 0, 96, 12345, 0, 10, 20]
    lockstep._check_digests([leader, list(leader)], iteration=7)
    drifted = [0, 2, 4, 0, 95, 12345, 0, 10, 20]
    with pytest.raises(RuntimeError, match=r"rank 1 diverged from rank 0 at iteration 7 \(.*generated_tokens 96 vs 95"):
        lockstep._check_digests([leader, drifted], iteration=7)


def _iteration(lockstep, quiet: bool, work: list | None = None) -> float:
    """One engine iteration's intake and exchange; the timeout rank 0's inbox was waited on."""
    waited = []

    def drain(timeout: float) -> list:
        waited.append(timeout)
        return work or []

    taken = lockstep.idle_wait(drain, 0.25)
    lockstep.exchange(taken, stop=False, digest=[0, 0, 0, 0], quiet=quiet)
    return waited[0]


def test_ranks_sleep_once_a_gather_shows_every_rank_quiet(lockstep):
    from mlxq.distributed.wake import WakeChannel

    lockstep.wake, lockstep.idle_heartbeat_s = WakeChannel(0), 0.5  # a world of one: nobody else to wake
    assert [_iteration(lockstep, quiet=True) for _ in range(2)] == [0.25, 0.25]  # the first gather read at 2
    assert _iteration(lockstep, quiet=True) == 0.5 and lockstep.sleeps == 1  # asleep, up to the heartbeat
    # Woken by a request: the next iteration does not sleep (its gather, read then, is from before it),
    # nor any while the request's news travels and the engine works on it.
    assert _iteration(lockstep, quiet=True, work=[_request("a")]) == 0.5
    assert [_iteration(lockstep, quiet=False) for _ in range(4)] == [0.25] * 4
    assert lockstep.sleeps == 2
    assert [_iteration(lockstep, quiet=True) for _ in range(3)] == [0.25, 0.25, 0.5]  # idle again: asleep


def test_without_a_wake_channel_ranks_never_sleep(lockstep):
    assert [_iteration(lockstep, quiet=True) for _ in range(4)] == [0.25] * 4
    assert lockstep.sleeps == 0 and lockstep.as_dict()["idle_wait"] == "collective"
