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
- every row on one adapter k: ``addmm(base(x), x @ A_k, B_k)`` (adapter k's
  own A blocks: its columns alone; two more kernels per layer);
- mixed rows: ``addmm(base(x), (x @ A) * mask, B)``: the base matmul once for
  all rows, every adapter's shrink in one narrow matmul, a per-row mask that
  keeps each row's own adapter's columns (none for base rows), one expand.
  For the 1-4 adapters a server carries, R is a few dozen columns: dense
  matmuls are cheaper than a gathered (``gather_mm``) product, which made a
  32-row step 4-5x slower than base-only on the H200 (benchmarks.md, "LoRA
  adapters").
- DoRA rows also take their magnitude ``gain`` (1 for other rows), so DoRA
  batches like LoRA.

Sibling layers that read one input (q/k/v, gate/up) share one shrink matmul
(``SharedShrink``): on a GPU each graph node costs host time whatever its
size, and the adapter step is host-bound. For that, operands are 2-D and no
matmul gets a strided operand (which it would copy first): A is stored twice
(every adapter's columns, and each adapter's alone) and each sibling's B is
zero outside its rows of the group's shrink (members times its size).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from mlxq.models.adapters import LowRank

ROUTING_ATTRIBUTE = "mlxq_adapter_routing"  # set on the model object by install_adapters
RECENT_ROUTES = 16
# Layers the models (mlx-lm's) call on the same input object, one after another.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("in_proj_qkvz", "in_proj_ba"))


@dataclass(frozen=True)
class Route:
    """The adapters of the rows of the next forward, decided once for every layer."""

    slot: int | None = None  # every row on this adapter (None with mask None: every row on the base)
    mask: mx.array | None = None  # mixed rows: [rows, 1, R], 1 on each row's own adapter's columns
    indices: mx.array | None = None  # mixed rows: each row's adapter (len(adapters) for the base), for DoRA
    flat: dict = field(default_factory=dict, compare=False)  # (members, tokens) -> the mask for a flat shrink

    def flat_mask(self, members: int, tokens: int) -> mx.array:
        """The mask of a shrink of ``members`` siblings, ``tokens`` a row: ``[rows * tokens, members * R]``."""
        if (members, tokens) not in self.flat:
            if len(self.flat) >= RECENT_ROUTES:  # prefill chunks of many lengths
                self.flat.clear()
            rows, _, width = self.mask.shape
            tiled = mx.tile(self.mask, (1, tokens, members)) if tokens * members > 1 else self.mask
            self.flat[members, tokens] = tiled.reshape(rows * tokens, members * width)
        return self.flat[members, tokens]


BASE = Route()


class AdapterRouting:
    """Adapter name per row -> Route; the engine sets it around each model call."""

    def __init__(self, names: Sequence[str], ranks: Sequence[int], dtype):
        self.slots = {name: i for i, name in enumerate(names)}
        self.ranks = list(ranks)
        self.offsets = [int(o) for o in np.cumsum([0, *ranks])[:-1]]
        self.dtype = dtype  # the adapted layers' dtype: the mask must not promote their products
        self.route = BASE
        # Recent compositions: decode steps repeat the batch's, joiners' prefills interleave their own,
        # and a route's masks (tiled per sibling group) are built once.
        self._recent: dict[tuple[str, ...], Route] = {}

    def route_for(self, names: Sequence[str]) -> Route:
        key = tuple(names)
        if key in self._recent:
            return self._recent[key]
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
        if len(self._recent) >= RECENT_ROUTES:
            self._recent.pop(next(iter(self._recent)))
        self._recent[key] = route
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


class SharedShrink:
    """The shrink ``x @ A`` of sibling layers that read the same input (q/k/v, gate/up), once per input.

    The siblings' A blocks sit side by side, member by member: ``every`` is ``[input_dims,
    members * R]`` (adapter k's columns of member m at ``m * R + offsets[k]``) and ``each[k]``
    ``[input_dims, members * r_k]`` (adapter k's alone, for a route with every row on k). The first
    sibling called with an input computes every sibling's columns in one matmul (and, for mixed
    rows, masks them once); each sibling's expand then reads the whole product through a B that is
    zero outside its own rows (``_padded``). Slicing its columns out instead would hand the
    expand a strided operand, which MLX's matmul copies first: one more kernel, and one more op
    for the host to build, per layer. A different input object (the attention output reaching
    o_proj) or another route computes afresh. The input is held by a weak reference and its
    flattened view only as long as the input lives (the caller's forward): a cache that kept them
    would keep a prefill chunk's activations of every layer alive through the chunk's evaluation
    (gigabytes on an 8B model)."""

    def __init__(self, a_blocks: Sequence[mx.array], routing: AdapterRouting):
        self.members = len(a_blocks)
        self.every = mx.concatenate(a_blocks).T
        self.each = [mx.concatenate([a[o : o + r] for a in a_blocks]).T
                     for o, r in zip(routing.offsets, routing.ranks, strict=True)]
        mx.eval(self.every, self.each)  # transposed views, evaluated once: not a node in every step's graph
        self._key: tuple = (lambda: None, None)  # (weak reference to the input, route)
        self._rows: mx.array | None = None  # the input flattened: a view, dropped with the input
        self._h: mx.array | None = None  # [rows * tokens, members * columns]: small

    def of(self, x: mx.array, route: Route) -> tuple[mx.array, mx.array]:
        """``x`` as ``[rows * tokens, input_dims]`` and its shrink: 2-D operands keep every
        matmul of the layer a single node (a 3-D one adds a flatten, an unflatten and a broadcast)."""
        if self._rows is None or self._key[0]() is not x or self._key[1] is not route:
            rows = x.reshape(-1, x.shape[-1])
            if route.mask is None:
                h = rows @ self.each[route.slot]
            else:
                h = (rows @ self.every) * route.flat_mask(self.members, x.shape[-2])
            self._key, self._rows, self._h = (weakref.ref(x, self._input_gone), route), rows, h
        return self._rows, self._h

    def _input_gone(self, _reference) -> None:
        self._rows = None


class MultiLoRALinear(nn.Module):
    def __init__(self, base: nn.Module, routing: AdapterRouting, pieces: Sequence[LowRank | None],
                 shrink: SharedShrink, member: int):
        super().__init__()
        self.base = base
        self._routing = routing
        self._shrink = shrink
        out_dims = next(p for p in pieces if p is not None).lora_b.shape[1]
        dtype = routing.dtype
        self._adapted = [p is not None for p in pieces]
        self._dora = [p is not None and p.gain is not None for p in pieces]
        width = sum(routing.ranks)
        self.lora_a_t = shrink.every.T[member * width : (member + 1) * width]  # a view: counted here, stored there
        # The scale goes into B (the last bits differ from mlx-lm's scale-after-product).
        blocks = [(p.scale * p.lora_b if p else mx.zeros((r, out_dims))).astype(dtype)
                  for p, r in zip(pieces, routing.ranks, strict=True)]
        self.lora_b = _padded(mx.concatenate(blocks), member, shrink.members)  # mixed rows: every adapter
        self._b = [_padded(b, member, shrink.members) for b in blocks]  # every row on adapter k
        self.gains = None
        if any(self._dora):
            ones = mx.ones((out_dims,))
            self.gains = mx.stack([p.gain if p is not None and p.gain is not None else ones for p in pieces]
                                  + [ones]).astype(dtype)
        mx.eval(self.lora_b, self._b, self.gains)

    def __call__(self, x: mx.array) -> mx.array:
        route = self._routing.route
        if route.mask is not None:
            return self._mixed(x, route)
        slot = route.slot
        if slot is None or not self._adapted[slot]:
            return self.base(x)
        rows, h = self._shrink.of(x, route)
        if self._dora[slot]:  # DoRALinear.__call__, its magnitude precomputed (models/adapters.py)
            out = self.gains[slot] * mx.addmm(rows @ _dequantized(self.base).T, h, self._b[slot])
            out = out + self.base.bias if "bias" in self.base else out
        else:
            out = mx.addmm(self.base(rows), h, self._b[slot])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _mixed(self, x: mx.array, route: Route) -> mx.array:
        if x.ndim != 3 or x.shape[0] != route.mask.shape[0]:
            raise RuntimeError(f"adapter routing for {route.mask.shape[0]} rows met an input of shape {x.shape}")
        rows, h = self._shrink.of(x, route)
        out = mx.addmm(self.base(rows), h, self.lora_b)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        if self.gains is None:
            return out
        gain = self.gains[route.indices][:, None, :]
        if "bias" not in self.base:
            return gain * out
        return gain * (out - self.base.bias) + self.base.bias


def _padded(b: mx.array, member: int, members: int) -> mx.array:
    """B ``[r, out]`` for the ``member``-th of ``members`` blocks of a shrink: zero rows elsewhere."""
    rank = b.shape[0]
    return mx.pad(b, [(member * rank, (members - member - 1) * rank), (0, 0)])


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
    replaced = []
    for group in _sibling_groups(paths, adapters):
        shrink = SharedShrink([_a_block([pieces.get(path) for pieces in adapters], routing) for path in group],
                              routing)
        for member, path in enumerate(group):
            replaced.append((path, MultiLoRALinear(modules[path], routing, [pieces.get(path) for pieces in adapters],
                                                   shrink, member)))
    model.update_modules(tree_unflatten(replaced))
    mx.eval(model.parameters())
    setattr(model, ROUTING_ATTRIBUTE, routing)
    return routing


def _sibling_groups(paths: list[str], adapters: Sequence[dict[str, LowRank]]) -> list[list[str]]:
    """Adapted layers that read one input: one of ``SIBLINGS`` under one parent module, one input
    width. (o_proj has q_proj's width and parent but reads the attention output: sharing with it
    would compute the group twice.) Any other layer is a group of its own."""
    groups: dict[tuple[str, int, str], list[str]] = {}
    for path in paths:
        piece = next(pieces[path] for pieces in adapters if path in pieces)
        parent, _, leaf = path.rpartition(".")
        kind = next((names[0] for names in SIBLINGS if leaf in names), leaf)
        groups.setdefault((parent, piece.lora_a.shape[0], kind), []).append(path)
    return list(groups.values())


def _a_block(pieces: Sequence[LowRank | None], routing: AdapterRouting) -> mx.array:
    """One layer's A for every adapter, ``[R, input_dims]`` (zeros where an adapter leaves the layer)."""
    in_dims = next(p for p in pieces if p is not None).lora_a.shape[0]
    return mx.concatenate([(p.lora_a.T if p else mx.zeros((r, in_dims))).astype(routing.dtype)
                           for p, r in zip(pieces, routing.ranks, strict=True)])


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
