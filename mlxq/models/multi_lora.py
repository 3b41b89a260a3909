"""Many adapters on one set of base weights, rows of one batch each on its own adapter.

Each linear layer some adapter touches becomes a ``MultiLoRALinear`` (module
replacement after load; mlx-lm's model files are untouched). It holds the base
layer once and every adapter's low-rank pieces side by side: ``A`` is
``[input_dims, R]`` and ``B`` ``[R, output_dims]`` with R the sum of the
adapters' ranks (adapter k owns columns / rows ``offsets[k]:offsets[k] + r_k``,
zeros where it does not touch the layer), each adapter's ``scale`` folded into
its rows of B, all in the base layer's dtype. What a forward computes comes
from the shared ``AdapterRouting``, which the engine sets around every model
call (``adapter_rows``):

- every row on the base: the base layer alone (no cost);
- every row on one adapter k: ``addmm(base(x), x @ A_k, B_k)`` on views of
  the blocks (two more kernels per layer);
- mixed rows: ``addmm(base(x), (x @ A) * mask, B)``: the base matmul once for
  all rows, every adapter's shrink in one narrow matmul, a per-row mask that
  keeps each row's own adapter's columns (none for base rows), one expand.
  For the 1-4 adapters a server carries, R is a few dozen columns: dense
  matmuls are cheaper than a gathered (``gather_mm``) product, which measured
  4x slower than the base step on the H200 (benchmarks.md, "LoRA adapters").
- DoRA rows also take their magnitude ``gain`` (1 for other rows), so DoRA
  batches like LoRA.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from mlxq.models.adapters import LowRank

ROUTING_ATTRIBUTE = "mlxq_adapter_routing"  # set on the model object by install_adapters


@dataclass(frozen=True)
class Route:
    """The adapters of the rows of the next forward, decided once for every layer."""

    slot: int | None = None  # every row on this adapter (None with mask None: every row on the base)
    mask: mx.array | None = None  # mixed rows: [rows, 1, R], 1 on each row's own adapter's columns
    indices: mx.array | None = None  # mixed rows: each row's adapter (len(adapters) for the base), for DoRA


BASE = Route()


class AdapterRouting:
    """Adapter name per row -> Route; the engine sets it around each model call."""

    def __init__(self, names: Sequence[str], ranks: Sequence[int], dtype):
        self.slots = {name: i for i, name in enumerate(names)}
        self.ranks = list(ranks)
        self.offsets = [int(o) for o in np.cumsum([0, *ranks])[:-1]]
        self.dtype = dtype  # the adapted layers' dtype: the mask must not promote their products
        self.route = BASE
        self._last: tuple[tuple[str, ...], Route] = ((), BASE)  # decode steps repeat one composition

    def route_for(self, names: Sequence[str]) -> Route:
        key = tuple(names)
        if key == self._last[0]:
            return self._last[1]
        slots = [self.slots[name] if name else None for name in key]
        if all(s == slots[0] for s in slots):
            route = BASE if slots[0] is None else Route(slot=slots[0])
        else:
            mask = np.zeros((len(slots), 1, sum(self.ranks)), dtype=np.float32)
            for row, slot in enumerate(slots):
                if slot is not None:
                    mask[row, 0, self.offsets[slot] : self.offsets[slot] + self.ranks[slot]] = 1.0
            none = len(self.ranks)
            route = Route(mask=mx.array(mask).astype(self.dtype),
                          indices=mx.array([none if s is None else s for s in slots], dtype=mx.uint32))
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


def adapter_names(model) -> list[str]:
    """The adapters installed on ``model``, in slot order (none: [])."""
    routing = getattr(model, ROUTING_ATTRIBUTE, None)
    return [] if routing is None else list(routing.slots)


class MultiLoRALinear(nn.Module):
    def __init__(self, base: nn.Module, routing: AdapterRouting, pieces: Sequence[LowRank | None]):
        super().__init__()
        self.base = base
        self._routing = routing
        present = next(p for p in pieces if p is not None)
        in_dims, out_dims = present.lora_a.shape[0], present.lora_b.shape[1]
        dtype = routing.dtype
        self._adapted = [p is not None for p in pieces]
        self._dora = [p is not None and p.gain is not None for p in pieces]
        # A is kept as [R, input_dims] so each adapter's block is a run of rows (its view is a copy-free
        # slice); the scale goes into B (the last bits differ from mlx-lm's scale-after-product).
        self.lora_a_t = mx.concatenate([(p.lora_a.T if p else mx.zeros((r, in_dims))).astype(dtype)
                                        for p, r in zip(pieces, routing.ranks, strict=True)])
        self.lora_b = mx.concatenate([(p.scale * p.lora_b if p else mx.zeros((r, out_dims))).astype(dtype)
                                      for p, r in zip(pieces, routing.ranks, strict=True)])
        self.gains = None
        if any(self._dora):
            ones = mx.ones((out_dims,))
            self.gains = mx.stack([p.gain if p is not None and p.gain is not None else ones for p in pieces]
                                  + [ones]).astype(dtype)
        mx.eval(self.parameters())
        blocks = list(zip(routing.offsets, routing.ranks, strict=True))
        self._a_all = self.lora_a_t.T
        self._a = [self.lora_a_t[o : o + r].T for o, r in blocks]
        self._b = [self.lora_b[o : o + r] for o, r in blocks]
        mx.eval(self._a_all, self._a, self._b)  # views: evaluated slices share the arrays above

    def __call__(self, x: mx.array) -> mx.array:
        route = self._routing.route
        if route.mask is not None:
            return self._mixed(x, route)
        if route.slot is None or not self._adapted[route.slot]:
            return self.base(x)
        if self._dora[route.slot]:
            return self._dora_one(x, route.slot)
        return mx.addmm(self.base(x), x @ self._a[route.slot], self._b[route.slot])

    def _dora_one(self, x: mx.array, slot: int) -> mx.array:
        """DoRALinear.__call__ with its magnitude precomputed (models/adapters.py)."""
        y = x @ _dequantized(self.base).T
        out = self.gains[slot] * mx.addmm(y, x @ self._a[slot], self._b[slot])
        return out + self.base.bias if "bias" in self.base else out

    def _mixed(self, x: mx.array, route: Route) -> mx.array:
        if x.ndim != 3 or x.shape[0] != route.mask.shape[0]:
            raise RuntimeError(f"adapter routing for {route.mask.shape[0]} rows met an input of shape {x.shape}")
        out = mx.addmm(self.base(x), (x @ self._a_all) * route.mask, self.lora_b)
        if self.gains is None:
            return out
        gain = self.gains[route.indices][:, None, :]
        if "bias" not in self.base:
            return gain * out
        return gain * (out - self.base.bias) + self.base.bias


def _dequantized(linear: nn.Module) -> mx.array:
    if not isinstance(linear, nn.QuantizedLinear):
        return linear.weight
    return mx.dequantize(linear.weight, linear.scales, linear.biases, group_size=linear.group_size,
                         bits=linear.bits, mode=linear.mode)


def _compute_dtype(linear: nn.Module):
    """The dtype a linear layer computes in (a quantized layer's scales carry it)."""
    return linear.scales.dtype if isinstance(linear, nn.QuantizedLinear) else linear.weight.dtype


def install_adapters(model: nn.Module, names: Sequence[str], adapters: Sequence[dict[str, LowRank]]) -> AdapterRouting:
    """Replace every linear layer any adapter touches; the adapters' slots follow ``names``."""
    modules = dict(model.named_modules())
    paths = sorted({path for pieces in adapters for path in pieces})
    ranks = [next(iter(pieces.values())).lora_a.shape[1] for pieces in adapters]
    routing = AdapterRouting(names, ranks, _compute_dtype(modules[paths[0]]))
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
