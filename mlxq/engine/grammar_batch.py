"""A decode step's grammar rows constrained together: one bitmask, one upload, one masking op.

Masking each grammar row as its own small graph (upload its bitmask, unpack,
select) costs a handful of kernel launches per row: at 64 rows on CUDA
hundreds of launches a step, which is what held grammar-constrained decode
at 0.73x of free decode (docs/benchmarks.md, "Structured outputs:
constrained vs unconstrained decode"). Here every grammar row's mask is
filled into one [G, W] bitmask, uploaded once and applied to those rows'
logits in one op.

Rows without a grammar are not touched: they sample from the model's logits
as they are. A grammar row with logits processors (logit_bias, penalties)
masks after its processors, as the serial lane does, so it keeps its mask
for its own ``Row.sample``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from mlxq.engine.grammar import apply_bitmask, prepare_masks
from mlxq.engine.grammar_timing import GrammarTiming

if TYPE_CHECKING:
    from mlxq.engine.rows import Row


@dataclass(frozen=True)
class StepLogits:
    """The logits each row of a decode step samples from."""

    logits: mx.array  # [B, V] the model's
    masked: mx.array | None = None  # [M, V] grammar rows' logits with forbidden tokens at -inf
    slots: dict[int, int] = field(default_factory=dict)  # batch row -> its row in ``masked``

    def row(self, i: int) -> tuple[mx.array, bool]:
        """Row ``i``'s logits [1, V], and whether its grammar mask is already applied to them."""
        k = self.slots.get(i)
        if k is None:
            return self.logits[i : i + 1], False
        return self.masked[k : k + 1], True


def constrain_step(rows: list[Row], grammar: list[int], logits: mx.array, inputs: mx.array,
                   timing: GrammarTiming | None) -> StepLogits:
    """Mask the grammar rows (``grammar``: their indices in ``rows``) of a step whose forward is
    already started: token n is read and every mask computed while it runs."""
    bitmask = prepare_masks([(rows[i].grammar, i) for i in grammar], inputs, logits.shape[-1], timing)
    together = []
    for k, i in enumerate(grammar):
        if rows[i].processors:
            rows[i].grammar.hold(bitmask[k : k + 1])
        else:
            together.append(k)
    if not together:
        return StepLogits(logits)
    index = [grammar[k] for k in together]
    picked = logits if index == list(range(logits.shape[0])) else logits[mx.array(index)]
    masked = apply_bitmask(picked, bitmask[together])
    return StepLogits(logits, masked, {i: n for n, i in enumerate(index)})
