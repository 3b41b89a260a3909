"""A request's admission -> token 0 split into phases: from the points marked, adding up to the whole."""

from __future__ import annotations

import time

import pytest

from mlxq.engine.ttft_phases import FirstTokenPhases


def test_phases_run_from_each_mark_to_the_next_and_add_up_to_the_whole():
    admitted = time.monotonic()
    phases = FirstTokenPhases(admitted)
    assert phases.durations_ms(admitted + 1) is None  # nothing marked: the serial lane reports none
    for point in ("leased", "prefill", "prefilled", "joining", "joined"):
        time.sleep(0.002)
        phases.mark(point)
    first = time.monotonic() + 0.003
    out = phases.durations_ms(first)
    assert list(out) == ["lease", "wait", "prefill", "ready", "join", "first"]
    assert all(v >= 1.0 for v in out.values() if v) and out["first"] >= 3.0
    assert abs(sum(out.values()) - 1000 * (first - admitted)) < 0.6
    assert phases.durations_ms(None) is None


def test_a_point_never_reached_leaves_its_time_in_the_phase_before_and_the_first_mark_counts():
    admitted = time.monotonic()
    phases = FirstTokenPhases(admitted)
    phases.mark("leased")
    time.sleep(0.005)
    phases.mark("joining")  # all cached: it never prefilled
    phases.mark("leased")  # a second mark of a point (a requeued row) keeps the first
    first = time.monotonic()
    out = phases.durations_ms(first)
    assert list(out) == ["lease", "wait", "join"] and out["wait"] >= 5.0
    with pytest.raises(ValueError):
        phases.mark("decoded")


def test_points_after_token_0_are_dropped():
    """On the CPU token 0 comes from the joiners' own forward, before they join."""
    admitted = time.monotonic()
    phases = FirstTokenPhases(admitted)
    phases.mark("leased")
    phases.mark("joining")
    first = time.monotonic()
    time.sleep(0.002)
    phases.mark("joined")
    assert list(phases.durations_ms(first)) == ["lease", "wait", "join"]
