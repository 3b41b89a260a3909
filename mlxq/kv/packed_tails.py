"""The tails' forward on a shared prefix with no padding: every token its own row of one position.

A burst's tails differ in length (agents' questions of 30-66 tokens). Left
padded to the longest, as the placed forward runs them
(engine/tail_placement.py), every layer's projections, MLP and prefix
attention also compute the padding cells: on the H200 a cached 64-row burst
on a 16k prefix ran ~20% of its grid as padding, and that forward follows
rows x columns. Packed, the model sees T rows of one position (T the tails'
own tokens), so every GEMM and the prefix attention run on real tokens only.

Nothing of mlx-lm's model files changes. What makes a row of one position
the token it stands for is its cache (``PackedTailsCache``, one per layer,
over the SharedPrefixBatchCache the padded forward would have used):

- ``offset``: the token's own position (mlx-lm applies RoPE with
  ``offset=cache.offset``; ``mx.fast.rope`` takes one offset per row);
- ``make_mask``: None (one position per row; the tails' causal mask is
  applied in ``attend``);
- ``update_and_fetch``: the T tokens' K/V gathered into the rows' padded
  layout [B, Hkv, W, D] and written through the target as the padded
  forward writes them (engine/tail_placement.py's ``tails_in_place`` keeps
  the padding columns where the tails hold leased tokens), so every real
  cell of the caches the engine keeps afterwards, and every column a row
  can read, is the padded forward's (padding columns of tails that start
  empty hold another token's K/V there: masked, never read);
- ``attend``: on CUDA, once its start-up check passed, one kernel
  (kv/packed_tails_kernel.py: the prefix and each token's own tail in one
  online softmax, normalized); elsewhere the prefix part for the T queries
  stacked (as in a decode step: T x group rows per KV head against the
  prefix, read once), each row's tail attended in the padded layout (tiny
  next to the prefix: a few dozen keys) and gathered back, merged by
  log-sum-exp in float32.

The padded layout's cells map to tokens by ``Packing``: plain index arrays
built once per forward, host side. Whether a model packs at all is decided
once, at start-up (kv/packed_tails_probe.py); whether a forward packs, by
its padding (``packs``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from mlxq.kv import packed_tails_kernel, shared_prefix_decode
from mlxq.kv.shared_prefix_attention import Partial, merge, tail_mask, tail_partial
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache

if TYPE_CHECKING:  # kv/sharing_plan.py imports this module (through kv/packed_tails_probe.py)
    from mlxq.kv.sharing_plan import SharingPlan

# MLXQ_PACKED_TAILS=0 keeps the tails' forward padded (an A/B lever).
PACKED_TAILS = os.environ.get("MLXQ_PACKED_TAILS", "1") != "0"


def declined(plan: SharingPlan | None) -> str | None:
    """Why a tails' forward under ``plan`` runs padded whatever its padding (None: it may run packed)."""
    if not PACKED_TAILS:
        return "MLXQ_PACKED_TAILS=0"
    return "no shared-prefix plan" if plan is None else plan.packed_tails_declined


def packs(plan: SharingPlan | None, lengths: list[int]) -> bool:
    """Whether a tails' forward of rows of ``lengths`` tokens runs packed under ``plan``: the lever and
    the model's probe allow it, and padding would take at least ``MIN_PADDING_SHARE`` of the grid."""
    return declined(plan) is None and padding_share(lengths) >= MIN_PADDING_SHARE


def padding_share(lengths: list[int]) -> float:
    """The share of a left-padded grid of rows of ``lengths`` tokens that is padding."""
    return 1 - sum(lengths) / (len(lengths) * max(lengths))


# Below this padding share the padded forward is kept: packing's own moves between the layouts cost more
# than the padding. H200, 8B shape, 16k prefix, 64 rows (docs/benchmarks.md, "H200: packed tails"): with
# the three-part attention the forward packed took 1.05x the padded one's time at no padding, 0.87x at 22%
# (break-even near 6%). With the one-kernel attention (kv/packed_tails_kernel.py) it takes 0.94x at no
# padding, but bursts too small for that kernel (one split of the prefix) keep the three parts.
MIN_PADDING_SHARE = 0.1


@dataclass(frozen=True)
class Packing:
    """Where each of a forward's T tokens sits in the rows' left-padded grid [B, W], and back."""

    rows: mx.array  # [T] int32: the row of token t
    columns: mx.array  # [T] int32: its column in the padded chunk (its row's chunk padding + its index)
    flat: mx.array  # [T] int32: its cell in the grid flattened (row * W + column)
    cells: mx.array  # [B * W] int32: the token in each padded cell (a padding cell: its row's first token)
    ends: mx.array  # [B] int32: each row's last token
    batch: int
    width: int

    @classmethod
    def of(cls, chunk_padding: list[int], lengths: list[int]) -> Packing:
        """Rows of ``lengths`` tokens left-padded by ``chunk_padding`` to one width (both per row)."""
        widths = {p + n for p, n in zip(chunk_padding, lengths, strict=True)}
        if len(widths) != 1 or min(lengths) < 1 or min(chunk_padding) < 0:
            raise ValueError(f"rows of {lengths} tokens padded by {chunk_padding} do not end at one width")
        width = widths.pop()
        rows, columns, cells, ends = [], [], [], []
        for b, (pad, n) in enumerate(zip(chunk_padding, lengths, strict=True)):
            first = len(rows)
            rows += [b] * n
            columns += range(pad, pad + n)
            cells += [first] * pad + list(range(first, first + n))
            ends.append(first + n - 1)
        flat = [b * width + c for b, c in zip(rows, columns, strict=True)]
        return cls(*(mx.array(x, mx.int32) for x in (rows, columns, flat, cells, ends)), len(lengths), width)

    @property
    def tokens(self) -> int:
        return self.rows.shape[0]

    # Both moves are one ``take`` of whole rows of a 2-D array (H x n values each): on the H200 the
    # packed attention of 64 rows of 56 tokens on a 16k prefix cost 0.36 ms a layer more than the
    # padded one's so, 0.61 with MLX's gather by two index arrays around a slice (``x[rows, :,
    # columns, :]``).

    def padded(self, x: mx.array) -> mx.array:
        """[T, H, 1, n] -> [B, H, W, n] (a padding cell holds its row's first token: never read)."""
        tokens, heads, _, n = x.shape
        gathered = mx.take(x.reshape(tokens, heads * n), self.cells, axis=0)  # [B * W, H * n]
        return gathered.reshape(self.batch, self.width, heads, n).swapaxes(1, 2)

    def packed(self, x: mx.array) -> mx.array:
        """[B, H, W, n] -> [T, H, 1, n]: the real cells only."""
        batch, heads, width, n = x.shape
        cells = x.swapaxes(1, 2).reshape(batch * width, heads * n)
        return mx.take(cells, self.flat, axis=0).reshape(-1, heads, 1, n)


def packed_positions(target: SharedPrefixBatchCache, packing: Packing) -> mx.array:
    """[T] each token's RoPE position: its row's offset before the forward plus its column, what the
    padded forward gives the cell (a row's offset counts its left padding out)."""
    return target.offset[packing.rows] + packing.columns


class PackedTailsCache:
    """One layer's cache for a packed tails' forward, writing into ``target`` (see the module doc).
    ``positions``: ``packed_positions`` of the first layer's target (all layers' rows are laid out alike)."""

    def __init__(self, target: SharedPrefixBatchCache, packing: Packing, positions: mx.array):
        if len(target.prefixes) != 1 or target.quant is not None or not all(target.row_shares):
            raise ValueError("packed tails take one group of plain rows that all share its prefix")
        self.target = target
        self.packing = packing
        self.offset = positions

    def make_mask(self, N: int, **kwargs) -> None:
        return None  # each row one position; the tails' causality is ``attend``'s

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys, values [T, Hkv, 1, D] -> the target's tail [B, Hkv, S, D] with them written."""
        return self.target.update_and_fetch(self.packing.padded(keys), self.packing.padded(values))

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
               sinks: mx.array | None = None) -> mx.array:
        """queries [T, Hq, 1, D]; ``keys``/``values`` the tail ``update_and_fetch`` returned."""
        target = self.target
        if not target.fetched(keys):
            raise ValueError("packed tails' attention needs the keys update_and_fetch returned, unchanged")
        packing = self.packing
        if shared_prefix_decode.packed_kernel_on() and packed_tails_kernel.fits(queries, target.prefix_keys, keys,
                                                                              sinks):
            positions = packing.columns + (keys.shape[2] - packing.width)  # each token's column in the tail
            return packed_tails_kernel.packed_attention(queries, target.prefix_keys, target.prefix_values, keys,
                                                        values, packing.rows, positions, target.tail.left_padding,
                                                        scale)
        prefix = shared_prefix_decode.packed_prefix_partial(queries, target.prefix_keys, target.prefix_values, scale)
        tail = tail_partial(packing.padded(queries), keys, values, scale,
                            tail_mask(target.tail.left_padding, packing.width, keys.shape[2]))
        tail = Partial(*(packing.packed(x) for x in (tail.weighted, tail.peak, tail.total)))
        return merge([prefix, tail], sinks, queries.dtype)

