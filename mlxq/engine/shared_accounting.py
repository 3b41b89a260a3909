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
the chain's), so it never holds a copy. One with more of its own prefills
on its solo caches (the lease's copy of the prefix) until it joins: the KV
budget leaves that out, the memory room counts it
(``step_plan.fits_memory``), so such a burst joins in waves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from mlxq.engine.prefix_sharing import Group, SharingPolicy, choose_groups
from mlxq.engine.step_plan import Extent, Load
from mlxq.store.lease import Lease

Credit = tuple[int, int | None]  # (leading tokens read by reference, which prefix; None: its own copy)
NO_CREDIT: Credit = (0, None)


def shares_layers(policy: SharingPolicy | None) -> bool:
    return policy is not None and policy.mode != "off" and policy.plan is not None and policy.plan.can_share


def running_credits(groups: tuple[Group, ...], rows: int) -> list[Credit]:
    """Per running row: its group's prefix (the group's index as the key), or none."""
    out = [NO_CREDIT] * rows
    for g, group in enumerate(groups):
        for row, member in enumerate(group.shares[:rows]):
            if member:
                out[row] = (group.prefix_length, g)
    return out


def credits(leases: Sequence[Lease | None], running: int, groups: tuple[Group, ...],
            policy: SharingPolicy | None) -> list[Credit]:
    """Per row (``running`` rows first, then joiners, then requests asking in): what it reads by reference."""
    if not shares_layers(policy):
        return [NO_CREDIT] * len(leases)
    if not groups:
        predicted = choose_groups(list(leases), policy)
        return running_credits(predicted, len(leases))
    out = running_credits(groups, running) + [NO_CREDIT] * (len(leases) - running)
    for g, group in enumerate(groups):
        anchor = group.anchor(leases[:running])
        if anchor is None:
            continue
        for row in range(running, len(leases)):
            if out[row][1] is None and group.holds_prefix(leases[row], anchor):
                out[row] = (group.prefix_length, g)
    return out


def credited(load: Load, candidate: Extent | None, given: list[Credit]) -> tuple[Load, Extent | None]:
    """``load`` (running rows, joiners) and ``candidate`` with ``given`` applied in that order."""
    extents = [*load.running, *load.prefilling, *([candidate] if candidate is not None else [])]
    shared = [e.sharing(*credit) for e, credit in zip(extents, given, strict=True)]
    running, rest = len(load.running), len(load.running) + len(load.prefilling)
    out = replace(load, running=tuple(shared[:running]), prefilling=tuple(shared[running:rest]))
    return out, shared[rest] if candidate is not None else None
