"""Who gives way when memory runs out: plain decisions over row counts, testable without a model.

Before a decode step, when MLX's active memory plus what the step adds (a
new KV block, its logits) would pass the memory limit, the most recently
admitted rows are preempted first (``rows_that_fit``): their KV is dropped,
the others keep theirs and go on. No allocation fails, so nothing is lost
but the dropped rows' KV. (On MLX 0.32.4's CUDA backend an eval that fails
mid-graph has, in one run of several, left an illegal memory access behind
that killed the process: a real fault is the last resort, not the plan.)

After an allocation fault that a retry did not clear (engine/faults.py), the
batch lane sheds work:

- **A decode step.** Every running row's KV is bound to the failed step's
  graph (mlx-lm's caches update in place), so all of them are requeued and
  recomputed from their tokens (prompt + what they already emitted). They
  come back oldest first, under a row cap of half as many rows: the most
  recently admitted wait until the batch has room again.
- **A batched prefill.** The joiners' own caches are untouched (the batch
  was a merged copy): the newest half sit this step out with their KV kept,
  and at most half as many joiners prefill together from then on.
- **A lone prefill or token 0.** That joiner's caches were updated in place:
  it is requeued and starts over.

Caps are back to the flags' values once the batch drains, and grow slowly
after long runs of clean decode steps (each fault that a growth causes costs
a recomputation, so growth is cautious). A row requeued
MAX_PREEMPTIONS times cannot run even with fewer neighbours and fails with
an out-of-memory error instead of looping.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PREEMPTIONS = 8  # requeues of one row before it fails: it does not fit even alone
SHED_AT = 0.95  # of the memory limit: a decode step that would need more sheds rows first
RECOVER_AFTER_STEPS = 256  # clean decode steps before a cap grows back by an eighth


@dataclass(frozen=True)
class PreemptionPlan:
    """Rows by admission order (0 = the oldest), split three ways."""

    resume_first: tuple[int, ...]  # requeued, readmitted at once (within ``row_cap``)
    held_back: tuple[int, ...]  # requeued, the most recently admitted: wait for room
    failed: tuple[int, ...]  # preempted too often: fail them with an out-of-memory error
    row_cap: int  # rows (running + prefilling) allowed until the cap recovers


def plan_decode_preemption(times_preempted: list[int], row_cap: int) -> PreemptionPlan:
    """``times_preempted[i]``: how often row i (admission order) was requeued before this fault."""
    alive = [i for i, n in enumerate(times_preempted) if n < MAX_PREEMPTIONS]
    failed = tuple(i for i, n in enumerate(times_preempted) if n >= MAX_PREEMPTIONS)
    cap = max(1, min(row_cap, len(times_preempted) // 2))
    return PreemptionPlan(tuple(alive[:cap]), tuple(alive[cap:]), failed, cap)


def rows_that_fit(active: int, limit: int, rows: int, kv_now: int, kv_growth: int, step_per_row: int) -> int:
    """How many of ``rows`` (oldest first) the next decode step can carry within ``limit``.

    ``active``: MLX's memory now (weights, prompt cache, the batch's KV ``kv_now``);
    the step adds ``kv_growth`` (a new block, the copy that grows it) and
    ``step_per_row`` per row (logits, scores). Dropping a row frees its share of
    the KV. At least one row always runs.
    """
    for keep in range(rows, 1, -1):
        share = keep / rows
        need = active - kv_now * (1 - share) + kv_growth * share + step_per_row * keep
        if need <= limit * SHED_AT:
            return keep
    return 1


def split_prefill_group(size: int) -> tuple[int, int]:
    """(joiners that go on, joiners that sit out) after a batched prefill of ``size`` failed."""
    keep = max(1, size // 2)
    return keep, size - keep


@dataclass
class LoadCaps:
    """How many rows run and how many joiners prefill together, lowered by faults, regrown by clean steps."""

    max_rows: int
    max_group: int
    rows: int = 0
    group: int = 0
    clean_steps: int = 0

    def __post_init__(self):
        self.rows = self.rows or self.max_rows
        self.group = self.group or self.max_group

    def lower_rows(self, cap: int) -> None:
        self.rows, self.clean_steps = max(1, min(self.rows, cap)), 0

    def lower_group(self, cap: int) -> None:
        self.group, self.clean_steps = max(1, min(self.group, cap)), 0

    def step_ok(self) -> None:
        if self.rows == self.max_rows and self.group == self.max_group:
            return
        self.clean_steps += 1
        if self.clean_steps >= RECOVER_AFTER_STEPS:
            self.clean_steps = 0
            self.rows = min(self.max_rows, self.rows + max(1, self.rows // 8))
            self.group = min(self.max_group, self.group + max(1, self.group // 8))

    def reset(self) -> None:
        """The batch drained: whatever held the memory is gone."""
        self.rows, self.group, self.clean_steps = self.max_rows, self.max_group, 0

    @property
    def lowered(self) -> bool:
        return self.rows < self.max_rows or self.group < self.max_group
