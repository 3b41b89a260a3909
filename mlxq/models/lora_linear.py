"""One linear layer serving every adapter's low-rank update, per row (models/multi_lora.py installs it).

``B`` is ``[members * R, output_dims]``: this member's rows of the shared
shrink (models/lora_shrink.py) hold each adapter's B with its ``scale``
folded in, the other members' rows are zero, so the expand reads the whole
shrink without slicing it (MLX's matmul copies a strided operand first).

- A plain ``nn.Linear`` base (dense weights) is *extended*: one array
  ``[input_dims + members * R, output_dims]``, the base weight transposed
  with B below it, replaces the base weight, and the base layer keeps a view
  of its top rows (no second copy). An adapted forward is then
  ``[x | h] @ extended``: the expand rides in the base matmul, no matmul of
  its own (on a GPU each cuBLAS call costs host time, and the adapter step
  is host-bound there).
- Any other base (quantized, or a tensor-parallel shard) adds the update:
  ``addmm(base(x), h, B)``.

Every row on the base: the base layer alone, as without adapters. DoRA rows
take their magnitude ``gain`` (1 for other rows) after the product, so DoRA
batches like LoRA.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxq.models.adapters import LowRank
from mlxq.models.lora_routing import AdapterRouting, Route
from mlxq.models.lora_shrink import SharedShrink


class MultiLoRALinear(nn.Module):
    def __init__(self, base: nn.Module, routing: AdapterRouting, pieces: Sequence[LowRank | None],
                 shrink: SharedShrink, member: int):
        super().__init__()
        self.base = base
        self._routing = routing
        self._shrink = shrink
        self._adapted = [p is not None for p in pieces]
        if member == 0:  # the group's A arrays, counted once among the model's parameters (engine/memory.py)
            self.shrink_a = [shrink.every, shrink.stack]
        out_dims = next(p for p in pieces if p is not None).lora_b.shape[1]
        # The scale goes into B (the last bits differ from mlx-lm's scale-after-product).
        blocks = [(p.scale * p.lora_b if p else mx.zeros((r, out_dims))).astype(routing.dtype)
                  for p, r in zip(pieces, routing.ranks, strict=True)]
        b = _padded(mx.concatenate(blocks), member, shrink.members)
        self._extended = None
        if type(base) is nn.Linear:
            self._extend(base, b)
        else:
            self.lora_b = b
        self.gains = None
        if any(p is not None and p.gain is not None for p in pieces):
            ones = mx.ones((out_dims,))
            self.gains = mx.stack([p.gain if p is not None and p.gain is not None else ones for p in pieces]
                                  + [ones]).astype(routing.dtype)  # the last: base rows
        mx.eval(self.lora_b, self.gains)

    def _extend(self, base: nn.Linear, b: mx.array) -> None:
        """The base weight and B as one array; the base layer and ``lora_b`` keep views of it (counted
        once as parameters). Evaluated here, layer by layer: the old weight goes as the new one exists."""
        in_dims = base.weight.shape[1]
        self._extended = mx.concatenate([base.weight.T, b])
        mx.eval(self._extended)
        base.weight = self._extended[:in_dims].T
        self.lora_b = self._extended[in_dims:]
        mx.eval(base.weight)

    def __call__(self, x: mx.array) -> mx.array:
        route = self._routing.route
        if route.is_base or (route.slot is not None and not self._adapted[route.slot]):
            return self.base(x)
        if self._extended is not None:
            ext = self._shrink.extended(x, route)
            if self.gains is not None:
                return self._with_gain(ext @ self._extended, route)
            return mx.addmm(self.base.bias, ext, self._extended) if "bias" in self.base else ext @ self._extended
        if self.gains is not None:
            return self._dora_added(x, route)
        rows, h = self._shrink.flat(x, route)
        out = mx.addmm(self.base(rows), h, self.lora_b)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _biased(self, out: mx.array) -> mx.array:
        return out + self.base.bias if "bias" in self.base else out

    def _with_gain(self, out: mx.array, route: Route) -> mx.array:
        """DoRA on an extended weight: ``out`` is ``x @ W^T + h @ B`` without the bias."""
        gain = self.gains[route.slot] if route.slot is not None else self.gains[route.indices][:, None, :]
        return self._biased(gain * out)

    def _dora_added(self, x: mx.array, route: Route) -> mx.array:
        """DoRA on another base: DoRALinear.__call__, its magnitude precomputed (models/adapters.py)."""
        rows, h = self._shrink.flat(x, route)
        out = mx.addmm(rows @ _dequantized(self.base).T, h, self.lora_b)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return self._with_gain(out, route)


def _padded(b: mx.array, member: int, members: int) -> mx.array:
    """B ``[r, out]`` for the ``member``-th of ``members`` blocks of a shrink: zero rows elsewhere."""
    rank = b.shape[0]
    return mx.pad(b, [(member * rank, (members - member - 1) * rank), (0, 0)])


def _dequantized(linear: nn.Module) -> mx.array:
    if not isinstance(linear, nn.QuantizedLinear):
        return linear.weight
    return mx.dequantize(linear.weight, linear.scales, linear.biases, group_size=linear.group_size,
                         bits=linear.bits, mode=linear.mode)
