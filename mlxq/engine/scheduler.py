"""The continuous-batching scheduler: joiners prefill solo, then decode together.

One ``step()`` decides in plain data, then executes (engine/step_plan.py):

    intake (cancelled leave, followers released, preempted rows re-enter)
    -> prefill (restores, one chunk per advancing joiner, within the step's budget)
    -> join (token 0) -> shed before decode -> decode

- Joiners (engine/joiners.py) prefill prompt[:-1] on their own solo caches,
  in the serial lane's chunks (engine/prefill.py), starting from a prefix the
  prompt cache leases them: the node chain stays pinned until the row ends.
- Prefilled joiners join the running batch (engine/running_batch.py, which
  owns rows, caches and pending tokens) with their last prompt token pending,
  or with token 0 from a forward of their own (engine/joining.py).
- Decode is pipelined: step n+1 is built and ``async_eval``ed before step
  n's tokens are read, in one transfer, and emitted.
- Faults: an allocation failure is retried once after releasing MLX's cache,
  then the scheduler sheds work and recomputes it later (engine/faults.py,
  engine/preempt.py, engine/shedding.py); before a decode step that would
  pass the memory limit it sheds the newest rows: no request fails for a
  memory shortage. Any other prefill error fails that joiner; a row whose
  output handling raises is evicted alone; any other forward error fails
  every running row and drops the batch, and the scheduler goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlxq.engine.burst_hold import BurstHold, HeldUntil, held_until, hold_for_burst
from mlxq.engine.checkpoint_rows import RowCheckpoints
from mlxq.engine.checkpointing import Checkpointing
from mlxq.engine.faults import Evaluator, MemoryFault, release_cached_memory
from mlxq.engine.grammar_timing import GrammarTiming
from mlxq.engine.intake import Intake
from mlxq.engine.joiners import Joiners
from mlxq.engine.joining import Joining
from mlxq.engine.preempt import SHED_AT, LoadCaps
from mlxq.engine.prefill import Prefilling
from mlxq.engine.prefix_sharing import GroupTally, SharingPolicy, SharingStats
from mlxq.engine.rows import Row
from mlxq.engine.running_batch import Pending, RunningBatch
from mlxq.engine.shared_accounting import TailTerms, credited, credits, shares_layers
from mlxq.engine.shared_tails import TailSharing
from mlxq.engine.shedding import MemoryShedding, resumed_size
from mlxq.engine.step_plan import (
    Extent,
    JoinerView,
    Limits,
    Load,
    Sizing,
    can_admit,
    is_short,
    load_of,
    plan_intake,
    plan_prefill,
)
from mlxq.engine.step_sampling import sample_step
from mlxq.engine.step_timing import DecodeTiming, PhaseTiming
from mlxq.engine.transient import ModelShape
from mlxq.engine.types import FinishReason, Request
from mlxq.engine.wave_caches import PrefilledTogether
from mlxq.kv.projection import KvFootprint
from mlxq.kv.scheme import NATIVE, KvScheme
from mlxq.models.multi_lora import adapter_rows
from mlxq.store.lease import Lease

log = logging.getLogger("mlxq.scheduler")

CLEAR_CACHE_EVERY = 256  # decode steps between mx.clear_cache() calls (mlx-lm's serial cadence)
BURST_POLL_S = 0.001  # while a burst is held and nothing decodes: the engine thread lets the server run


@dataclass
class _Between:
    """What admission reads of the running rows and the joiners, kept between two steps (engine thread):
    a burst taken in one pass asks ``can_admit`` once per request, and each asked over every row and
    joiner before it (quadratic in the burst). Joiners added since are appended; any other change to the
    joiners (``Joiners.version``) or a step starting or ending builds it anew."""

    key: tuple[int, int]  # (Joiners.version, BatchScheduler._steps)
    running: tuple[Extent, ...]
    running_ids: list[str]
    extents: list[Extent] = field(default_factory=list)  # the joiners', in order
    short: int = 0  # joiners with a short prefill of their own
    joiner_ids: list[str] = field(default_factory=list)
    on_copy: list[bool] = field(default_factory=list)  # shared accounting only: the tail runs on a copy
    tally: GroupTally | None = None  # shared accounting only: the rows' and joiners' leases per node
    splits: int = 0  # PromptCache.splits when ``tally`` counted its leases (a split changes their chains)
    credited: dict = field(default_factory=dict)  # shared_accounting.credited's extents of these rows, kept

    @property
    def count(self) -> int:
        return len(self.extents)


@dataclass(frozen=True)
class SchedulerConfig:
    max_rows: int  # --batch: rows decoding together
    prompt_concurrency: int  # joiners prefilling at once
    prefill_step_size: int  # tokens per prefill chunk, and the per-step prefill budget
    kv_budget_bytes: int | None  # admission cap on projected KV bytes; None = unlimited
    # Token 0 from the batch's decode step (True: on a GPU a forward of the joiners alone streams
    # all the weights again) or from a forward of the joiners alone (False: on the compute-bound
    # CPU that smaller forward gives the earlier first token). Same tokens either way.
    token0_in_decode: bool = True
    transient_budget_bytes: int | None = None  # prefill transients of joiners together (engine/transient.py)
    memory_limit_bytes: int | None = None  # MLX's memory limit: decode sheds rows before passing it
    shape: ModelShape | None = None  # what those transients are computed from
    burst: BurstHold = BurstHold()  # joiners' tails wait for the rest of their burst (never by default)


class BatchScheduler(Intake, MemoryShedding, Prefilling, TailSharing, Joining, RowCheckpoints):
    def __init__(self, model, tokenizer, footprint: KvFootprint, config: SchedulerConfig,
                 on_finish: Callable[[Row], None] = lambda row: None, prompt_cache=None,
                 scheme: KvScheme = NATIVE, evaluator: Evaluator | None = None,
                 grammar_timing: GrammarTiming | None = None, sharing: SharingPolicy | None = None,
                 checkpoints: Checkpointing | None = None):
        self.model = model
        self.checkpoints = checkpoints  # generation checkpoints: rows publish, identical requests resume
        self.sharing = sharing  # --shared-prefix-attention: which running rows read one leased prefix once
        self.sharing_stats = SharingStats()
        self.scheme = scheme  # KV representation: joiners convert where the serial lane does
        self.prompt_cache = prompt_cache  # store.PromptCache: joiners lease at admission, rows put at finish
        self.tokenizer = tokenizer
        self.grammar_timing = grammar_timing  # rows with a grammar add their mask time here
        self.footprint = footprint
        self.config = config
        self.sizing = Sizing(footprint, config.shape, sharing.plan.shared if shares_layers(sharing) else ())

        def finished(row: Row) -> None:
            self._times_preempted.pop(row.request.request_id, None)
            on_finish(row)  # first: the client already has its last event
            self._let_go(row)

        self._on_finish = finished
        self.joiners = Joiners()  # rows prefilling on their own caches, FIFO
        self._prefilled_together: PrefilledTogether | None = None  # this step's joiners' batch (engine/wave_caches.py)
        self._rest_of_burst_next = False  # this step skips its decode: the burst's rest runs first
        self._skipped_decode = False  # the last join skipped a decode step (never two in a row)
        self.batch = RunningBatch()  # rows decoding together
        self._leases: dict[str, Lease] = {}  # request id -> the prompt-cache prefix its row holds
        self.timing = DecodeTiming()  # each decode step timed in its parts (/stats.batch.decode_timing)
        self.phases = PhaseTiming()  # prefill and join wall time (/stats.batch.phase_timing)
        self.submitted_rows = 0
        self.shared_prefills = 0  # joiners that waited for another joiner's prefill instead of repeating it
        self.faults = evaluator or Evaluator()  # evaluations retried once on an allocation failure
        # Lowered by memory faults. Joiners prefilling prompts of their own are at most the prompt
        # concurrency already; the group may be as large as the batch so that followers released
        # together advance their tails in one forward (the step's token budget still bounds it).
        self.caps = LoadCaps(config.max_rows, config.max_rows)
        self._preempted: list[Row] = []  # rows whose KV was dropped, oldest first: readmitted before new work
        self._times_preempted: dict[str, int] = {}  # request id -> requeues so far
        self.clock = time.monotonic  # what joiners' admission times are compared with (burst holds)
        # While a burst is held and nothing decodes: wait for the rest of it, at most until the hold ends
        # (the engine sleeps through the burst's arrivals; alone, a short sleep and the caller steps again).
        self.await_arrival: Callable[[HeldUntil], None] = self._sleep_briefly
        self.on_the_way: Callable[[float], int] = lambda now: 0  # requests the server read, not yet submitted
        # While a held burst's forward runs on the device: admit what arrived meanwhile (engine/engine.py), so
        # the rest of the burst is admitted by the time that forward ends (engine/prefill.py, ``_meanwhile``).
        self.take_in_meanwhile: Callable[[], None] = lambda: None
        self._largest_forward: dict[int, tuple[int, float]] = {}  # held bursts' tails: (query tokens, seconds)
        self._admissions: tuple[float, ...] = ()  # the last two arrival times (engine/intake.py)
        self._steps = 0  # bumped as each step starts and ends (what ``_between`` is valid between)
        self._between: _Between | None = None

    def _sleep_briefly(self, held: HeldUntil) -> None:
        time.sleep(min(max(0.0, min(held.gap_ends, held.window_ends) - self.clock()), BURST_POLL_S))

    # --- state the engine reads -------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self.batch)

    @property
    def num_prefilling(self) -> int:
        return len(self.joiners)

    @property
    def num_preempted(self) -> int:
        return len(self._preempted)

    @property
    def is_idle(self) -> bool:
        return not self.batch and not self.joiners and not self._preempted

    def can_admit(self, request: Request) -> bool:
        # One walk of the RAM tree serves both questions: the KV it would credit and what it would prefill.
        held = None if self.prompt_cache is None else self.prompt_cache.held_path(request.namespace,
                                                                                    request.prompt_ids)
        load, extent = self._kv_load(Extent(len(request.prompt_ids), request.max_tokens), held, between=True)
        return can_admit(load, extent, self._limits(), self.sizing, self._own_prefill(request, held))

    def projected_bytes(self) -> int:
        """Worst-case KV bytes of every row at prompt + max_tokens, plus the joiners' ring transients."""
        return self.sizing.projected_bytes(self._kv_load()[0])

    def transient_bytes(self) -> int:
        """The worst prefill step of the joiners: activations, logits, attention scores."""
        return self.sizing.transient_bytes([len(j.prompt) for j in self.joiners], self.config.prefill_step_size,
                                           self.caps.group)

    # --- what the planner sees ------------------------------------------------------
    def _load(self, views: list[JoinerView] | None = None) -> Load:
        """``views``: the joiners' views when the caller already built them this step."""
        running = [Extent(len(r.request.prompt_ids), r.request.max_tokens) for r in self.batch.rows]
        # The load reads extents and own tokens, not next chunks: admitting a burst asks this once per
        # arrival over every joiner, so the chunk lengths (snapshot points, cache kinds) are not worked out.
        views = self.joiners.views(lambda joiner: 0) if views is None else views
        return load_of(running, views, len(self._preempted))

    def _between_steps(self, shared: bool) -> _Between:
        """Admission's terms of the rows and joiners now (engine thread, between steps; ``shared``: with
        the shared accounting's)."""
        key = (self.joiners.version, self._steps)
        kept = self._between
        if kept is None or kept.key != key or (shared and len(kept.on_copy) < kept.count):
            rows = self.batch.rows
            kept = _Between(key, tuple(Extent(len(r.request.prompt_ids), r.request.max_tokens) for r in rows),
                            [r.request.request_id for r in rows])
            self._between = kept
        for joiner in self.joiners.since(kept.count):
            view = JoinerView(joiner.extent(), joiner.done, 0, following=joiner.leader is not None,
                              shared=joiner.shared)
            kept.extents.append(view.extent)
            kept.short += is_short(view.own_tokens)
            kept.joiner_ids.append(joiner.row.request.request_id)
            if shared:
                kept.on_copy.append(not self._tail_terms(joiner).by_reference)
        return kept

    def _kv_load(self, extent: Extent | None = None, held: tuple | None = None,
                 between: bool = False) -> tuple[Load, Extent | None]:
        """The load (and a request asking in: its ``extent`` and its ``held`` path in the RAM tree) with
        the rows that read a shared prefix by reference marked: the KV budget counts that prefix once
        (engine/shared_accounting.py). ``between``: the engine thread between steps (admission), where
        what the rows and joiners give is kept from one request to the next (``_between_steps``)."""
        shared = shares_layers(self.sharing) and self.prompt_cache is not None
        if not between:
            load = self._load()
            if not shared:
                return load, extent
            rows = [r.request.request_id for r in self.batch.rows] + [j.row.request.request_id for j in self.joiners]
            on_copy = [False] * len(self.batch.rows) + [not self._tail_terms(j).by_reference for j in self.joiners]
        else:
            kept = self._between_steps(shared)
            load = Load(kept.running, tuple(kept.extents), len(self._preempted), kept.short)
            if not shared:
                return load, extent
            rows = kept.running_ids + kept.joiner_ids
            on_copy = [False] * len(kept.running) + kept.on_copy
        leases = [self._leases.get(r) for r in rows]
        tally = self._tally(kept, leases) if between else None
        if held is not None:
            nodes, cached = held
            leases.append(Lease(cached, None, nodes[-1]) if nodes else None)  # unpinned: a view to compare
        if held is not None:  # a request asking in: a fresh lease, nothing of its own computed yet
            on_copy.append(not TailTerms(self.config.token0_in_decode, all(self.sharing.plan.shared), True,
                                         False).by_reference)
        given = credits(leases, len(self.batch.rows), self.batch.groups, self.sharing, on_copy, tally)
        return credited(load, extent, given, kept.credited if between else None)

    def _tally(self, kept: _Between, leases: list[Lease | None]) -> GroupTally:
        """``kept``'s count of ``leases`` per node (prefix_sharing.GroupTally), brought up to date: counted
        anew when a lease it counted was replaced or the tree split a node since, else extended."""
        tally, splits = kept.tally, self.prompt_cache.splits
        if (tally is None or kept.splits != splits or tally.count > len(leases)
                or any(a is not b for a, b in zip(tally.leases, leases, strict=False))):
            tally = kept.tally = GroupTally()
            kept.splits = splits
        for lease in leases[tally.count :]:
            tally.add(lease)
        return tally

    def _limits(self) -> Limits:
        limit = self.config.memory_limit_bytes
        room = None if limit is None else limit * SHED_AT - mx.get_active_memory()
        step = self.config.prefill_step_size  # short tails: two chunks' worth, as engine/transient.py assumes
        return Limits(self.caps.rows, self.config.prompt_concurrency, self.caps.group, step,
                      self.config.kv_budget_bytes, self.config.transient_budget_bytes, room, tail_budget=2 * step)

    def _finish(self, row: Row, reason: FinishReason, error: str | None = None) -> None:
        row.output.finish(reason, error=error)
        self._on_finish(row)

    def requests_held(self) -> list[Request]:
        """Every request decoding, prefilling or preempted here."""
        return [row.request for row in (*self.batch.rows, *(j.row for j in self.joiners), *self._preempted)]

    def fail_all(self, message: str) -> None:
        self.publish_staged()  # the rows' newest checkpoint links, before the rows end
        joiners = self.joiners.clear()
        for joiner in joiners:
            self._abandon_restore(joiner)
        rows = self.batch.clear() + [j.row for j in joiners] + self._preempted
        self._preempted = []
        for row in rows:
            self._finish(row, FinishReason.ERROR, message)

    # --- one iteration ------------------------------------------------------------
    def step(self) -> None:
        before = (self.joiners.version, self._steps)
        self._steps += 1
        quiet = False
        try:
            if self.joiners or self._preempted:  # else nothing to plan: a steady decode step costs no planning
                quiet = self._plan_and_prefill()
            if self._rest_of_burst_next:
                self._rest_of_burst_next = False
                return  # the rest of the burst's tails run first (``_rest_of_burst_waits``)
            if len(self.batch.rows) > 1:
                self._shed_before_decode()
            if self.batch.rows:
                self._decode_or_shed()
            if self.is_idle and self.caps.lowered:
                self.caps.reset()
        finally:
            self._steps += 1
            kept = self._between
            if quiet and kept is not None and kept.key == before:
                # The step only held a burst (nothing decodes, no joiner changed): what admission kept
                # stays true. A burst taken in as it arrives holds once per take-in, and each take-in
                # would otherwise read every row and joiner again (quadratic in the burst).
                kept.key = (self.joiners.version, self._steps)

    def _plan_and_prefill(self) -> bool:
        """True when the step only held a burst: no intake changed a joiner, nothing decodes."""
        preempted = [(Extent(*resumed_size(r)), r.request.cancelled.is_set()) for r in self._preempted]
        views = self.joiners.views(self._chunk_len)
        intake = plan_intake(views, preempted, self._load(views).running, self._limits(), self.sizing)
        self._intake(intake)
        if not self.joiners:
            return False
        if intake.changes_joiners:  # it dropped, released or readmitted joiners: a held burst's steps do not
            views = self.joiners.views(self._chunk_len)
        now = self.clock()
        if hold_for_burst(views, self._admissions, now, self.config.burst, self.on_the_way(now)):
            if not self.batch:  # nothing decodes meanwhile: leave the GIL to the server threads parsing the rest
                self.await_arrival(held_until(views, self._admissions, self.config.burst))
            return not self.batch and not intake.changes_joiners
        self.timing.interrupt()  # prefill work sits between these decode steps
        self._prefilled_together = None  # set by this step's forward when it ends its joiners' prompts
        self._prefill(plan_prefill(views, self._limits(), self.scheme.quantized))
        ready = self.joiners.take_ready()
        if ready:
            start = time.perf_counter()
            for joiner in ready:
                joiner.row.output.phases.mark("joining")
            self._start_decoding(ready)
            for joiner in ready:
                joiner.row.output.phases.mark("joined")
                self._leases.get(joiner.row.request.request_id, Lease(0, None)).joined()
            self.phases.add_join(time.perf_counter() - start)
            self._rest_of_burst_next = self._rest_of_burst_waits(ready)
        self._prefilled_together = None  # joined with, or not needed: never held past its step
        return False

    def _rest_of_burst_waits(self, ready: list) -> bool:
        """Whether this step's decode waits for the next step's forward: the rows that just joined are a
        held burst's tails whose token 0 came from their forward (none awaits a first token), and joiners
        admitted meanwhile, the rest of that burst split by the hold's window, each have only a short
        tail left. Their forward then follows at once, not after a decode step and its join (on the
        H200 44-57 ms between a split burst's two forwards); the rows that joined get their next token
        one forward later. Never twice in a row: rows already decoding lose at most one step per burst."""
        skipped, self._skipped_decode = self._skipped_decode, False
        if skipped or self.config.burst.window_s <= 0 or not self.joiners:
            return False
        if not all(j.row.output.num_generated > 0 or j.row.output.finished is not None for j in ready):
            return False
        views = self.joiners.views(self._chunk_len)
        if not all(v.waits_well_for_a_burst for v in views):  # the prefilled ones joined in this step
            return False
        self._skipped_decode = True
        return True

    def _decode_or_shed(self) -> None:
        keys = [row.key for row in self.batch.rows]  # sampler state before this step, should it be redone
        try:
            self._decode_step()
            self.caps.step_ok()
        except MemoryFault as fault:
            self._preempt_running(keys, fault)
        except Exception as exc:
            log.error("decode step failed; failing %d rows", len(self.batch), exc_info=True)
            for row in self.batch.clear():
                self._finish(row, FinishReason.ERROR, f"batch decode failed: {type(exc).__name__}: {exc}")
            release_cached_memory()

    def _decode_step(self) -> None:
        start = time.perf_counter()
        batch = self.batch
        pending = batch.pending
        inputs = pending.tokens
        with mx.stream(generation_stream), adapter_rows(self.model, [row.request.adapter for row in batch.rows]):
            logits = self.model(inputs[:, None], cache=batch.caches)[:, -1, :]
            next_tokens, next_logprobs = self._sample(logits, inputs)
        built = time.perf_counter()
        self.faults.run("decode", lambda: mx.async_eval(next_tokens, next_logprobs))
        # Read step n while step n+1 runs: one transfer for every row's token.
        submitted = time.perf_counter()
        tokens = inputs.tolist()
        waited = time.perf_counter() - submitted
        keep = [i for i, row in enumerate(batch.rows)
                if pending.emitted[i] or self._emit(row, tokens[i], pending.logprobs[i])]
        done_now = [False] * len(batch.rows)
        joined = [i for i in keep if batch.rows[i].awaiting_first]
        if joined:
            # This step computed token 0 of rows that joined before it: hand it out now, not one
            # step later (time to first token). Waiting drains the pipeline once per admission.
            read_at = time.perf_counter()
            drawn = next_tokens.tolist()
            waited += time.perf_counter() - read_at
            for i in joined:
                done_now[i] = True
                if not self._emit(batch.rows[i], drawn[i], next_logprobs[i]):
                    keep.remove(i)
        batch.pending = Pending(next_tokens, next_logprobs, done_now)
        if self.checkpoints is not None:
            self._publish_checkpoints(keep, done_now, next_tokens, tokens, pending.emitted)
        self.sharing_stats.count_step(batch.groups)
        if len(keep) < len(batch.rows):
            self._evict(keep)
        self.timing.record(start, built, submitted, waited)
        self._clear_cache(self.timing.steps % CLEAR_CACHE_EVERY == 0)
        if not batch.rows:
            self.timing.interrupt()  # the batch ran dry: the next step starts after an idle gap

    def _sample(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list]:
        def start(*arrays: mx.array) -> None:  # the forward (and free rows' draws) run while masks are built
            self.faults.run("decode", lambda: mx.async_eval(*arrays))

        return sample_step(self.batch.rows, logits, inputs, start, self.grammar_timing)

    def _emit(self, row: Row, token: int, logprobs) -> bool:
        """Hand one token to the row's output; False when the row is done."""
        if row.request.cancelled.is_set():
            row.output.finish(FinishReason.CANCELLED)
            return False
        try:
            finished = row.output.add_token(token, logprobs if row.request.logprobs else None)
        except Exception as exc:  # this row's output handling failed: evict it alone
            log.error("row %s failed while emitting", row.request.request_id, exc_info=True)
            row.output.finish(FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
            return False
        return not finished

    def _evict(self, keep: list[int]) -> None:
        leaving = [i for i in range(len(self.batch.rows)) if i not in keep]
        # Read before the filter drops them: views where the store copies only what it lacks.
        stored = self.batch.leaving_caches(leaving) if self.prompt_cache is not None else {}
        with self._puts_together(self.batch.leaves_as_views):
            for i in leaving:
                row = self.batch.rows[i]
                if i in stored:
                    # Popped, so each row's caches go once stored: a row out of a shared-prefix group is
                    # its prefix and tail joined, evaluated by the put, and 64 of them at 14.5k tokens
                    # (~2 GB each on an 8B model) held together passed the device's memory.
                    self._put(row, stored.pop(i))
                self._on_finish(row)
        self.batch.keep(keep)
