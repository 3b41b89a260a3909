"""The layers a node file holds, cut from an entry's caches or from another node file.

A node file holds its span's full-attention rows (kinds ``kv``, ``qkv``) and,
when it carries a snapshot, the ring / recurrent state at its end (else
``absent``). These helpers build the ``(kind, meta, [(name, array)])``
records ``mlxkv.write_steps`` writes.
"""

from __future__ import annotations

import copy

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxq.store.mlxkv import ABSENT, encode_layer

SPAN_CLASSES = (KVCache, QuantizedKVCache)
SPAN_KINDS = ("kv", "qkv")


def head_layers(caches: list, tokens: int, *, snapshot: bool) -> list:
    """The first ``tokens`` rows of each full-attention cache; the other layers whole, or absent."""
    out = []
    for cache in caches:
        if type(cache) in SPAN_CLASSES:
            head = copy.copy(cache)  # shares the arrays; encoding cuts them at the offset
            head.offset = tokens
            out.append(encode_layer(head))
        else:
            out.append(encode_layer(cache) if snapshot and cache is not None else ABSENT)
    return out


def tail_layers(records: list, tensors: list[dict], skip: int) -> list:
    """A read node file's layers without its first ``skip`` rows (snapshot layers as they were)."""
    out = []
    for record, named in zip(records, tensors, strict=True):
        kind, meta = record["kind"], record["meta"]
        if kind in SPAN_KINDS:
            rows = [(t["name"], named[t["name"]][..., skip:, :]) for t in record["tensors"]]
            out.append((kind, dict(meta, offset=meta["offset"] - skip), rows))
        else:
            out.append((kind, meta, [(t["name"], named[t["name"]]) for t in record["tensors"]]))
    return out


def layer_bytes(layers: list) -> int:
    return sum(a.nbytes for _, _, named in layers for _, a in named)
