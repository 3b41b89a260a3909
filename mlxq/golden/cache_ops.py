"""Model-free cache-operation goldens: what mlx-lm's batch caches do to rows, recorded exactly.

Every key and value is an integer (the token's id; values are its negative),
so the recorded arrays are exact on any machine and readable in the JSON.
One scenario per layer kind, run through a set of operations:

    three solo caches (lengths 5, 12 and 20; the sliding window is 8, so two
    rings have wrapped) -> merge the first two -> extend with the third ->
    10 decode steps in the batch (the rings wrap again inside it) -> keep
    rows 0 and 2 -> extract each row back to a solo cache.

The generator runs mlx-lm's own classes (``KVCache.merge`` -> ``BatchKVCache``,
``RotatingKVCache.merge`` -> ``BatchRotatingKVCache``, ``ArraysCache.merge``);
the tests run the same scenario through ``mlxq.kv.batch_ops`` and compare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

WINDOW = 8
ROWS = ([1 + i for i in range(5)], [100 + i for i in range(12)], [200 + i for i in range(20)])
DECODE_STEPS = 10
KINDS = ("full", "rotating", "recurrent")


@dataclass(frozen=True)
class CacheOps:
    """The four row operations, as the code under test spells them."""

    merge: Callable[[list], object]  # solo caches -> one batched cache
    extend: Callable[[object, object], None]  # batch += other batch, in place
    keep: Callable[[object, list[int]], None]  # drop the other rows, in place
    extract: Callable[[object, int], object]  # one row -> a solo cache (a copy)


MLX_LM_OPS = CacheOps(
    merge=lambda solos: type(solos[0]).merge(solos),
    extend=lambda batch, other: batch.extend(other),
    keep=lambda batch, rows: batch.filter(rows),
    extract=lambda batch, i: batch.extract(i),
)


def _kv(ids: list[int]) -> tuple[mx.array, mx.array]:
    k = mx.array(ids, dtype=mx.float32).reshape(1, 1, -1, 1) * mx.ones((1, 1, 1, 2))
    return k, -k


def make_solo(kind: str, ids: list[int]):
    """A solo cache holding ``ids``: written in chunks of 3 (a prefill), the last 2 one by one (decode)."""
    if kind == "recurrent":
        cache = ArraysCache(2)
        cache[0] = mx.array([[float(ids[-1]), float(len(ids))]])
        cache[1] = mx.array([[float(sum(ids))]])
        return cache
    cache = KVCache() if kind == "full" else RotatingKVCache(WINDOW)
    at = 0
    while at < len(ids):
        n = 3 if at < len(ids) - 2 else 1
        n = min(n, len(ids) - 2 - at) if at < len(ids) - 2 else 1
        cache.update_and_fetch(*_kv(ids[at : at + n]))
        at += n
    return cache


def _ints(a: mx.array | None) -> list | None:
    return None if a is None else [[int(x) for x in row] for row in a.reshape(a.shape[0], -1).tolist()]


def readout(cache) -> dict:
    """Everything a row's next step depends on, as plain ints."""
    if isinstance(cache, ArraysCache):
        return {"state": [_ints(a) for a in cache.cache],
                "left_padding": None if cache.left_padding is None else cache.left_padding.tolist()}
    keys = cache.keys[..., 0] if cache.keys is not None else None  # [B, heads, tokens]
    if keys is not None and not hasattr(cache, "max_size"):  # full attention: the used part, not the slack
        keys = keys[..., : cache._idx] if hasattr(cache, "_idx") else keys[..., : cache.offset]
    out = {"keys": _ints(keys[:, 0, :]) if keys is not None else None,
           "offset": cache.offset if isinstance(cache.offset, int) else cache.offset.tolist()}
    for name in ("left_padding", "_idx", "_offset", "rotated"):
        value = getattr(cache, name, None)
        if value is not None:
            out[name] = value.tolist() if isinstance(value, mx.array) else value
    return out


def run_scenario(kind: str, ops: CacheOps) -> dict:
    solos = [make_solo(kind, ids) for ids in ROWS]
    batch = ops.merge(solos[:2])
    ops.extend(batch, ops.merge(solos[2:]))
    record = {"joined": readout(batch)}
    if kind != "recurrent":  # recurrent state is advanced by the model, not by the cache
        for step in range(DECODE_STEPS):
            ids = [1000 * (row + 1) + step for row in range(len(ROWS))]
            k = mx.array(ids, dtype=mx.float32).reshape(-1, 1, 1, 1) * mx.ones((1, 1, 1, 2))
            batch.update_and_fetch(k, -k)
        record["decoded"] = readout(batch)
    ops.keep(batch, [0, 2])
    record["kept"] = readout(batch)
    record["extracted"] = [readout(ops.extract(batch, i)) for i in range(2)]
    return record


def cache_op_goldens() -> dict:
    """The scenario for every kind, through mlx-lm's classes (the oracle)."""
    return {kind: run_scenario(kind, MLX_LM_OPS) for kind in KINDS}
