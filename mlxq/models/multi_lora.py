"""Many adapters on one set of base weights, rows of one batch each on its own adapter.

Each linear layer some adapter touches becomes a ``MultiLoRALinear`` (module
replacement after load; mlx-lm's model files are untouched). It holds the base
layer once and every adapter's low-rank pieces stacked ``[adapters + 1, ...]``
(rank padded with zeros to the largest; the last slot is all zeros: "no
adapter"). What a forward computes comes from the shared ``AdapterRouting``,
which the engine sets around every model call (``adapter_rows``):

- every row on the base: the base layer alone (no cost);
- every row on one adapter: mlx-lm's LoRALinear / DoRALinear arithmetic
  itself, so a lone row equals ``mlx_lm.load(..., adapter_path=...)``;
- mixed rows: the base matmul once for all rows, plus each row's update
  ``scale[i] * (x @ A[i]) @ B[i]`` by two ``gather_mm`` over the per-row
  stack index (Punica / S-LoRA's gathered form); DoRA rows also take their
  magnitude ``gain[i]`` (1 for other rows), so DoRA batches like LoRA.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxq.models.adapters import LowRank

ROUTING_ATTRIBUTE = "mlxq_adapter_routing"  # set on the model object by install_adapters


@dataclass(frozen=True)
class Route:
    """The adapters of the rows of the next forward, decided once for every layer."""

    slot: int | None = None  # every row on this adapter slot (None with indices None: every row on the base)
    indices: mx.array | None = None  # mixed rows: each row's stack index (the "no adapter" slot for base rows)


BASE = Route()


class AdapterRouting:
    """Adapter name per row -> Route; the engine sets it around each model call."""

    def __init__(self, names: Sequence[str]):
        self.slots = {name: i for i, name in enumerate(names)}
        self.none_slot = len(names)  # the all-zero stack entry
        self.route = BASE
        self._last: tuple[tuple[str, ...], Route] = ((), BASE)  # decode steps repeat one composition

    def route_for(self, names: Sequence[str]) -> Route:
        key = tuple(names)
        if key == self._last[0]:
            return self._last[1]
        slots = [self.slots[name] if name else self.none_slot for name in key]
        if all(s == slots[0] for s in slots):
            route = BASE if slots[0] == self.none_slot else Route(slot=slots[0])
        else:
            route = Route(indices=mx.array(slots, dtype=mx.uint32))
        self._last = (key, route)
        return route

    @contextmanager
    def rows(self, names: Sequence[str]):
        previous, self.route = self.route, self.route_for(names)
        try:
            yield
        finally:
            self.route = previous


def adapter_rows(model, names: Sequence[str]):
    """Context for a forward of ``model`` whose rows use these adapters ("" = none, in row order)."""
    routing = getattr(model, ROUTING_ATTRIBUTE, None)
    return nullcontext() if routing is None else routing.rows(names)


class MultiLoRALinear(nn.Module):
    def __init__(self, base: nn.Module, routing: AdapterRouting, pieces: Sequence[LowRank | None]):
        super().__init__()
        self.base = base
        self._routing = routing
        present = [p for p in pieces if p is not None]
        in_dims, out_dims = present[0].lora_a.shape[0], present[0].lora_b.shape[1]
        rank = max(p.lora_a.shape[1] for p in present)
        dtype = present[0].lora_a.dtype
        self._scales = [p.scale if p is not None else 0.0 for p in pieces]
        self._adapted = [p is not None for p in pieces]
        self._dora = [p is not None and p.gain is not None for p in pieces]
        self.lora_a = mx.stack([_padded(p and p.lora_a, (in_dims, rank), dtype) for p in pieces]
                               + [mx.zeros((in_dims, rank), dtype)])
        self.lora_b = mx.stack([_padded(p and p.lora_b, (rank, out_dims), dtype) for p in pieces]
                               + [mx.zeros((rank, out_dims), dtype)])
        # Mixed rows: each slot's B carries its scale (one op fewer per layer; the last bits differ
        # from mlx-lm's scale-after-product, the tokens do not). One adapter alone: mlx-lm's own
        # arithmetic on per-slot views of the stacks (evaluated slices share the stacks' memory).
        self.scaled_b = self.lora_b * mx.array(self._scales + [0.0], dtype)[:, None, None]
        mx.eval(self.lora_a, self.lora_b)
        self._a = [self.lora_a[i] for i in range(len(pieces))]
        self._b = [self.lora_b[i] for i in range(len(pieces))]
        mx.eval(self._a, self._b)
        self.gains = None
        if any(self._dora):
            ones = mx.ones((out_dims,))
            self.gains = mx.stack([p.gain if p is not None and p.gain is not None else ones for p in pieces]
                                  + [ones])

    def __call__(self, x: mx.array) -> mx.array:
        route = self._routing.route
        if route.indices is not None:
            return self._mixed(x, route.indices)
        if route.slot is None or not self._adapted[route.slot]:
            return self.base(x)
        if self._dora[route.slot]:
            return self._dora_one(x, route.slot)
        z = (x @ self._a[route.slot]) @ self._b[route.slot]  # LoRALinear.__call__ (dropout off)
        return self.base(x) + (self._scales[route.slot] * z).astype(x.dtype)

    def _dora_one(self, x: mx.array, slot: int) -> mx.array:
        """DoRALinear.__call__ with its magnitude precomputed (models/adapters.py)."""
        y = x @ _dequantized(self.base).T
        z = (x @ self._a[slot]) @ self._b[slot]
        out = self.gains[slot].astype(x.dtype) * (y + (self._scales[slot] * z).astype(x.dtype))
        return out + self.base.bias if "bias" in self.base else out

    def _mixed(self, x: mx.array, indices: mx.array) -> mx.array:
        if x.ndim != 3 or x.shape[0] != indices.shape[0]:
            raise RuntimeError(f"adapter routing for {indices.shape[0]} rows met an input of shape {x.shape}")
        y = self.base(x)
        z = mx.gather_mm(mx.gather_mm(x, self.lora_a, rhs_indices=indices), self.scaled_b, rhs_indices=indices)
        delta = z.astype(x.dtype)
        if self.gains is None:
            return y + delta
        gain = self.gains[indices].astype(x.dtype)[:, None, :]
        if "bias" not in self.base:
            return gain * (y + delta)
        return gain * (y - self.base.bias + delta) + self.base.bias


def _padded(array: mx.array | None, shape: tuple[int, int], dtype) -> mx.array:
    if array is None:
        return mx.zeros(shape, dtype)
    array = array.astype(dtype)
    if array.shape == shape:
        return array
    return mx.pad(array, [(0, shape[0] - array.shape[0]), (0, shape[1] - array.shape[1])])


def _dequantized(linear: nn.Module) -> mx.array:
    if not isinstance(linear, nn.QuantizedLinear):
        return linear.weight
    return mx.dequantize(linear.weight, linear.scales, linear.biases, group_size=linear.group_size,
                         bits=linear.bits, mode=linear.mode)


def install_adapters(model: nn.Module, names: Sequence[str], adapters: Sequence[dict[str, LowRank]]) -> AdapterRouting:
    """Replace every linear layer any adapter touches; the adapters' slots follow ``names``."""
    routing = AdapterRouting(names)
    modules = dict(model.named_modules())
    paths = sorted({path for pieces in adapters for path in pieces})
    replaced = [(path, MultiLoRALinear(modules[path], routing, [pieces.get(path) for pieces in adapters]))
                for path in paths]
    model.update_modules(tree_unflatten(replaced))
    mx.eval(model.parameters())
    setattr(model, ROUTING_ATTRIBUTE, routing)
    return routing


def attach_adapters(loaded, specs: Sequence) -> object:
    """The hook after load: serve ``specs`` (AdapterSpec) on ``loaded`` (models.loader.LoadedModel)."""
    from mlxq.models.adapters import AdapterError, check_adapter_dir, read_adapter

    if not specs:
        return loaded
    infos = [check_adapter_dir(spec) for spec in specs]
    taken = {loaded.name}
    for info in infos:
        if info.name in taken:
            raise AdapterError(f"--adapter {info.name}: the name is already taken (by the base model or "
                               "another adapter); every model id must be unique")
        taken.add(info.name)
    pieces = [read_adapter(loaded.model, info) for info in infos]
    install_adapters(loaded.model, [info.name for info in infos], pieces)
    loaded.adapters = {info.name: info for info in infos}
    return loaded
