"""Which rows' KV admission counts once per shared prefix, decided as plain data.

Rows in a shared-prefix group (engine/prefix_sharing.py) hold only their
tails in the shared layers; the prefix is one node chain of the prompt
cache. The KV budget (``step_plan.Sizing.projected_bytes``) counts such a
prefix once and each row's own tail, but only where sharing is in force or
is about to be, and per row otherwise (conservative):

- a running group counts its rows, and a joiner (or a request asking to
  be admitted) whose lease holds the group's last prefix token in the same
  node (``join_in_place`` takes such a joiner into the group by reference);
- with no group running, the groups ``choose_groups`` would form over the
  running rows, the joiners and the request (the join that follows builds
  them: ``Joining._share_prefix``);
- ``--shared-prefix-attention off``, a model that declines sharing, or no
  prompt cache: nobody.

A joiner with a short tail prefills it on the prefix by reference
(engine/shared_tails.py: the tail from its lease's spans, the prefix from
the chain's), so it never holds a copy, where ``TailTerms.by_reference``
says so; both that path and the accounting read this one decision. One
that it declines (token 0 not in the decode step, caches that cannot be
cut, a prefix it must store itself, caches that hold more than its lease
lent), or with more of its own, prefills on its solo caches (the lease's
copy of the prefix) until it joins: the KV budget leaves that out, the
memory room counts it (``Extent.on_copy``, ``step_plan.fits_memory``), so
such a burst joins in waves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from mlxq.engine.prefix_sharing import Group, GroupTally, SharingPolicy, choose_groups
from mlxq.engine.step_plan import Extent, Load
from mlxq.store.lease import Lease

# (leading tokens read by reference, which prefix (None: its own copy), prefilled on a copy until it joins)
Credit = tuple[int, int | None, bool]
NO_CREDIT: Credit = (0, None, False)


@dataclass(frozen=True)
class TailTerms:
    """What decides whether a joiner's last chunk runs on its leased prefix by reference
    (engine/shared_tails.py) or on its own copy of it: that path and the memory room read it alike."""

    token0_in_decode: bool  # its token 0 comes from the batch's decode step (the tails' forward keeps no logits)
    trimmable: bool  # every layer full attention: the prefix and its tail can be cut apart
    holds_lease_only: bool  # its caches are what its lease lent, nothing computed on them yet
    stores_boundary: bool  # it stores its own caches when its prefill ends (followers wait, a new system prompt)

    @property
    def by_reference(self) -> bool:
        return self.token0_in_decode and self.trimmable and self.holds_lease_only and not self.stores_boundary


def shares_layers(policy: SharingPolicy | None) -> bool:
    return policy is not None and policy.mode != "off" and policy.plan is not None and policy.plan.can_share


def running_credits(groups: tuple[Group, ...], rows: int) -> list[Credit]:
    """Per running row: its group's prefix (the group's index as the key), or none."""
    out = [NO_CREDIT] * rows
    for g, group in enumerate(groups):
        for row, member in enumerate(group.shares[:rows]):
            if member:
                out[row] = (group.prefix_length, g, False)
    return out


def credits(leases: Sequence[Lease | None], running: int, groups: tuple[Group, ...],
            policy: SharingPolicy | None, on_copy: Sequence[bool] = (), tally: GroupTally | None = None
            ) -> list[Credit]:
    """Per row (``running`` rows first, then joiners, then requests asking in): what it reads by reference.

    ``on_copy``: per row (missing ones False), its tail would be prefilled on its own copy
    (``TailTerms.by_reference`` declines it): a joiner credited so holds that copy until it joins.
    ``tally``: the first ``tally.count`` leases already counted per node (the same answer, read
    from the counts: admission asks once per arriving request)."""
    if not shares_layers(policy):
        return [NO_CREDIT] * len(leases)
    return [(shared, prefix, prefix is not None and row < len(on_copy) and on_copy[row])
            for row, (shared, prefix, _) in enumerate(_credits(leases, running, groups, policy, tally))]


def _credits(leases: Sequence[Lease | None], running: int, groups: tuple[Group, ...],
             policy: SharingPolicy, tally: GroupTally | None = None) -> list[Credit]:
    if not groups:
        predicted = choose_groups(list(leases), policy, tally)
        return running_credits(predicted, len(leases))
    out = running_credits(groups, running) + [NO_CREDIT] * (len(leases) - running)
    for g, group in enumerate(groups):
        anchor = group.anchor(leases[:running])
        if anchor is None:
            continue
        for row in range(running, len(leases)):
            if out[row][1] is None and group.holds_prefix(leases[row], anchor):
                out[row] = (group.prefix_length, g, False)
    return out


def credited(load: Load, candidate: Extent | None, given: list[Credit],
             kept: dict | None = None) -> tuple[Load, Extent | None]:
    """``load`` (running rows, joiners) and ``candidate`` with ``given`` applied in that order.

    ``kept``: the credited extents of ``load``'s rows from earlier calls, by (extent, credit); the
    caller keeps those extents alive and the dict with them (admission, one call per arrival)."""
    extents = [*load.running, *load.prefilling, *([candidate] if candidate is not None else [])]
    if kept is None:
        shared = [e.sharing(*credit) for e, credit in zip(extents, given, strict=True)]
    else:
        shared = [_kept_sharing(kept, e, credit) for e, credit in zip(extents[: len(extents) - (candidate is not None)],
                                                                      given, strict=False)]
        if candidate is not None:
            shared.append(candidate.sharing(*given[-1]))
    running, rest = len(load.running), len(load.running) + len(load.prefilling)
    out = replace(load, running=tuple(shared[:running]), prefilling=tuple(shared[running:rest]))
    return out, shared[rest] if candidate is not None else None


def _kept_sharing(kept: dict, extent: Extent, credit: Credit) -> Extent:
    key = (id(extent), credit)
    out = kept.get(key)
    if out is None:
        out = kept[key] = extent.sharing(*credit)
    return out
