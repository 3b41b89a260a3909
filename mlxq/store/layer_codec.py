"""How each cache kind becomes named tensors in a ``.mlxkv`` file, and back (docs/mlxkv-format.md).

One entry per kind; a class without an entry fails closed (``MlxkvError``
naming it), never a guess.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxq.kv.quantized import QuantizedRotatingKVCache


class MlxkvError(ValueError):
    """The file is not a usable ``.mlxkv`` entry (bad magic, version, checksum, kind...)."""


# --- cache kinds --------------------------------------------------------------------
def encode_layer(cache) -> tuple[str, dict, list[tuple[str, mx.array]]]:
    """(kind, meta, named tensors) of one stored cache."""
    if type(cache) is KVCache:
        n = cache.offset
        return "kv", {"offset": n}, [("keys", cache.keys[..., :n, :]), ("values", cache.values[..., :n, :])]
    if type(cache) is RotatingKVCache:
        meta = {"offset": cache.offset, "idx": cache._idx, "max_size": cache.max_size, "keep": cache.keep}
        return "rotating", meta, [("keys", cache.keys), ("values", cache.values)]
    if type(cache) is ArraysCache:
        slots = [i for i, a in enumerate(cache.cache) if a is not None]
        return "arrays", {"size": len(cache.cache)}, [(str(i), cache.cache[i]) for i in slots]
    if type(cache) is QuantizedKVCache:
        n = cache.offset
        meta = {"offset": n, "group_size": cache.group_size, "bits": cache.bits}
        return "qkv", meta, _triples(cache, lambda x: x[..., :n, :])
    if type(cache) is QuantizedRotatingKVCache:
        meta = {"offset": cache.offset, "idx": cache._idx, "max_size": cache.max_size, "keep": cache.keep,
                "group_size": cache.group_size, "bits": cache.bits}
        return "rotating-qkv", meta, _triples(cache, lambda x: x)
    raise MlxkvError(f"no .mlxkv encoding for cache class {type(cache).__name__}")


_TRIPLE = ("data", "scales", "biases")


def _triples(cache, cut) -> list[tuple[str, mx.array]]:
    """A quantized cache's six arrays: keys.data, keys.scales, keys.biases, then values.*."""
    return [(f"{side}.{part}", cut(getattr(cache, side)[i]))
            for side in ("keys", "values") for i, part in enumerate(_TRIPLE)]


def _triple(tensors: dict[str, mx.array], side: str) -> tuple:
    return tuple(tensors[f"{side}.{part}"] for part in _TRIPLE)


KINDS = ("kv", "rotating", "arrays", "qkv", "rotating-qkv", "absent")
ABSENT = ("absent", {}, [])  # a snapshot layer whose state a span does not carry


def decode_layer(kind: str, meta: dict, tensors: dict[str, mx.array]):
    if kind == "absent":
        return None
    if kind == "kv":
        cache = KVCache()
        cache.state = (tensors["keys"], tensors["values"], meta["offset"])
        return cache
    if kind == "rotating":
        cache = RotatingKVCache(meta["max_size"], meta["keep"])
        cache.keys, cache.values = tensors["keys"], tensors["values"]
        cache.offset, cache._idx = meta["offset"], meta["idx"]
        return cache
    if kind == "arrays":
        cache = ArraysCache(meta["size"])
        for name, array in tensors.items():
            cache.cache[int(name)] = array
        return cache
    if kind == "qkv":
        cache = QuantizedKVCache(meta["group_size"], meta["bits"])
        cache.keys, cache.values, cache.offset = _triple(tensors, "keys"), _triple(tensors, "values"), meta["offset"]
        return cache
    if kind == "rotating-qkv":
        cache = QuantizedRotatingKVCache(meta["max_size"], meta["keep"], meta["group_size"], meta["bits"])
        cache.keys, cache.values = _triple(tensors, "keys"), _triple(tensors, "values")
        cache.offset, cache._idx = meta["offset"], meta["idx"]
        return cache
    raise MlxkvError(f"unknown cache kind {kind!r}")
