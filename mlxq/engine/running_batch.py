"""The running batch: the rows decoding together, their caches and the tokens each step feeds them.

One object owns what used to be four loose fields (rows, caches, "batched",
a 3-tuple of pending state), so every change to the batch (a join, an
eviction, a preemption, a failure) keeps them in step, and one ``clear``
empties it.

Caches are *solo* (mlx-lm's per-request classes) while one row runs, so the
B=1 step is the serial lane's graph, and *batched* (``BatchKVCache`` and its
kin, kv/batch_ops.py) from the second row on; a batch that drops back to one
row is extracted to solo caches again. A batch may hold shared-prefix
groups (engine/prefix_sharing.py): ``share`` rebuilds its caches so each
group's rows reference their leased prefix; ``join_group`` appends
joiners to the running groups (their tails only, the prefixes
referenced); any other join, or fewer than two grouped rows left, goes
back to per-row batched caches first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxq.engine.prefix_sharing import Group, row_groups
from mlxq.engine.rows import Row
from mlxq.engine.wave_caches import RowCopies
from mlxq.kv import attention_route
from mlxq.kv.batch_ops import check_extendable, extend_batch, extract_row, keep_rows, merge_solo_rows, view_rows
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache
from mlxq.kv.sharing_plan import PrefixSpec, SharingPlan, prefix_from_spans, share_groups


@dataclass
class Pending:
    """What the next decode step feeds each row, and what the step that computed it left to hand out."""

    tokens: mx.array  # [rows] uint32: each row's next input token
    logprobs: list  # per row: the [V] logprobs that token was drawn from (None when nobody asked)
    emitted: list[bool]  # per row: that token was already handed out (token 0, a prompt's last token)

    @classmethod
    def prompt_ends(cls, prompts: list[list[int]]) -> Pending:
        """For joiners whose caches hold all but their prompt's last token: that token is their next
        input, already handed out (the step that feeds it computes their token 0)."""
        return cls(mx.array([p[-1] for p in prompts], dtype=mx.uint32), [None] * len(prompts), [True] * len(prompts))

    def take(self, keep: list[int]) -> Pending:
        return Pending(self.tokens[mx.array(keep)], [self.logprobs[i] for i in keep], [self.emitted[i] for i in keep])

    def extend(self, other: Pending) -> Pending:
        return Pending(mx.concatenate([self.tokens, other.tokens]), self.logprobs + other.logprobs,
                       self.emitted + other.emitted)


@dataclass(eq=False)
class RunningBatch:
    rows: list[Row] = field(default_factory=list)
    caches: list | None = None  # solo caches when one row runs, batched otherwise
    batched: bool = False
    pending: Pending | None = None
    groups: tuple[Group, ...] = ()  # rows reading a shared prefix, per prefix (none: every row holds its own)
    copies: RowCopies = field(default_factory=RowCopies)  # whole-row copies around joins, counted

    def __post_init__(self) -> None:
        self.set_groups(self.groups)  # a new batch routes as its groups say (plan_sharing's probe installed the seam)

    def set_groups(self, groups: tuple[Group, ...]) -> None:
        """Every change of the groups comes here: the model's attention goes through the shared-prefix
        seam only while a group runs (kv/attention_route.py)."""
        self.groups = groups
        attention_route.use_shared(bool(groups))

    def _set_groups_if_shared(self, groups: tuple[Group, ...]) -> None:
        """``set_groups`` for caches just built for ``groups``: none when no layer could share (e.g.
        quantized KV on a GPU backend), the caches being per row then."""
        self.set_groups(groups if any(isinstance(c, SharedPrefixBatchCache) for c in self.caches) else ())

    def __len__(self) -> int:
        return len(self.rows)

    def __bool__(self) -> bool:
        return bool(self.rows)

    def join(self, rows: list[Row], caches: list, batched: bool, pending: Pending) -> None:
        """Add rows whose caches hold everything before their ``pending`` input token.

        Into an empty batch the rows' caches are adopted as they are (a lone row keeps its
        own caches: zero copy, the serial graph); otherwise both sides become batched caches
        and the newcomers extend the running ones (right-aligned)."""
        if not self.rows:
            self.rows, self.caches, self.batched, self.pending = list(rows), caches, batched, pending
            return
        if not self.batched:
            self.caches, self.batched = merge_solo_rows([self.caches]), True
        self._unshare()
        self.copies.batch_extends += 1
        self.copies.extended_rows += len(self.rows)
        extend_batch(self.caches, caches if batched else merge_solo_rows([caches]))
        self.pending = self.pending.extend(pending)
        self.rows += rows

    def join_group(self, rows: list[Row], solo_caches: list[list], into: tuple[int, ...], pending: Pending,
                   plan: SharingPlan) -> None:
        """Add rows (each a solo cache list holding everything before its ``pending`` token) to the
        running groups: a row ``into`` group g keeps only its tail past g's prefix and references
        g's arrays, a row with -1 joins as a stray; the running rows' caches are extended, not
        rebuilt. Everything that can fail runs before the batch changes."""
        specs = [PrefixSpec(group.prefix_length, [c.prefixes[g] if isinstance(c, SharedPrefixBatchCache) else None
                                                  for c in self.caches])
                 for g, group in enumerate(self.groups)]
        joining = share_groups(plan, solo_caches, specs, list(into))
        check_extendable(self.caches, joining)
        extend_batch(self.caches, joining)
        self.pending = self.pending.extend(pending)
        self.rows += rows
        self.set_groups(tuple(group.extend([g == i for i in into]) for g, group in enumerate(self.groups)))

    def row_caches(self, index: int) -> list:
        """Row ``index``'s caches as solo caches: a copy out of a batch, the caches themselves when alone."""
        return extract_row(self.caches, index) if self.batched else self.caches

    @property
    def leaves_as_views(self) -> bool:
        """Rows leave as views into the batch (every layer plain full attention: ``leaving_caches``)."""
        return self.batched and all(type(c) is BatchKVCache for c in self.caches)

    def leaving_caches(self, leaving: list[int]) -> dict[int, list]:
        """Solo caches of the rows at ``leaving``, to store from before ``keep`` drops them: views into
        the batch when every layer is plain full attention (the prompt cache copies only the tokens it
        lacks, not each row whole), else ``row_caches``."""
        if leaving and self.leaves_as_views:
            views = view_rows(self.caches, len(self.rows))
            return {i: views[i] for i in leaving}
        if self.batched:
            self.copies.extracted += len(leaving)
        return {i: self.row_caches(i) for i in leaving}

    def keep(self, keep: list[int]) -> None:
        """Only the rows at ``keep`` (indices, in order) go on; back to solo caches at one row."""
        if not keep:
            self.clear()
            return
        self.rows = [self.rows[i] for i in keep]
        self.pending = self.pending.take(keep)
        if self.batched:
            keep_rows(self.caches, keep)  # a group no row reads any more leaves the caches too
            groups = tuple(g for g in (group.keep(keep) for group in self.groups) if g.rows)
            if len(keep) == 1:
                self.caches, self.batched = extract_row(self.caches, 0), False
                self.set_groups(())
            elif self.groups and sum(group.rows for group in groups) < 2:
                self._unshare()  # also when every group left: strays alone go back to per-row caches
            else:
                self.set_groups(groups)

    def clear(self) -> list[Row]:
        """Drop every row's KV and pending state; the rows are returned to be finished or requeued."""
        rows = self.rows
        self.rows, self.caches, self.batched, self.pending = [], None, False, None
        self.set_groups(())
        return rows

    def share(self, groups: tuple[Group, ...], plan: SharingPlan) -> None:
        """Rebuild the batched caches so each group's rows hold only their tails past its prefix
        (read from its node chain) and every other row its whole history. A lone row's solo caches
        become a batch of one."""
        rows = view_rows(self.caches, len(self.rows)) if self.batched else [self.caches]
        self.caches, self.batched = _grouped_caches(plan, rows, groups), True
        self._set_groups_if_shared(groups)

    def start_grouped(self, rows: list[Row], solo_caches: list[list], groups: tuple[Group, ...], plan: SharingPlan,
                      pending: Pending) -> None:
        """Into an empty batch: rows (solo cache lists) grouped at once, each group's rows keeping only
        their tails; the batch of every row's whole history that ``join`` then ``share`` would build
        first (a second copy of each row's prefix, for a moment) is never made."""
        if self.rows:
            raise ValueError("start_grouped needs an empty batch")
        self.adopt_grouped(rows, _grouped_caches(plan, solo_caches, groups), groups, pending)

    def adopt_grouped(self, rows: list[Row], caches: list, groups: tuple[Group, ...], pending: Pending) -> None:
        """Into an empty batch: rows whose batched caches already read their groups' prefixes by
        reference (``start_grouped``, or joiners whose tails were prefilled on the group: engine/prefill.py)."""
        if self.rows:
            raise ValueError("adopt_grouped needs an empty batch")
        self.rows, self.caches, self.batched, self.pending = list(rows), caches, True, pending
        self._set_groups_if_shared(groups)

    def join_shared(self, rows: list[Row], caches: list, group: int, pending: Pending) -> None:
        """Add rows whose batched caches read running group ``group``'s prefix arrays (the same
        objects: one group, kv/shared_prefix_cache.py ``extend``) and hold only their tails."""
        check_extendable(self.caches, caches)
        extend_batch(self.caches, caches)
        self.pending = self.pending.extend(pending)
        self.rows += rows
        self.set_groups(tuple(g.extend([i == group] * len(rows)) for i, g in enumerate(self.groups)))

    def _unshare(self) -> None:
        """Back to per-row batched caches (each group row's copy of its prefix plus its tail)."""
        if self.groups:
            self.caches = merge_solo_rows([extract_row(self.caches, i) for i in range(len(self.rows))])
            self.set_groups(())


def _grouped_caches(plan: SharingPlan, rows: list[list], groups: tuple[Group, ...]) -> list:
    """Batched caches for ``rows`` (solo cache lists or views) with ``groups`` reading their node chains' spans."""
    specs = [PrefixSpec(g.prefix_length, prefix_from_spans(g.prefix_lease().layer_spans())) for g in groups]
    return share_groups(plan, rows, specs, row_groups(groups, len(rows)))
