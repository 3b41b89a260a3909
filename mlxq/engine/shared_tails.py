"""Agents on one cached prefix prefill their tails reading it by reference, then join as one group.

A mixin of BatchScheduler (engine/scheduler.py). A burst of agents on a
cached system prompt becomes joiners that each lease the same stored
prefix. Merging their caches for one forward writes a copy of that prefix
per row (and moving the rows by their padding after right-padded tails
copies it again): on the H200, for 64 agents on a 2.2k-token prefix, those
copies and their fresh buffers cost more than the forward itself. When
``prefix_sharing.tails_group`` finds such a prefix, the tails' forward runs on
SharedPrefixBatchCache layers instead: the prefix they all lease from one
node chain referenced once (the chain's spans, or the running group's own
arrays), only each row's tail written (what its lease lent past that
prefix, and its chunk); the rows then join the batch as that group (adopted into an empty
batch, or appended to the running group on the same prefix, which rows
already decoding on their own copies of it form first), and no joiner
ever holds a copy of the prefix. Where every layer shares and the leases
lend plain spans, the tails are placed as engine/tail_placement.py places
whole rows: one gather per layer writes every row's own tokens where its
left-padded chunk ends them, so no per-row tail cut, merge or row move.
Where every row's own leased tokens past the prefix are few
(``RECOMPUTED_OWN``: agents whose questions begin with a token or two of
another's stored one), they are computed again in the tails' forward
instead: the tails start empty on the prefix, no gather (on the H200 a
pool of ~65 pieces concatenated per layer, ~4k small copies, 17-23 ms for
64 rows) and no evaluation before the forward, and those tokens no longer
count as cached (``cached_tokens``).

The tails' attention is the shared-prefix path (the prefix and the tail
merged by log-sum-exp; kv/shared_prefix_decode.py's ``mma_prefill`` on
CUDA: the prefix on tensor cores for every row's queries at once, no score
matrix of it in memory; elsewhere plain operations in bounded blocks of
scores, kv/shared_prefix_attention.py), so rows grouped this way
compute what grouped decode steps compute, not bit for bit what a row
alone computes; it runs only where the policy groups rows anyway (never
under ``--shared-prefix-attention off``, nor in ``auto`` on the CPU).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxq.engine.joiners import Joiner
from mlxq.engine.prefix_gather import RowPrefix
from mlxq.engine.prefix_sharing import Group, tails_group
from mlxq.engine.running_batch import Pending
from mlxq.engine.shared_accounting import TailTerms
from mlxq.engine.tail_placement import TailLayout, layout_for, place_rows
from mlxq.kv import attention_route
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache
from mlxq.kv.sharing_plan import PrefixSpec, prefix_from_spans, share_groups, tail_from_spans


@dataclass(frozen=True)
class SharedTails:
    """Caches for one forward of joiners' last chunks over their leased prefix, and where they join."""

    caches: list
    group: Group  # the joiners as one group (every one of them in it)
    into: int | None  # the running group they join (its prefix arrays are theirs); None: an empty batch
    layout: TailLayout | None = None  # the tails placed for left-padded chunks (engine/tail_placement.py)
    # Per row, its own leased tokens past the prefix that the forward computes again before its chunk
    # (the tails start empty); None: the tails hold them already.
    recomputed: tuple[int, ...] | None = None
    # Token 0 drawn from the forward's last position (``TOKEN0_IN_TAILS``): (tokens [rows], per-row
    # logprobs); the forward ran each row's last prompt token too. None: the decode step computes it.
    first: tuple | None = None

    def tokens(self, joiners: list, chunks: list[list[int]]) -> list[list[int]]:
        """What each row's forward runs: its recomputed own tokens, then its chunk."""
        if self.recomputed is None:
            return chunks
        return [j.prompt[j.done - k : j.done] + c for j, k, c in zip(joiners, self.recomputed, chunks, strict=True)]


RECOMPUTED_OWN = 8  # a row's own leased tokens past a group's prefix recomputed rather than gathered, at most


def evaluable(caches: list) -> list:
    """What to evaluate after a forward on ``caches`` (a shared-prefix layer's state is its tail's)."""
    return [c.tail.state if isinstance(c, SharedPrefixBatchCache) else c.state for c in caches]


class TailSharing:
    """Tails prefilled on a prefix read by reference (mixed into BatchScheduler)."""

    def _shared_tails(self, group: list[Joiner], chunks: list[int]) -> SharedTails | None:
        """Caches for ``group``'s last chunks that read their common leased prefix by reference, or
        None when ``prefix_sharing.tails_group`` finds no such prefix (their caches are then merged,
        a copy per row). Joiners must hold exactly what their leases lent, on full attention, and
        store nothing of their own when their prefill ends."""
        policy = self.sharing
        if policy is None or policy.plan is None or not all(self._tail_terms(j).by_reference for j in group):
            return None
        running = [self._leases.get(row.request.request_id) for row in self.batch.rows]
        waiting = [self._leases.get(j.row.request.request_id) for j in self.joiners
                   if j not in group and not j.is_prefilled and self._holds_lease_only(j)]
        choice = tails_group(self.batch.groups, running, [self._leases.get(j.row.request.request_id) for j in group],
                             waiting, policy)
        if choice is None:
            return None
        into = choice.into
        if into is None and self.batch:
            # Rows already decoding on this prefix, each on its own copy: grouped first (their tails
            # kept, the copies dropped), so the joiners append to that group.
            self.batch.share((choice.group,), policy.plan)
            self.sharing_stats.groups += 1
            if not self.batch.groups:
                return None
            into = 0
        length = choice.group.prefix_length
        if into is None:
            prefix = prefix_from_spans(choice.group.prefix_lease().layer_spans())
        else:  # the running group's arrays: the batch's caches then extend that group, not add one
            prefix = [c.prefixes[into] if isinstance(c, SharedPrefixBatchCache) else None for c in self.batch.caches]
        one = Group(choice.group.node, length, (True,) * len(group))
        recomputed = self._recomputed(group, chunks, length, prefix)
        if recomputed is not None:
            return SharedTails(recomputed[0], one, into, recomputed[1], recomputed[2])
        placed = self._placed_tails(group, chunks, length, prefix)
        if placed is not None:
            return SharedTails(placed[0], one, into, placed[1])
        caches = share_groups(policy.plan, [j.caches for j in group], [PrefixSpec(length, prefix)], [0] * len(group),
                              [self._own_tails(j, length) for j in group])
        return SharedTails(caches, one, into)

    def _placed_tails(self, group: list[Joiner], chunks: list[int], length: int, prefix: list):
        """(caches, layout): every layer a SharedPrefixBatchCache over ``prefix`` whose tails hold each
        row's own tokens past ``length`` placed for its chunk (``place_rows``: one gather per layer from
        the stored spans, no merge or row move per row); None unless every layer shares a plain prefix
        and every joiner's lease lends plain spans."""
        if not all(self.sharing.plan.shared) or any(p is None for p in prefix):
            return None
        lent = [self._lease_prefix(j) for j in group]
        if any(r is None for r in lent):
            return None
        own = [RowPrefix(r.pieces, r.length - length, skip=length) for r in lent]
        tails, layout = place_rows(own, chunks, BatchKVCache.step)
        rows = [0] * len(group)
        return [SharedPrefixBatchCache.grouped([layer], tail, rows) for layer, tail in zip(prefix, tails, strict=True)
                ], layout

    def _recomputed(self, group: list[Joiner], chunks: list[int], length: int, prefix: list):
        """(caches, layout, own): every layer a SharedPrefixBatchCache over ``prefix`` whose tails are
        empty, laid out for each row's own tokens past ``length`` (``own``, at most ``RECOMPUTED_OWN``)
        and its chunk, all computed by the forward (left-padded: the padding columns lie in each
        row's left padding, never read); None unless every layer shares a plain prefix and every row's
        own tokens are that few (and nothing is quantized)."""
        if (self.scheme.quantized or not all(self.sharing.plan.shared)
                or not all(p is not None and isinstance(p[0], mx.array) for p in prefix)):
            return None  # quantized tails (or prefixes), or layers that do not share: not placed empty
        own = tuple(j.done - length for j in group)
        if min(own) < 0 or max(own) > RECOMPUTED_OWN:
            return None
        layout = layout_for([0] * len(group), [k + n for k, n in zip(own, chunks, strict=True)],
                            BatchKVCache.step)
        caches = []
        for keys, values in prefix:
            tail = BatchKVCache(layout.padding)
            tail.keys, tail.values = (mx.zeros((len(group), a.shape[1], layout.capacity, a.shape[3]), a.dtype)
                                      for a in (keys, values))
            caches.append(SharedPrefixBatchCache.grouped([(keys, values)], tail, [0] * len(group)))
        return caches, layout, own

    def _own_tails(self, joiner: Joiner, length: int) -> list | None:
        """Per layer, what ``joiner``'s lease lent past the group's ``length`` tokens, from the chain's
        spans (None for layers without spans, and quantized ones: cut from its caches)."""
        spans = self._leases[joiner.row.request.request_id].layer_spans()
        if len(spans) != len(joiner.caches):
            return None
        return [None if layer is None or type(cache) is not KVCache else tail_from_spans(layer, length)
                for layer, cache in zip(spans, joiner.caches, strict=True)]

    def _tail_terms(self, joiner: Joiner) -> TailTerms:
        """Whether its tail can run on its leased prefix by reference (the KV accounting asks too)."""
        return TailTerms(self.config.token0_in_decode, joiner.trimmable, self._holds_lease_only(joiner),
                         self._stores_boundary(joiner))

    def _holds_lease_only(self, joiner: Joiner) -> bool:
        """Its caches are what its lease lent, nothing computed on them yet."""
        lease = self._leases.get(joiner.row.request.request_id)
        return lease is not None and lease.held and joiner.holds_lent(lease) and joiner.done == lease.cached

    def _stores_boundary(self, joiner: Joiner) -> bool:
        """It stores its caches when its prefill ends (followers wait for it, or its system prompt
        is not stored yet: ``Prefilling._snapshot``), which needs its own caches."""
        system = joiner.row.request.snapshot_at
        return joiner.followers > 0 or (system is not None and joiner.row.output.cached_tokens < system)

    @contextlib.contextmanager
    def _routed(self, shared: SharedTails | None):
        """The model's attention through the shared-prefix seam for this forward (kv/attention_route.py)."""
        if shared is None:
            yield
            return
        attention_route.use_shared(True)
        try:
            yield
        finally:
            attention_route.use_shared(bool(self.batch.groups))

    def _join_shared_tails(self, joining: list[Joiner]) -> list[Joiner]:
        """Join the joiners whose tails this step prefilled on a shared prefix (they must: their own
        caches hold the prefix only, so a join that fails fails them); returns the others, to join
        the usual way."""
        kept = self._prefilled_together
        shared = None if kept is None else kept.shared
        if shared is None:
            return joining
        self._prefilled_together = None
        group = [j for j in joining if j in kept.joiners]
        try:
            if not kept.serves(group):
                raise RuntimeError("joiners prefilled on a shared prefix must join together, in order")
            self._adopt_shared(group, shared)
        except Exception as exc:
            self._fail_joiners(group, "join", exc)
        return [j for j in joining if j not in kept.joiners]

    def _adopt_shared(self, group: list[Joiner], shared: SharedTails) -> None:
        rows = [j.row for j in group]
        if shared.recomputed is not None:  # after their prefill's snapshots, which read cached_tokens
            for row, own in zip(rows, shared.recomputed, strict=True):
                row.output.cached_tokens -= own  # computed again, not served from the cache
            self.sharing_stats.tails_recomputed += sum(shared.recomputed)
        ended: set[int] = set()
        if shared.first is None:
            pending = Pending.prompt_ends([j.prompt for j in group])
        else:  # token 0 came with the forward: handed out now, fed to the next decode step
            tokens, logprobs = shared.first
            ended = {id(row) for row, token, lp in zip(rows, tokens.tolist(), logprobs, strict=True)
                     if not self._emit(row, token, lp)}
            pending = Pending(tokens, logprobs, [True] * len(rows))
        if shared.into is None:
            self.batch.adopt_grouped(rows, shared.caches, (shared.group,), pending)
            self.sharing_stats.groups += 1
        else:
            self.batch.join_shared(rows, shared.caches, shared.into, pending)
            self.sharing_stats.rows_joined += len(rows)
        self.batch.copies.kept += len(rows)
        self.batch.copies.referenced += len(rows)
        if ended:  # rows that ended at token 0 leave as a decode step's finished rows do
            self._evict([i for i, row in enumerate(self.batch.rows) if id(row) not in ended])
