"""What a stored entry must look like for this model: layer count, cache kinds, dtypes and shapes.

Checksums prove a file is what its writer wrote, not that it belongs to this
model: a file with a layer dropped (checksums recomputed) would restore and
answer wrongly, and a shape that disagrees with its byte count made restores
raise. The expected layout comes from the model's own caches after a
one-token forward, in the KV representation the server stores (the engine's
prototype), encoded exactly as a write would encode them. A header is
checked against it before any tensor is trusted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlxq.store.mlxkv import _DTYPES, MlxkvError, encode_layer

# The sequence axis of each kind's tensors (-2: (batch, heads, tokens, dim)); None: fixed shapes.
_SEQUENCE_AXIS = {"kv": -2, "rotating": -2, "qkv": -2, "rotating-qkv": -2, "arrays": None}
_SNAPSHOT_KINDS = ("rotating", "rotating-qkv", "arrays")
# Meta fields that are properties of the model and scheme, not of the entry.
_FIXED_META = {"rotating": ("max_size", "keep"), "qkv": ("group_size", "bits"),
               "rotating-qkv": ("max_size", "keep", "group_size", "bits"), "arrays": ("size",), "kv": ()}


@dataclass(frozen=True)
class LayerLayout:
    kind: str
    meta: dict  # the fixed meta fields only
    tensors: dict  # name -> (dtype name, shape)


def layout_of(caches: list) -> list[LayerLayout]:
    """The layout of populated caches in the stored representation."""
    out = []
    for cache in caches:
        kind, meta, named = encode_layer(cache)
        fixed = {k: meta[k] for k in _FIXED_META[kind]}
        out.append(LayerLayout(kind, fixed, {name: (_dtype_name(a.dtype), tuple(a.shape)) for name, a in named}))
    return out


def _dtype_name(dtype) -> str:
    return next(name for name, d in _DTYPES.items() if d == dtype)


def check_layout(expected: list[LayerLayout], layers: list, span: int, end: int) -> None:
    """Raise MlxkvError unless a node file's ``layers`` match ``expected``: full-attention layers hold the
    ``span`` tokens of the node, rings and recurrent state (or ``absent``) the state after ``end`` tokens."""
    if len(layers) != len(expected):
        raise MlxkvError(f"{len(layers)} layers; this model has {len(expected)}")
    for i, (want, layer) in enumerate(zip(expected, layers, strict=True)):
        if layer.get("kind") == "absent" and want.kind in _SNAPSHOT_KINDS:
            continue  # a snapshot the span does not carry
        try:
            _check_layer(want, layer, span if want.kind in ("kv", "qkv") else end)
        except (KeyError, TypeError, ValueError) as exc:
            raise MlxkvError(f"layer {i}: {exc}") from None


def _check_layer(want: LayerLayout, layer: dict, tokens: int) -> None:
    kind, meta = layer["kind"], layer["meta"]
    if kind != want.kind:
        raise ValueError(f"kind {kind!r}, expected {want.kind!r}")
    for key, value in want.meta.items():
        if meta.get(key) != value:
            raise ValueError(f"{key}={meta.get(key)!r}, expected {value!r}")
    tensors = {t["name"]: t for t in layer["tensors"]}
    if set(tensors) != set(want.tensors):
        raise ValueError(f"tensors {sorted(tensors)}, expected {sorted(want.tensors)}")
    axis = _SEQUENCE_AXIS[kind]
    for name, (dtype, shape) in want.tensors.items():
        _check_tensor(name, tensors[name], dtype, shape, axis, _sequence_length(kind, meta, tokens))


def _sequence_length(kind: str, meta: dict, tokens: int) -> tuple[int, int]:
    """(least, most) tokens a kind's sequence axis may hold."""
    offset = meta.get("offset")
    if kind in ("kv", "qkv"):
        if offset != tokens:
            raise ValueError(f"offset {offset!r} for an entry of {tokens} tokens")
        return tokens, tokens
    if kind in ("rotating", "rotating-qkv"):
        # After a long prefill a ring holds more than max_size positions (mlx-lm trims it on the next
        # update), but never more than it was fed.
        idx = meta.get("idx")
        if offset != tokens or not isinstance(idx, int) or not 0 <= idx <= tokens:
            raise ValueError(f"offset {offset!r} / idx {idx!r} for an entry of {tokens} tokens")
        return 0, tokens
    return 0, 0


def _check_tensor(name: str, t: dict, dtype: str, shape: tuple, axis: int | None, seq: tuple[int, int]) -> None:
    got = tuple(t["shape"])
    if t["dtype"] != dtype:
        raise ValueError(f"{name} is {t['dtype']}, expected {dtype}")
    if len(got) != len(shape) or not all(isinstance(d, int) and d >= 0 for d in got):
        raise ValueError(f"{name} has shape {got}, expected {len(shape)} dimensions like {shape}")
    for i, (g, w) in enumerate(zip(got, shape, strict=True)):
        if axis is not None and i == len(shape) + axis:
            if not seq[0] <= g <= seq[1]:
                raise ValueError(f"{name} holds {g} positions, expected {seq[0]}-{seq[1]}")
        elif g != w:
            raise ValueError(f"{name} has shape {got}, expected {shape} (but for the sequence axis)")
    if t["nbytes"] != math.prod(got) * _DTYPES[dtype].size:
        raise ValueError(f"{name}: {t['nbytes']} bytes for shape {got}")
