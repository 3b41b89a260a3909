"""Where the batch scheduler's time goes: each decode step in its parts, and prefill and joins.

A pipelined step builds step n+1's graph (Python through the model's
layers: pure host time), queues it (``async_eval``), blocks reading step
n's tokens, then hands them to each row's output (host time). The device's
time shows up in the queueing and the read, split by MLX, not by us: ``async_eval``
itself blocks when MLX holds too much work in flight (on the CPU backend it
runs the previous step's compute), so a device-bound step can wait there
rather than at the read. So ``build`` and ``output`` say how much of a step
the host spends in Python; ``submit`` + ``device_wait`` is the rest.

``cycle`` is the time from one decode step's start to the next one's when
nothing else ran in between (no prefill, no token-0 forward): the engine
loop's whole round, including time spent outside the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class DecodeTiming:
    steps: int = 0
    step_s: float = 0.0  # inside the decode step, everything
    build_s: float = 0.0  # the model's forward and the sampler, as Python building the graph
    submit_s: float = 0.0  # async_eval of that graph
    device_wait_s: float = 0.0  # blocked reading tokens back: the device was still computing
    cycles: int = 0
    cycle_s: float = 0.0
    _last_start: float | None = None

    def record(self, start: float, built: float, submitted: float, waited: float) -> None:
        """``built``/``submitted``: perf_counter when graph building / async_eval ended;
        ``waited``: seconds blocked reading tokens."""
        now = time.perf_counter()
        self.steps += 1
        self.step_s += now - start
        self.build_s += built - start
        self.submit_s += submitted - built
        self.device_wait_s += waited
        if self._last_start is not None:
            self.cycles += 1
            self.cycle_s += start - self._last_start
        self._last_start = start

    @property
    def output_s(self) -> float:
        """What the step spent after the read: handing tokens to each row's output."""
        return max(self.step_s - self.build_s - self.submit_s - self.device_wait_s, 0.0)

    def interrupt(self) -> None:
        """Other work ran (prefill, a forward of joiners): the next gap is not a decode cycle."""
        self._last_start = None

    def as_dict(self) -> dict:
        per_step = (lambda s: round(1000 * s / self.steps, 3)) if self.steps else (lambda s: None)
        return {
            "steps": self.steps,
            "step_ms": per_step(self.step_s),
            "build_ms": per_step(self.build_s),
            "submit_ms": per_step(self.submit_s),
            "device_wait_ms": per_step(self.device_wait_s),
            "output_ms": per_step(self.output_s),
            "cycle_ms": round(1000 * self.cycle_s / self.cycles, 3) if self.cycles else None,
            "totals": {"step_s": self.step_s, "build_s": self.build_s, "submit_s": self.submit_s,
                       "device_wait_s": self.device_wait_s, "cycles": self.cycles, "cycle_s": self.cycle_s},
        }


@dataclass
class PhaseTiming:
    """The batch scheduler's other phases, by wall time: prefill (joiners' chunks, each evaluated
    before the step goes on, so it also waits for a decode step still in flight) and the join
    (token 0 or the pending last token, the merge into the batch)."""

    prefill_iterations: int = 0  # steps that advanced at least one joiner
    prefill_s: float = 0.0
    joins: int = 0  # steps in which prefilled joiners joined
    join_s: float = 0.0
    # Batched prefill forwards (several joiners' chunks in one forward, left- or right-padded to one
    # length): the prompt tokens they computed and the positions they computed, padding included.
    batched_forwards: int = 0
    batched_tokens: int = 0
    batched_positions: int = 0

    def add_prefill(self, seconds: float) -> None:
        self.prefill_iterations += 1
        self.prefill_s += seconds

    def add_join(self, seconds: float) -> None:
        self.joins += 1
        self.join_s += seconds

    def add_batched_forward(self, tokens: int, positions: int) -> None:
        """One batched prefill forward of ``tokens`` prompt tokens on a rows x columns grid of ``positions``."""
        self.batched_forwards += 1
        self.batched_tokens += tokens
        self.batched_positions += positions

    def as_dict(self, decode: DecodeTiming) -> dict:
        """``busy_share``: each phase's part of the time the scheduler spent in all three."""

        def mean_ms(seconds: float, count: int) -> float | None:
            return round(1000 * seconds / count, 3) if count else None

        return {
            "prefill_iterations": self.prefill_iterations,
            "prefill_ms": mean_ms(self.prefill_s, self.prefill_iterations),
            "joins": self.joins,
            "join_ms": mean_ms(self.join_s, self.joins),
            "busy_share": busy_share(decode.step_s, self.prefill_s, self.join_s),
            # the padding's share of what batched prefill forwards computed (their cost follows positions)
            "batched_prefill": {
                "forwards": self.batched_forwards, "tokens": self.batched_tokens,
                "positions": self.batched_positions,
                "padding_share": (round(1 - self.batched_tokens / self.batched_positions, 4)
                                  if self.batched_positions else None)},
            "totals": {"prefill_s": self.prefill_s, "prefill_iterations": self.prefill_iterations,
                       "join_s": self.join_s, "joins": self.joins},
        }


def busy_share(decode_s: float, prefill_s: float, join_s: float) -> dict[str, float | None]:
    """Each phase's part of the scheduler's busy time (decode + prefill + join)."""
    busy = decode_s + prefill_s + join_s
    return {name: round(value / busy, 4) if busy else None
            for name, value in (("decode", decode_s), ("prefill", prefill_s), ("join", join_s))}
