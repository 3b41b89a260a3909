"""Where a batch-lane request's time to first token goes: admission to token 0, in phases.

The scheduler marks a few points on the way (``time.monotonic``, as the
request's other timings): ``admitted`` (the engine picked the request up),
``leased`` (its prompt-cache lookup and lease are done), ``prefill`` (its
first chunk's forward starts), ``prefilled`` (all but its last prompt token
are in its caches: that forward was evaluated, so this point is synchronized
with the device), ``joining`` (the step that joins it to the running batch
starts), ``joined`` (its caches were joined: graph building only, the copies
run on the device with the next decode step) and ``first`` (token 0 handed
out). A phase is the time between one present mark and the next, so the
phases add up to ``ttft - queue``; a mark that never happened (a row whose
prefix was all cached never prefills) leaves its time in the phase before
(each phase runs from its mark to the next present one).

    lease     admitted -> leased      prefix lookup, lease, leader choice
    wait      leased -> prefill       other work of the engine before its chunk: decode steps, other joiners
    prefill   prefill -> prefilled    its chunks' forwards (with the joiners advancing together), evaluated
    ready     prefilled -> joining    the rest of that step and any later one until it joins (snapshots, waits)
    join      joining -> joined       building the joined caches (host time; the copies run later)
    first     joined -> first         the decode step computing token 0, the join's device work included

On the CPU token 0 comes from a forward of the joiners before they join:
``join`` then holds that forward and ends at the token (``joined`` comes
after it and is dropped).
"""

from __future__ import annotations

import time

ORDER = ("admitted", "leased", "prefill", "prefilled", "joining", "joined")
PHASES = ("lease", "wait", "prefill", "ready", "join", "first")  # the phase ending at each next mark


class FirstTokenPhases:
    """Marks on one request's way to token 0; the first time a point is reached counts."""

    def __init__(self, admitted: float):
        self._marks: dict[str, float] = {"admitted": admitted}

    def mark(self, point: str) -> None:
        if point not in ORDER:
            raise ValueError(f"unknown first-token point {point!r}")
        self._marks.setdefault(point, time.monotonic())

    @property
    def marked(self) -> bool:
        """Any point past admission was marked (the batch lane marks them; the serial lane does not)."""
        return len(self._marks) > 1

    def durations_ms(self, first: float | None) -> dict[str, float] | None:
        """Phase name -> milliseconds, each from its mark to the next present one (the last to token 0,
        ``first``); None when nothing was marked or no token came."""
        if first is None or not self.marked:
            return None
        points = [(p, self._marks[p]) for p in ORDER if p in self._marks and self._marks[p] <= first]
        ends = [t for _, t in points[1:]] + [first]
        return {PHASES[ORDER.index(point)]: round(1000 * max(end - start, 0.0), 1)
                for (point, start), end in zip(points, ends, strict=True)}
