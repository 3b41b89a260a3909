"""The batch lane's decisions as plain data: testable without MLX or a model.

A scheduler step first looks at its state through small frozen views (token
counts, budgets, cached-prefix lengths), asks the functions here what to do,
and only then touches caches:

- ``can_admit``: may a request join now (row cap, prompt concurrency, the
  prefill transient reserve, memory room while busy, ``--kv-budget``)?
  A slot holds back a long prefill: a joiner with at most SHORT_PREFILL
  prompt tokens of its own to compute (the rest cached, or being prefilled
  by the leader it follows) takes none, so a burst of agents on one prompt
  all wait on one leader, or all start from the cached prefix, at once.
- ``plan_intake``: which cancelled joiners and preempted rows leave, which
  followers are released (their leader's prefix is stored, or the leader is
  gone), how many preempted rows re-enter (oldest first, under the same
  rules as a new request, ahead of it).
- ``plan_prefill``: which joiners advance one chunk this step (FIFO, within
  one chunk's worth of tokens, at most the group cap), which read one more
  tensor from disk, and whether the chunks run as one forward. Followers
  released together advance their own tails together: one forward.
- ``choose_leader``: agents arriving together with a long shared prefix
  prefill it once; a joiner follows the first one still prefilling it.
- ``hold_for_burst`` (engine/burst_hold.py): while a burst of agents on a
  cached prompt is still arriving, their tails wait a moment, so the wave
  prefills as one forward instead of a first group the rest queue behind.

Preemption after a fault and shedding before a decode step are decided the
same way in engine/preempt.py (``plan_decode_preemption``, ``rows_that_fit``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mlxq.engine.transient import ModelShape, joiners_transient
from mlxq.kv.projection import KvFootprint
from mlxq.store.prefix import common_prefix

# A joiner waits for another joiner's prefill only when they share at least this many new tokens.
MIN_SHARED_PREFILL = 64
# A joiner with at most this many prompt tokens of its own to prefill takes no prompt-concurrency slot:
# its tail costs a fraction of a step's token budget, which still bounds the step.
SHORT_PREFILL = 128


@dataclass(frozen=True)
class Extent:
    """A request's worst case: its prompt and how many tokens it may still generate."""

    prompt: int  # tokens
    max_tokens: int  # tokens
    shared: int = 0  # leading prompt tokens it reads by reference from a shared prefix (counted once)
    prefix: int | None = None  # which shared prefix (any key equal for the rows of one group)
    on_copy: bool = False  # a joiner that prefills on its own copy of that prefix until it joins

    @property
    def total(self) -> int:
        return self.prompt + self.max_tokens

    def sharing(self, shared: int, prefix: int | None, on_copy: bool = False) -> Extent:
        return Extent(self.prompt, self.max_tokens, shared, prefix, on_copy)

    @property
    def attended(self) -> int:
        """Tokens its prefill attends through a score matrix: a short tail read on a shared prefix by
        reference attends that prefix through the shared path (tensor cores, or bounded blocks of
        scores: engine/shared_tails.py), so only its tail counts; anything else its whole prompt."""
        if self.prefix is not None and not self.on_copy and self.prompt - self.shared <= SHORT_PREFILL:
            return self.prompt - self.shared
        return self.prompt


@dataclass(frozen=True)
class Limits:
    """What admission is held to this step."""

    row_cap: int  # rows + joiners (--batch, lowered after memory faults)
    prompt_concurrency: int  # joiners at once
    group_cap: int  # joiners prefilled in one forward (lowered after a failed batched prefill)
    prefill_budget: int  # prompt tokens prefilled per step: one chunk's worth (--prefill-step-size)
    kv_budget: int | None = None  # bytes: projected KV of every row at prompt + max_tokens (--kv-budget)
    transient_budget: int | None = None  # bytes: the joiners' worst prefill step together; 0/None: no reserve
    memory_room: int | None = None  # bytes MLX may still take before the shed line; None = no limit
    tail_budget: int | None = None  # prompt tokens per step while only short last chunks advance (None: prefill_budget)


@dataclass(frozen=True)
class Load:
    """The batch as admission sees it."""

    running: tuple[Extent, ...]  # decoding rows
    prefilling: tuple[Extent, ...]  # joiners
    preempted: int = 0  # rows waiting to be recomputed: new requests wait behind them
    short: int = 0  # of the joiners, those with a short prefill of their own (SHORT_PREFILL): no slot

    def with_joiner(self, extent: Extent, short: bool = False) -> Load:
        return Load(self.running, (*self.prefilling, extent), self.preempted, self.short + short)


@dataclass(frozen=True)
class Sizing:
    """The measured arithmetic admission uses (pure Python: kv/projection.py, engine/transient.py)."""

    footprint: KvFootprint
    shape: ModelShape | None = None
    shared_layers: tuple[bool, ...] = ()  # per layer: a shared prefix is held by reference (kv/sharing_plan.py)

    def projected_bytes(self, load: Load) -> int:
        """Worst-case KV of every row at prompt + max_tokens, plus the joiners' ring transients.

        Rows in a shared-prefix group (``Extent.prefix``) count their tails, the prefix once."""
        return self.kv_bytes(load.running + load.prefilling) + sum(self.footprint.prefill_bytes(e.prompt)
                                                                    for e in load.prefilling)

    def kv_bytes(self, extents: Sequence[Extent]) -> int:
        lengths = [e.total for e in extents]
        if not self.shared_layers or all(e.prefix is None for e in extents):
            return self.footprint.batch_bytes(lengths)
        prefixes: dict[int, int] = {}
        for e in extents:
            if e.prefix is not None:
                prefixes[e.prefix] = max(prefixes.get(e.prefix, 0), e.shared)
        shared = [e.shared if e.prefix is not None else 0 for e in extents]
        return self.footprint.grouped_bytes(lengths, shared, list(prefixes.values()), self.shared_layers)

    def transient_bytes(self, prompts: list[int], chunk_cap: int, group_cap: int) -> int:
        """The worst prefill step of joiners with these prompt lengths (engine/transient.py)."""
        return joiners_transient(self.shape, prompts, chunk_cap, group_cap)


def fits_memory(load: Load, extent: Extent, limits: Limits, sizing: Sizing) -> bool:
    """While anything runs, a newcomer's whole KV and its prefill step must fit the memory left.

    Joiners that the KV budget counts as reading a shared prefix by reference (``Extent.prefix``)
    and prefill more than a short tail of their own, or whose tail the shared path declines
    (``Extent.on_copy``: engine/shared_accounting.py ``TailTerms``), do it on a copy of the prefix
    and hold that copy until they join: the copies of those not yet joined count here, so such a
    burst joins in waves that fit. A short tail on it is prefilled on the prefix by reference
    (engine/shared_tails.py: its lease's spans, never their concatenation), so a burst of agents
    joins at once. Checked only while busy, so a request is never refused for it: it waits."""
    if limits.memory_room is None or not (load.running or load.prefilling):
        return True
    prompts = [e.attended for e in load.prefilling] + [extent.attended]
    transient = sizing.transient_bytes(prompts, limits.prefill_budget, limits.group_cap)
    copies = sum(sizing.footprint.batch_bytes([e.prompt]) for e in load.prefilling
                 if e.prefix is not None and (e.on_copy or e.prompt - e.shared > SHORT_PREFILL))
    need = sizing.footprint.row_bytes(extent.total, extent.prompt) + transient + copies
    return need <= limits.memory_room


def has_slot(load: Load, limits: Limits, short: bool = False) -> bool:
    """A row is free and, for a long prefill, fewer long prefills than the prompt concurrency run.

    Short ones take no slot: agents on one cached (or leader-prefilled) prompt join together,
    instead of the later ones queueing behind the first few tails."""
    return (len(load.running) + len(load.prefilling) < limits.row_cap
            and (short or len(load.prefilling) - load.short < limits.prompt_concurrency))


def can_admit(load: Load, extent: Extent, limits: Limits, sizing: Sizing, own_tokens: int | None = None) -> bool:
    """May a new request become a joiner now? (FIFO: the engine asks for the head of its queue only.)

    ``own_tokens``: prompt tokens it would prefill itself (None: all of them)."""
    if load.preempted or not has_slot(load, limits, is_short(own_tokens)):
        return False
    if load.prefilling and limits.transient_budget:  # 0: nothing was set aside (engine/memory.py): no cap
        prompts = [e.attended for e in load.prefilling] + [extent.attended]
        if sizing.transient_bytes(prompts, limits.prefill_budget, limits.group_cap) > limits.transient_budget:
            return False  # a lone joiner always runs: only joiners together are held to the reserve
    if not fits_memory(load, extent, limits, sizing):
        return False
    return limits.kv_budget is None or sizing.projected_bytes(load.with_joiner(extent)) <= limits.kv_budget


def is_short(own_tokens: int | None) -> bool:
    return own_tokens is not None and own_tokens <= SHORT_PREFILL


@dataclass(frozen=True)
class JoinerView:
    """One joiner (a row prefilling on its own caches), as the planner sees it."""

    extent: Extent
    done: int  # prompt tokens in its caches
    next_chunk: int  # tokens its next chunk would prefill (the serial lane's boundaries)
    cancelled: bool = False
    restoring: bool = False  # reading a longer prefix from disk, a tensor per step
    leader: int | None = None  # index of the joiner it waits for (None: follows nobody, or its leader left)
    following: bool = False  # it was told to wait for a leader (which may have left since)
    wait_until: int = 0  # the leader's ``done`` at which the shared prefix is stored
    shared: int = 0  # prompt tokens its leader prefills for it
    admitted_at: float = 0.0  # when the scheduler took it in (seconds, monotonic)

    @property
    def is_prefilled(self) -> bool:
        """All but the last prompt token are in the caches: ready for token 0."""
        return self.done >= self.extent.prompt - 1

    @property
    def finishes_short_tail(self) -> bool:
        """Its next chunk ends its prefill and is short (SHORT_PREFILL): an agent's own tail after a
        cached or shared prefix."""
        return 0 < self.next_chunk <= SHORT_PREFILL and self.done + self.next_chunk >= self.extent.prompt - 1

    @property
    def waits_well_for_a_burst(self) -> bool:
        """Only a short tail of its own left to prefill (``finishes_short_tail``), or nothing at all: its
        whole prompt cached (the same chat sent again); neither following a leader, restoring from disk
        nor cancelled. Held with the rest of a burst it waits at most the hold's window; taken alone, it
        would join and decode while the rest queue behind it."""
        return ((self.finishes_short_tail or self.is_prefilled)
                and not (self.following or self.restoring or self.cancelled))

    @property
    def own_tokens(self) -> int:
        """Prompt tokens it prefills itself: what neither the prompt cache nor its leader gives it."""
        start = max(self.done, self.shared) if self.following else self.done
        return max(0, self.extent.prompt - 1 - start)


def load_of(running: Sequence[Extent], joiners: Sequence[JoinerView], preempted: int = 0) -> Load:
    """The batch as admission sees it: rows, joiners (the short ones counted apart), requeued rows."""
    return Load(tuple(running), tuple(j.extent for j in joiners), preempted,
                sum(is_short(j.own_tokens) for j in joiners))


@dataclass(frozen=True)
class IntakePlan:
    """The start of a step: who leaves, who is released, who comes back."""

    cancelled_joiners: tuple[int, ...]  # indices into the joiners
    cancelled_preempted: tuple[int, ...]  # indices into the preempted rows
    released: tuple[int, ...]  # followers to take the shared prefix from the prompt cache now
    readmit: int  # preempted rows (oldest first, after the cancelled left) that re-enter as joiners

    @property
    def changes_joiners(self) -> bool:
        """Carrying it out changes some joiner (its view must be taken again): not a step's usual no-op."""
        return bool(self.cancelled_joiners or self.cancelled_preempted or self.released or self.readmit)


def plan_intake(joiners: Sequence[JoinerView], preempted: Sequence[tuple[Extent, bool]], running: Sequence[Extent],
                limits: Limits, sizing: Sizing) -> IntakePlan:
    """``preempted``: (extent once resumed, cancelled) per row waiting to be recomputed, oldest first."""
    gone = tuple(i for i, j in enumerate(joiners) if j.cancelled)
    released = tuple(i for i, j in enumerate(joiners) if j.following and not j.cancelled
                     and (j.leader is None or j.leader in gone or joiners[j.leader].done >= j.wait_until))
    dropped = tuple(i for i, (_, cancelled) in enumerate(preempted) if cancelled)
    load = load_of(running, [j for i, j in enumerate(joiners) if i not in gone])
    readmit = 0
    for extent, cancelled in preempted:
        if cancelled:
            continue
        if not has_slot(load, limits) or not fits_memory(load, extent, limits, sizing):
            break
        load = load.with_joiner(extent)
        readmit += 1
    return IntakePlan(gone, dropped, released, readmit)


@dataclass(frozen=True)
class PrefillPlan:
    restore: tuple[int, ...]  # joiners reading one more tensor of their prefix from disk
    advance: tuple[int, ...]  # joiners advancing one chunk, FIFO
    chunks: tuple[int, ...]  # tokens each of them prefills (the serial lane's chunk boundaries)
    together: bool  # their chunks run as one forward (several, and the KV is not quantized)


def plan_prefill(joiners: Sequence[JoinerView], limits: Limits, quantized: bool = False) -> PrefillPlan:
    """Joiners advance FIFO until one chunk's worth of tokens was spent this step (the last one
    may pass it), at most ``group_cap`` of them; restoring and waiting joiners do not advance.

    While every joiner advancing finishes a short tail (a burst of agents on a cached prompt),
    the step takes up to ``tail_budget`` tokens instead, never more: such a wave's tails run as
    one forward rather than in groups the later ones wait behind."""
    tail_budget = limits.tail_budget or limits.prefill_budget
    spent, tails_only, closed = 0, True, False
    restore, advance = [], []
    for i, joiner in enumerate(joiners):
        if joiner.restoring:
            restore.append(i)
            continue
        if closed or joiner.following or joiner.is_prefilled or len(advance) >= limits.group_cap:
            continue
        if tails_only and joiner.finishes_short_tail and spent + joiner.next_chunk <= tail_budget:
            spent += joiner.next_chunk
        elif spent < limits.prefill_budget:
            spent, tails_only = spent + joiner.next_chunk, False
        else:
            closed = True  # FIFO: nobody behind it advances before it
            continue
        advance.append(i)
    chunks = tuple(joiners[i].next_chunk for i in advance)
    return PrefillPlan(tuple(restore), tuple(advance), chunks, len(advance) > 1 and not quantized)


@dataclass(frozen=True)
class PrefixView:
    """A joiner's prompt as shared prefill sees it."""

    namespace: str
    prompt: Sequence[int]
    done: int  # tokens already in its caches (from the prompt cache or its own chunks)
    trimmable: bool  # full attention only: any prefix of its state is servable
    snapshot_at: int | None  # where its system prompt ends (rings / recurrent state snapshot there)
    can_lead: bool = True  # not itself following, not restoring from disk


@dataclass(frozen=True)
class LeaderChoice:
    leader: int  # index into the candidates
    wait_until: int  # the leader's ``done`` at which the shared prefix is in the prompt cache
    shared: int  # prompt tokens the follower then takes from the prompt cache


def choose_leader(joiner: PrefixView, candidates: Iterable[PrefixView]) -> LeaderChoice | None:
    """The first joiner still prefilling at least MIN_SHARED_PREFILL tokens this one would compute too.

    A full-attention leader's whole prompt state serves any shared prefix (stored when its
    prefill ends); sliding-window and recurrent state exists only where the leader snapshots:
    the end of its system prompt. A joiner with fewer tokens of its own left (an agent's tail
    after a cached prefix) follows nobody: ``candidates`` (lazily built) are then not read."""
    prompt = joiner.prompt
    if len(prompt) - 1 - joiner.done < MIN_SHARED_PREFILL:
        return None
    for index, leader in enumerate(candidates):
        if not leader.can_lead or leader.namespace != joiner.namespace:
            continue
        theirs = leader.prompt
        need = joiner.done + MIN_SHARED_PREFILL  # it must share this much; most candidates differ before
        if len(theirs) <= need or prompt[joiner.done : need] != theirs[joiner.done : need]:
            continue
        shared = common_prefix(prompt, theirs, min(len(prompt), len(theirs)) - 1)
        if leader.trimmable:
            wait_until = len(theirs) - 1
        else:
            split = leader.snapshot_at
            wait_until = shared = split if split is not None and split <= shared else 0
        if shared - joiner.done >= MIN_SHARED_PREFILL and leader.done < wait_until:
            return LeaderChoice(index, wait_until, shared)
    return None
