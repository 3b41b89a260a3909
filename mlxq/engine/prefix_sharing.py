"""Which running rows read one leased prefix once per decode step, decided as plain data.

Rows that started from the same prompt-cache node chain (their ``Lease``)
begin with the same tokens, and their caches hold the same K/V for them.
After a join, ``choose_group`` picks at most one group: the node shared by
the most rows times the prefix length they all hold (the longest common
leased prefix), and ``RunningBatch.share`` rebuilds the batch's caches
with kv/sharing_plan.py's ``share_prefix``: the group's rows keep only
their tails and reference the node chain's spans (``Lease.layer_spans``,
kept in the tree by the rows' leases); the others ride along as strays.
Once a group runs, ``join_in_place`` decides for each burst of joiners:
those whose leases cover the group's prefix join it by reference (their
tails appended, the prefix never copied, the running rows untouched), the
rest join as strays; only a better group elsewhere rebuilds.

``--shared-prefix-attention``: ``off`` never groups; ``on`` groups any two
rows on at least ``MIN_PREFIX_TOKENS`` leased tokens; ``auto`` groups where
``shared_prefix_decode.worth_sharing`` says the step is faster (CUDA from
128k group tokens, measured on the H200; never on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxq.kv.shared_prefix_decode import worth_sharing
from mlxq.kv.sharing_plan import SharingPlan
from mlxq.store.lease import Lease
from mlxq.store.prefix_tree import Node

MODES = ("auto", "on", "off")
MIN_PREFIX_TOKENS = 32  # ``on``: shorter common prefixes stay per row (the regroup copies cost more)


@dataclass(frozen=True)
class SharingPolicy:
    mode: str  # auto, on, off
    plan: SharingPlan | None  # which layers share (None: not planned, ``unplanned`` says why)
    min_prefix: int = MIN_PREFIX_TOKENS
    unplanned: str | None = None  # why the model was not probed (``off``, no prompt cache, auto on the CPU)

    def wants(self, rows: int, prefix_length: int) -> bool:
        if self.mode == "off" or self.plan is None or not self.plan.can_share:
            return False
        if rows < 2 or prefix_length < self.min_prefix:
            return False
        return self.mode == "on" or worth_sharing(rows, prefix_length)

    def declined(self) -> str | None:
        """Why this server never shares (None when it may)."""
        if self.mode == "off":
            return "--shared-prefix-attention off"
        return self.plan.declined if self.plan is not None else self.unplanned


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


def node_at(lease: Lease, position: int) -> Node | None:
    """The node of ``lease``'s chain holding token ``position`` (None: the lease does not reach it)."""
    if not lease.held or lease.cached <= position:
        return None
    return next((node for node in lease.chain() if node.depth <= position < node.end), None)


def join_in_place(group: Group | None, running: list[Lease | None], joining: list[Lease | None],
                  policy: SharingPolicy) -> tuple[bool, ...] | None:
    """Per joiner, whether it joins the running ``group`` by reference (False: as a stray);
    None when there is no group to keep or another group would score higher (rebuild).

    A joiner belongs when its lease holds the node that holds the group's last prefix token
    for a running group row: the tree has one node per token path, so it took the same K/V."""
    if group is None:
        return None
    last = group.prefix_length - 1
    anchor = next((node_at(lease, last) for lease, s in zip(running, group.shares, strict=True)
                   if s and lease is not None), None)
    if anchor is None:
        return None
    into = tuple(lease is not None and node_at(lease, last) is anchor for lease in joining)
    best = choose_group(running + joining, policy)
    kept = (group.rows + sum(into)) * group.prefix_length
    if best is not None and best.rows * best.prefix_length > kept:
        return None
    return into


@dataclass
class SharingStats:
    """/stats.batch.shared_prefix and /metrics mlxq:shared_prefix_decode_steps."""

    steps: int = 0  # decode steps run with a shared-prefix group
    groups: int = 0  # times a group was built (each join that regrouped)
    rows_joined: int = 0  # joiners added to a running group by reference (no rebuild)

    def as_dict(self, policy: SharingPolicy | None, total_steps: int, group: Group | None) -> dict:
        return {
            "mode": policy.mode if policy else "off",
            "declined": policy.declined() if policy else "batch lane off",
            "steps": self.steps,
            "share_of_steps": self.steps / total_steps if total_steps else 0.0,
            "groups_built": self.groups,
            "rows_joined_in_place": self.rows_joined,
            "group_rows": group.rows if group else 0,
            "prefix_tokens": group.prefix_length if group else 0,
        }
