"""The batch lane's intake: requests become joiners, leases are held, followers released, rows readmitted.

A mixin of BatchScheduler (engine/scheduler.py). A new request becomes a
joiner that starts from the longest prefix the prompt cache leases it (RAM
now; a longer one on disk is read a tensor per step), or waits for a joiner
already prefilling the same long prefix (``step_plan.choose_leader``). The
row holds its lease (the pinned node chain) until it finishes or is
requeued. ``_intake`` carries out the ``IntakePlan`` at the start of a step.
"""

from __future__ import annotations

from mlx_lm.models.cache import make_prompt_cache

from mlxq.engine.joiners import Joiner
from mlxq.engine.rows import Row, make_row, resume_row
from mlxq.engine.step_plan import IntakePlan, PrefixView, choose_leader
from mlxq.engine.types import FinishReason, Request
from mlxq.store.lease import Lease


class Intake:
    """Joiners in, leases held (mixed into BatchScheduler)."""

    def add(self, request: Request, emit, arrived: float | None = None) -> None:
        """``arrived``: when the request reached the engine (its submission, on the scheduler's clock);
        None: now. A burst taken in one pass after it arrived keeps its arrivals' spacing (burst_hold.py)."""
        row = make_row(request, self.tokenizer, emit, self.grammar_timing)
        restored = self._restored_joiner(row)  # a generation checkpoint of this request (engine/checkpoint_rows.py)
        if restored is not None:
            self.joiners.add(restored)
        elif row.output.finished is None:
            now = self.clock() if arrived is None else arrived
            self._admissions = (*self._admissions[-1:], now)  # a burst's signal: two arrivals close together
            self._enter(Joiner(row, [], admitted_at=now))
        self.submitted_rows += 1

    def _enter(self, joiner: Joiner) -> None:
        request = joiner.row.request
        if self.prompt_cache is None:
            joiner.caches = make_prompt_cache(self.model)
        else:
            # RAM now; a longer prefix on disk is read a tensor per step (running rows keep decoding).
            lease = self._hold(joiner.row, self.prompt_cache.lease(request.namespace, request.prompt_ids, cold=False))
            if lease.cached:
                joiner.start_from_lease(lease)  # its caches built only if read (prefix_gather reads the spans)
            else:
                joiner.start_from(make_prompt_cache(self.model), 0)
            if self.prompt_cache.cold is not None:
                joiner.restore = self.prompt_cache.cold.begin_restore(request.namespace, request.prompt_ids,
                                                                      lease.cached)
            if joiner.restore is None:
                self._follow_a_leader(joiner)
        joiner.row.output.phases.mark("leased")
        self.joiners.add(joiner)

    def _follow_a_leader(self, joiner: Joiner) -> None:
        """Agents that arrive together with the same long prefix: prefill it once (step_plan.choose_leader)."""
        choice = choose_leader(joiner.prefix_view(), (j.prefix_view() for j in self.joiners))
        if choice is not None:
            leader = self.joiners[choice.leader]
            joiner.leader, joiner.wait_until, joiner.shared = leader, choice.wait_until, choice.shared
            leader.followers += 1
            self.joiners.touch()  # the leader now stores its prefix: admission's view of it changed
            self.shared_prefills += 1

    def _own_prefill(self, request: Request, held: tuple | None) -> int:
        """Prompt tokens ``request`` would prefill itself if admitted now: what neither the RAM tier
        holds (``held``: its path there, None without a prompt cache) nor a joiner it would follow is
        prefilling (``step_plan.can_admit`` asks)."""
        if held is None:
            return len(request.prompt_ids)
        _, cached = held
        view = PrefixView(request.namespace, request.prompt_ids, cached, True, request.snapshot_at)
        choice = choose_leader(view, (j.prefix_view() for j in self.joiners))
        return len(request.prompt_ids) - 1 - max(cached, choice.shared if choice else 0)

    def _abandon_restore(self, joiner: Joiner) -> None:
        """A joiner giving up its SSD restore: a restore that follows it must not wait for it."""
        if joiner.restore is not None:
            self.prompt_cache.cold.abandon_restore(joiner.restore)
            joiner.restore = None

    def _release(self, joiner: Joiner) -> None:
        """Its leader's prefix is stored (or the leader is gone): take it from the prompt cache."""
        joiner.leader = None
        request = joiner.row.request
        lease = self.prompt_cache.lease(request.namespace, request.prompt_ids, cold=False)
        if lease.cached > joiner.done:  # it never advanced while it waited
            joiner.start_from_lease(self._hold(joiner.row, lease))
        else:
            lease.release()

    def _hold(self, row: Row, lease: Lease) -> Lease:
        """The row keeps ``lease`` (and lets go of any earlier one) until it finishes or is requeued."""
        self._let_go(row)
        if lease.held:
            self._leases[row.request.request_id] = lease
        return lease

    def _let_go(self, row: Row) -> None:
        lease = self._leases.pop(row.request.request_id, None)
        if lease is not None:
            lease.release()

    def _intake(self, plan: IntakePlan) -> None:
        joiners = list(self.joiners)
        for i in plan.cancelled_joiners:
            self.joiners.remove(joiners[i])
            self._abandon_restore(joiners[i])
            self._finish(joiners[i].row, FinishReason.CANCELLED)
        for i in plan.released:
            self._release(joiners[i])
        waiting = [r for i, r in enumerate(self._preempted) if i not in plan.cancelled_preempted]
        for i in plan.cancelled_preempted:
            self._finish(self._preempted[i], FinishReason.CANCELLED)
        back, self._preempted = waiting[: plan.readmit], waiting[plan.readmit :]
        for row in back:
            self._enter(Joiner(resume_row(row), [], resumed=True))
        # Running rows are cancelled at emit time, where their pending token is dropped.
