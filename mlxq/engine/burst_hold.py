"""A burst of agents still arriving: hold their tails' prefill a moment, decided as plain data.

One of the step's decisions (engine/step_plan.py lists the others): the
scheduler asks ``hold_for_burst`` before a step's prefill, with what it
sees of its joiners (``JoinerView``) and its last two admission times.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mlxq.engine.step_plan import JoinerView

# On a GPU a burst's tails wait at most this long for the rest of the burst (hold_for_burst): on the
# H200 64 agents' requests reached the engine over ~0.1 s.
BURST_WINDOW_S = 0.15
# Arrivals this close together are one burst still arriving; a held burst is taken in this long after its
# newest submission. MLXQ_BURST_GAP_MS sets it (an A/B lever).
BURST_GAP_S = float(os.environ.get("MLXQ_BURST_GAP_MS", "20")) / 1000


@dataclass(frozen=True)
class BurstHold:
    """How long joiners' tails wait for the rest of their burst (engine/scheduler.py)."""

    window_s: float = 0.0  # at most this long after the burst's first joiner (0: never wait)
    gap_s: float = 0.02  # joiners admitted this close together are one burst still arriving


class OnTheWay:
    """Requests the server has read in full off their sockets and not yet submitted (or answered): a
    burst's rest is on its way to the engine. The event loop counts them (``read``, ``settled``); the
    engine thread asks ``pending``. A request read more than ``stale_s`` ago no longer counts, so
    one that never settled (or parses for long in a worker thread) cannot hold later requests."""

    def __init__(self, stale_s: float = 1.0):
        self.stale_s = stale_s
        self._reads: dict[int, float] = {}  # token -> when it was read (time.monotonic); the loop's thread
        self._tokens = 0
        self.settled_at = 0.0  # the newest settling (time.monotonic): its submission follows at once

    def read(self, scope: dict, at: float) -> None:
        if ON_THE_WAY not in scope:  # counted once, whatever more of it arrives
            self._tokens += 1
            scope[ON_THE_WAY] = self._tokens
            self._reads[self._tokens] = at

    def settled(self, scope: dict) -> None:
        """The request is about to be submitted, or ends without it (any number of calls)."""
        token = scope.get(ON_THE_WAY)
        if token:
            scope[ON_THE_WAY] = 0
            self._reads.pop(token, None)
            self.settled_at = time.monotonic()

    def pending(self, now: float) -> int:
        """Any thread: requests read within ``stale_s`` of ``now`` and not settled."""
        reads = list(self._reads.values())  # one C-level copy under the GIL: the loop cannot change it meanwhile
        return sum(now - at < self.stale_s for at in reads)


ON_THE_WAY = "mlxq.on_the_way"  # the scope key of a request counted by OnTheWay


def hold_for_burst(joiners: Sequence[JoinerView], admissions: Sequence[float], now: float, hold: BurstHold,
                   on_the_way: int = 0) -> bool:
    """Whether to hold this step's prefill for joiners still arriving (``admissions``: the scheduler's
    last two arrival times, oldest first, running rows' included; ``on_the_way``: requests the server
    has read and not yet submitted, OnTheWay).

    A burst of agents on a cached prompt reaches the engine over ~0.1 s (each request parsed and
    tokenized in the server): prefilled as it comes, a first group's forward and decode step run
    while the rest queue behind them (on the H200, 64 agents split 21 + 43: the second group's
    TTFT ~0.85 s against ~0.4 s). Hold while every joiner is a fresh short tail or has nothing left
    to prefill, its whole prompt cached (nobody with a long prefill of its own is delayed), the
    last two admissions came within ``gap_s`` of each other (a lone request is never held), the
    newest within ``gap_s`` of now, and the oldest joiner within ``window_s``. Rows already
    decoding go on meanwhile; a steady stream of arrivals closer than ``gap_s`` waits up to
    ``window_s`` each time, in fewer, larger forwards.

    The server may know more are coming before a second arrives: 64 agents' requests reach its
    sockets within ~10 ms, and the event loop reads several before the first is submitted. With
    requests read and not yet submitted (``on_the_way``), even the burst's first joiner is held
    (within ``window_s``): it is not prefilled alone while the rest queue behind its forward. A lone
    request has nothing on its way."""
    if hold.window_s <= 0 or not joiners:
        return False
    if not all(j.waits_well_for_a_burst for j in joiners):
        return False
    first = min(j.admitted_at for j in joiners)
    if now - first >= hold.window_s:
        return False
    if on_the_way > 0:
        return True
    if len(admissions) < 2:
        return False
    previous, last = admissions[-2], admissions[-1]
    return now - last < hold.gap_s and last - previous < hold.gap_s


def hold_left(joiners: Sequence[JoinerView], admissions: Sequence[float], now: float, hold: BurstHold) -> float:
    """Seconds until ``hold_for_burst`` (holding now) stops holding unless another request arrives: the
    newest admission's ``gap_s`` or the oldest joiner's ``window_s`` runs out, whichever comes first."""
    first = min(j.admitted_at for j in joiners)
    return max(0.0, min(admissions[-1] + hold.gap_s, first + hold.window_s) - now)


@dataclass(frozen=True)
class HeldUntil:
    """When a held burst's wait ends unless more arrive: the newest arrival's gap, the oldest joiner's
    window (monotonic seconds). The engine thread sleeps through the rest of the burst with it
    (``burst_quiet_at``) and takes every arrival in one pass afterwards."""

    gap_ends: float
    window_ends: float


def held_until(joiners: Sequence[JoinerView], admissions: Sequence[float], hold: BurstHold) -> HeldUntil:
    """The ends of ``hold_for_burst``'s hold (holding now), as times rather than seconds left."""
    return HeldUntil(admissions[-1] + hold.gap_s if admissions else 0.0,
                     min(j.admitted_at for j in joiners) + hold.window_s)


def burst_quiet_at(held: HeldUntil, newest_arrival: float, gap_s: float, on_the_way: int = 0) -> float:
    """When the engine thread, sleeping through a held burst, takes its arrivals in: ``gap_s`` after the
    newest request submitted (``newest_arrival``, admitted or not: the thread does not wake per
    arrival, so arrivals it has not taken in still move the end), never past the oldest joiner's
    window. While the burst keeps arriving the engine thread does no Python work per request: the
    server's event loop, reading the rest of the burst, has the GIL to itself. Requests the server
    has read and not submitted (``on_the_way``) keep it asleep up to the window."""
    if on_the_way > 0:
        return held.window_ends
    return min(max(held.gap_ends, newest_arrival + gap_s), held.window_ends)
