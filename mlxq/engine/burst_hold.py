"""A burst of agents still arriving: hold their tails' prefill a moment, decided as plain data.

One of the step's decisions (engine/step_plan.py lists the others): the
scheduler asks ``hold_for_burst`` before a step's prefill, with what it
sees of its joiners (``JoinerView``) and its last two admission times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxq.engine.step_plan import JoinerView

# On a GPU a burst's tails wait at most this long for the rest of the burst (hold_for_burst): on the
# H200 64 agents' requests reached the engine over ~0.1 s.
BURST_WINDOW_S = 0.15


@dataclass(frozen=True)
class BurstHold:
    """How long joiners' tails wait for the rest of their burst (engine/scheduler.py)."""

    window_s: float = 0.0  # at most this long after the burst's first joiner (0: never wait)
    gap_s: float = 0.02  # joiners admitted this close together are one burst still arriving


def hold_for_burst(joiners: Sequence[JoinerView], admissions: Sequence[float], now: float, hold: BurstHold) -> bool:
    """Whether to hold this step's prefill for joiners still arriving (``admissions``: the scheduler's
    last two admission times, oldest first, running rows' included).

    A burst of agents on a cached prompt reaches the engine over ~0.1 s (each request parsed and
    tokenized in the server): prefilled as it comes, a first group's forward and decode step run
    while the rest queue behind them (on the H200, 64 agents split 21 + 43: the second group's
    TTFT ~0.85 s against ~0.4 s). Hold while every joiner is a fresh short tail (nobody with a
    long prefill of its own is delayed), the last two admissions came within ``gap_s`` of each
    other (a lone request is never held), the newest within ``gap_s`` of now, and the oldest
    joiner within ``window_s``. Rows already decoding go on meanwhile; a steady stream of
    arrivals closer than ``gap_s`` waits up to ``window_s`` each time, in fewer, larger forwards."""
    if hold.window_s <= 0 or not joiners or len(admissions) < 2:
        return False
    if not all(j.finishes_short_tail and not (j.following or j.restoring or j.cancelled) for j in joiners):
        return False
    previous, last = admissions[-2], admissions[-1]
    first = min(j.admitted_at for j in joiners)
    return now - last < hold.gap_s and last - previous < hold.gap_s and now - first < hold.window_s


def hold_left(joiners: Sequence[JoinerView], admissions: Sequence[float], now: float, hold: BurstHold) -> float:
    """Seconds until ``hold_for_burst`` (holding now) stops holding unless another request arrives: the
    newest admission's ``gap_s`` or the oldest joiner's ``window_s`` runs out, whichever comes first.
    The engine thread waits that long for a submission instead of polling (engine/engine.py)."""
    first = min(j.admitted_at for j in joiners)
    return max(0.0, min(admissions[-1] + hold.gap_s, first + hold.window_s) - now)
