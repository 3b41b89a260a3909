"""Which running rows read one leased prefix once per decode step, decided as plain data.

Rows that started from the same prompt-cache node chain (their ``Lease``)
begin with the same tokens, and their caches hold the same K/V for them.
After a join, ``choose_groups`` picks the groups: the node shared by the
most rows times the prefix length they all hold (the longest common
leased prefix), then the same among the rows left (agents of another
system prompt), up to the policy's ``max_groups``; ``RunningBatch.share``
rebuilds the batch's caches
with kv/sharing_plan.py's ``share_prefix``: the group's rows keep only
their tails and reference the node chain's spans (``Lease.layer_spans``,
kept in the tree by the rows' leases); the others ride along as strays.
Once groups run, ``join_in_place`` decides for each burst of joiners:
those whose leases cover a group's prefix join it by reference (their
tails appended, the prefix never copied, the running rows untouched), the
rest join as strays; only better groups elsewhere rebuild.

``--shared-prefix-attention``: ``off`` never groups; ``on`` groups any two
rows on at least ``MIN_PREFIX_TOKENS`` leased tokens, up to ``ON_MAX_GROUPS``
groups per batch; ``auto`` forms one group per batch (several were not
measured on a device), where
``shared_prefix_decode.worth_sharing`` says the step is faster (CUDA from
128k group tokens, measured on the H200; never on the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from mlxq.kv.shared_prefix_decode import check_failed, not_worth_sharing, worth_sharing
from mlxq.kv.sharing_plan import SharingPlan
from mlxq.store.lease import Lease
from mlxq.store.prefix_tree import Node

MODES = ("auto", "on", "off")
MIN_PREFIX_TOKENS = 32  # ``on``: shorter common prefixes stay per row (the regroup copies cost more)
ON_MAX_GROUPS = 4  # ``on``: distinct shared prefixes per batch


@dataclass(frozen=True)
class SharingPolicy:
    mode: str  # auto, on, off
    plan: SharingPlan | None  # which layers share (None: not planned, ``unplanned`` says why)
    min_prefix: int = MIN_PREFIX_TOKENS
    unplanned: str | None = None  # why the model was not probed (``off``, no prompt cache, auto on the CPU)

    @property
    def max_groups(self) -> int:
        return ON_MAX_GROUPS if self.mode == "on" else 1

    def wants(self, rows: int, prefix_length: int) -> bool:
        if self.mode == "off" or self.plan is None or not self.plan.can_share:
            return False
        if rows < 2 or prefix_length < self.min_prefix:
            return False
        return self.mode == "on" or worth_sharing(rows, prefix_length)

    def auto_declines(self, leases: list[Lease | None]) -> str | None:
        """Under ``auto``: why the rows of ``leases`` form no group although ``on`` would group some
        of them (the gate: ``worth_sharing``); None when ``on`` would not group them either."""
        if self.mode != "auto" or self.plan is None or not self.plan.can_share:
            return None
        candidate = choose_group(leases, replace(self, mode="on"))
        return None if candidate is None else not_worth_sharing(candidate.rows, candidate.prefix_length)

    def declined(self) -> str | None:
        """Why this server never shares (None when it may)."""
        if self.mode == "off":
            return "--shared-prefix-attention off"
        if self.plan is None:
            return self.unplanned
        if self.plan.declined is None and self.mode == "auto":  # fail closed: no kernels, no gain measured
            return check_failed()
        return self.plan.declined


@dataclass(frozen=True)
class Group:
    node: Node  # the deepest node the group's rows all lease through
    prefix_length: int  # tokens every row of the group holds from the chain
    shares: tuple[bool, ...]  # per running row: in the group

    @property
    def rows(self) -> int:
        return sum(self.shares)

    def prefix_lease(self) -> Lease:
        """An unpinned view of the chain cut to the group's prefix (the rows' own leases pin it)."""
        return Lease(self.prefix_length, None, self.node)

    def keep(self, keep: list[int]) -> Group:
        return Group(self.node, self.prefix_length, tuple(self.shares[i] for i in keep))

    def extend(self, joining: list[bool]) -> Group:
        return Group(self.node, self.prefix_length, self.shares + tuple(joining))

    @property
    def score(self) -> int:
        return self.rows * self.prefix_length

    def anchor(self, running: Sequence[Lease | None]) -> Node | None:
        """The node holding the group's last prefix token in one of its rows' chains (``running``: the
        running rows' leases, in batch order, read as far as both it and ``shares`` go); None when no
        member's lease reaches it."""
        last = self.prefix_length - 1
        return next((node_at(lease, last) for lease, member in zip(running, self.shares, strict=False)
                     if member and lease is not None), None)

    def holds_prefix(self, lease: Lease | None, anchor: Node) -> bool:
        """Whether ``lease`` reads the group's prefix from the same K/V: its chain holds ``anchor`` (the
        tree has one node per token path)."""
        return lease is not None and node_at(lease, self.prefix_length - 1) is anchor


def row_groups(groups: tuple[Group, ...], rows: int) -> list[int]:
    """Per row, the index of its group in ``groups`` (-1: in none)."""
    out = [-1] * rows
    for g, group in enumerate(groups):
        for row, member in enumerate(group.shares):
            if member:
                out[row] = g
    return out


def choose_groups(leases: list[Lease | None], policy: SharingPolicy,
                  tally: GroupTally | None = None) -> tuple[Group, ...]:
    """Disjoint groups, best first: ``choose_group``, then again among the rows it left out.

    ``tally``: the first ``tally.count`` of ``leases`` already counted (``GroupTally``); the first
    group is then read from it, the same as ``choose_group`` over all of them."""
    groups: list[Group] = []
    left = list(leases)
    while len(groups) < policy.max_groups:
        if not groups and tally is not None:
            group = tally.best(policy, leases[tally.count :])
        else:
            group = choose_group(left, policy)
        if group is None:
            break
        groups.append(group)
        left = [None if member else lease for lease, member in zip(left, group.shares, strict=True)]
    return tuple(groups)


def choose_group(leases: list[Lease | None], policy: SharingPolicy) -> Group | None:
    """The group with the most rows x prefix tokens that ``policy`` wants, or None."""
    members: dict[int, tuple[Node, list[int]]] = {}
    for row, lease in enumerate(leases):
        if lease is None or not lease.held:
            continue
        for node in lease.chain():
            if node.tokens and node.depth < lease.cached:
                members.setdefault(id(node), (node, []))[1].append(row)
    best: tuple[int, Group] | None = None
    for node, rows in members.values():
        length = min(node.end, *(leases[i].cached for i in rows))
        if not policy.wants(len(rows), length):
            continue
        score = len(rows) * length
        if best is None or score > best[0]:
            in_group = set(rows)
            best = score, Group(node, length, tuple(i in in_group for i in range(len(leases))))
    return None if best is None else best[1]


class GroupTally:
    """``choose_group``'s count of rows per node, kept over a list of leases that only grows.

    Admission asks for the groups a burst would form once per arriving request, over every row
    and joiner before it: counted anew each time that is quadratic in the burst (on the H200 ~1 ms
    a request at 64 agents on a 16k prefix). Counted once per lease, each question reads the
    tallies and the asking request's chain. Same groups, same order, same ties as
    ``choose_group``: nodes are tallied in the order that function meets them."""

    def __init__(self):
        self.leases: list[Lease | None] = []  # counted so far, in row order
        self._nodes: dict[int, tuple[Node, list[int], list[int]]] = {}  # id -> (node, rows, [least cached])

    @property
    def count(self) -> int:
        return len(self.leases)

    def add(self, lease: Lease | None) -> None:
        _count(self._nodes, lease, len(self.leases))
        self.leases.append(lease)

    def best(self, policy: SharingPolicy, extra: Sequence[Lease | None] = ()) -> Group | None:
        """``choose_group`` over the counted leases followed by ``extra`` (not counted)."""
        more: dict[int, tuple[Node, list[int], list[int]]] = {}  # the extras' rows per node, in meeting order
        for k, lease in enumerate(extra):
            _count(more, lease, self.count + k)
        best: tuple[int, Node, int, list[int], list[int]] | None = None
        for key, (node, rows, least) in self._nodes.items():
            added = more.get(key)
            count = len(rows) + (len(added[1]) if added else 0)
            if count < 2:  # never wanted (SharingPolicy.wants): each agent's own node of a burst
                continue
            length = min(node.end, least[0], added[2][0] if added else least[0])
            best = _better(best, policy, node, count, length, rows, added[1] if added else [])
        for key, (node, rows, least) in more.items():
            if key not in self._nodes and len(rows) > 1:
                best = _better(best, policy, node, len(rows), min(node.end, least[0]), [], rows)
        if best is None:
            return None
        _, node, length, rows, added = best
        in_group = set(rows) | set(added)
        return Group(node, length, tuple(i in in_group for i in range(self.count + len(extra))))


def _count(nodes: dict[int, tuple[Node, list[int], list[int]]], lease: Lease | None, row: int) -> None:
    """Add ``row`` to ``nodes``' count of every node of ``lease``'s chain it reads (id -> (node, rows,
    [least cached])), new nodes in the order ``choose_group`` meets them."""
    if lease is None or not lease.held:
        return
    for node in lease.chain():
        if node.tokens and node.depth < lease.cached:
            entry = nodes.setdefault(id(node), (node, [], [lease.cached]))
            entry[1].append(row)
            entry[2][0] = min(entry[2][0], lease.cached)


def _better(best, policy: SharingPolicy, node: Node, count: int, length: int, rows: list[int], added: list[int]):
    if not policy.wants(count, length):
        return best
    score = count * length
    return (score, node, length, rows, added) if best is None or score > best[0] else best


def node_at(lease: Lease, position: int) -> Node | None:
    """The node of ``lease``'s chain holding token ``position`` (None: the lease does not reach it)."""
    if not lease.held or lease.cached <= position:
        return None
    return next((node for node in lease.chain() if node.depth <= position < node.end), None)


def join_in_place(groups: tuple[Group, ...], running: list[Lease | None], joining: list[Lease | None],
                  policy: SharingPolicy) -> tuple[int, ...] | None:
    """Per joiner, the index of the running group it joins by reference (-1: it joins as a
    stray); None when no group runs or other groups would score higher (rebuild).

    A joiner belongs to a group when its lease holds the node that holds the group's last
    prefix token for one of the group's rows: the tree has one node per token path, so it
    took the same K/V."""
    if not groups:
        return None
    anchors = [group.anchor(running) for group in groups]
    if any(anchor is None for anchor in anchors):
        return None
    into = tuple(next((g for g, (group, anchor) in enumerate(zip(groups, anchors, strict=True))
                       if group.holds_prefix(lease, anchor)), -1)
                 for lease in joining)
    kept = sum(group.extend([g == i for g in into]).score for i, group in enumerate(groups))
    if sum(group.score for group in choose_groups(running + joining, policy)) > kept:
        return None
    return into


@dataclass
class SharingStats:
    """/stats.batch.shared_prefix and /metrics mlxq:shared_prefix_decode_steps."""

    steps: int = 0  # decode steps run with a shared-prefix group
    groups: int = 0  # times a group was built (each join that regrouped)
    rows_joined: int = 0  # joiners added to a running group by reference (no rebuild)
    multi_group_steps: int = 0  # decode steps run with two or more groups (two shared prefixes)
    auto_declined: int = 0  # joins after which ``auto`` left rows ungrouped that ``on`` would group
    auto_last_declined: str | None = None  # why, the last time (``SharingPolicy.auto_declines``)

    def note_declined(self, why: str | None) -> None:
        if why is not None:
            self.auto_declined += 1
            self.auto_last_declined = why
    tails_recomputed: int = 0  # joiners' own leased tokens past a group's prefix computed again, not gathered
    tails_packed: int = 0  # tails' forwards run packed, one position per row (kv/packed_tails.py)

    def count_step(self, groups: tuple[Group, ...]) -> None:
        self.steps += bool(groups)
        self.multi_group_steps += len(groups) > 1

    def as_dict(self, policy: SharingPolicy | None, total_steps: int, groups: tuple[Group, ...]) -> dict:
        from mlxq.kv import packed_tails
        from mlxq.kv.shared_prefix_decode import kernel_status

        return {
            "mode": policy.mode if policy else "off",
            "declined": policy.declined() if policy else "batch lane off",
            "kernels": kernel_status(),  # the kernels that may run, why one was turned down, the CUDA check
            "steps": self.steps,
            "share_of_steps": self.steps / total_steps if total_steps else 0.0,
            "groups_built": self.groups,
            "rows_joined_in_place": self.rows_joined,
            "multi_group_steps": self.multi_group_steps,
            "auto_declined_joins": self.auto_declined,
            "auto_last_declined": self.auto_last_declined,
            "tail_tokens_recomputed": self.tails_recomputed,
            "tails_packed_forwards": self.tails_packed,
            "tails_packed_declined": packed_tails.declined(policy.plan if policy else None),
            "groups": len(groups),
            "group_rows": sum(group.rows for group in groups),
            "prefix_tokens": [group.prefix_length for group in groups],
        }


@dataclass(frozen=True)
class TailsGroup:
    """Where joiners prefilling their last chunks in one forward read a prefix by reference."""

    group: Group  # the prefix (node, length); ``shares``: the running rows in it (those first, as the batch has them)
    into: int | None  # the running group they join; None: a new group (running members, if any, grouped first)


def tails_group(groups: tuple[Group, ...], running: list[Lease | None], joining: list[Lease | None],
                waiting: list[Lease | None], policy: SharingPolicy | None) -> TailsGroup | None:
    """The prefix every joiner of ``joining`` (all advancing their last chunks together) reads by
    reference, or None (then their caches are merged, a copy of the prefix per row).

    Every joiner must hold the prefix from the same node chain (its lease: the same K/V) and be
    in the group: a running group it may join in place (``join_in_place``), else the group
    ``choose_group`` picks among the running rows, the joiners and the joiners still ``waiting``
    on their prefixes (so ``auto`` counts the whole wave, not one step's share of it). A batch
    running without a group joins only when some of its rows are in the new group (they are
    grouped first); one running other groups does not."""
    if policy is None or len(joining) < 2 or any(lease is None or not lease.held for lease in joining):
        return None
    if groups:
        into = join_in_place(groups, running, joining, policy)
        if into is None or into[0] < 0 or any(g != into[0] for g in into):
            return None
        return TailsGroup(groups[into[0]], into[0])
    group = choose_group(running + joining + waiting, policy)
    if group is None or not all(group.shares[len(running) : len(running) + len(joining)]):
        return None
    members = group.shares[: len(running)]
    if running and not any(members):
        return None
    return TailsGroup(Group(group.node, group.prefix_length, members), None)
