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
  the padding columns where the tails hold leased tokens), so the caches
  the engine keeps afterwards are exactly the padded forward's;
- ``attend``: the prefix part for the T queries stacked (as in a decode
  step: T x group rows per KV head against the prefix, read once), each
  row's tail attended in the padded layout (tiny next to the prefix: a few
  dozen keys) and gathered back, merged by log-sum-exp in float32.

The padded layout's cells map to tokens by ``Packing``: plain index arrays
built once per forward, host side.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

from mlxq.kv import shared_prefix_decode
from mlxq.kv.shared_prefix_attention import Partial, merge, tail_mask, tail_partial
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache

# MLXQ_PACKED_TAILS=0 keeps the tails' forward padded (an A/B lever).
PACKED_TAILS = os.environ.get("MLXQ_PACKED_TAILS", "1") != "0"


def declined(plan) -> str | None:
    """Why a tails' forward under ``plan`` (kv/sharing_plan.SharingPlan or None) runs padded; None: packed."""
    if not PACKED_TAILS:
        return "MLXQ_PACKED_TAILS=0"
    return "no shared-prefix plan" if plan is None else plan.packed_tails_declined


def packs(plan, lengths: list[int]) -> bool:
    """Whether a tails' forward of rows of ``lengths`` tokens runs packed under ``plan``: the lever and
    the model's probe allow it, and padding would take at least ``MIN_PADDING_SHARE`` of the grid."""
    return declined(plan) is None and padding_share(lengths) >= MIN_PADDING_SHARE


def padding_share(lengths: list[int]) -> float:
    """The share of a left-padded grid of rows of ``lengths`` tokens that is padding."""
    return 1 - sum(lengths) / (len(lengths) * max(lengths))


# Packed forwards run a multiple of this many tokens (``Packing``'s spares). On the H200, rounding a 64-row
# burst's ~3,400 tokens up to a multiple of 64 (a few shapes across bursts instead of a new one each) took
# 216 ms against 218 without (``scripts/packed_tails_forward.py --fresh``): not taken.
SHAPE_MULTIPLE = 1


# Below this padding share the padded forward is kept: packing's own gathers cost more than the padding.
# H200, 8B shape, 16k prefix, 64 rows (docs/benchmarks.md, "H200: packed tails"): packed took 1.05x the
# padded time at no padding, 0.87x at 22%.
MIN_PADDING_SHARE = 0.1


@dataclass(frozen=True)
class Packing:
    """Where each of a forward's T tokens sits in the rows' left-padded grid [B, W], and back.

    T is the rows' own tokens rounded up to a multiple (``SHAPE_MULTIPLE``): the spare tokens repeat
    the last row's last token (its id, its position, its cell for the tail's attention), and no cell
    takes their K/V, so they change nothing. A device that compiles or records work per shape (MLX's
    CUDA graphs) then sees a few shapes across bursts, not a new one per burst."""

    rows: mx.array  # [T] int32: the row of token t
    columns: mx.array  # [T] int32: its column in the padded chunk (its row's chunk padding + its index)
    cells: mx.array  # [B * W] int32: the token in each padded cell (a padding cell: its row's first token)
    ends: mx.array  # [B] int32: each row's last token
    batch: int
    width: int
    flat: mx.array  # [T] int32: each token's cell in the grid flattened (row * W + column)
    spare: int = 0  # tokens after the rows' own (repeats of the last one)

    @classmethod
    def of(cls, chunk_padding: list[int], lengths: list[int], multiple: int = 1) -> Packing:
        """Rows of ``lengths`` tokens left-padded by ``chunk_padding`` to one width (both per row),
        their tokens rounded up to a multiple of ``multiple``."""
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
        spare = -len(rows) % multiple
        rows += [rows[-1]] * spare
        columns += [columns[-1]] * spare
        as_array = lambda x: mx.array(x, mx.int32)  # noqa: E731
        flat = [b * width + c for b, c in zip(rows, columns, strict=True)]
        return cls(as_array(rows), as_array(columns), as_array(cells), as_array(ends), len(lengths), width,
                   as_array(flat), spare)

    def token_ids(self, fed: list[list[int]]) -> mx.array:
        """[T, 1]: the rows' tokens ``fed`` (each row's, in order), then the spares."""
        return mx.array([[token] for row in fed for token in row] + [[fed[-1][-1]]] * self.spare)

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
        prefix = shared_prefix_decode.packed_prefix_partial(queries, target.prefix_keys, target.prefix_values, scale)
        packing = self.packing
        tail = tail_partial(packing.padded(queries), keys, values, scale,
                            tail_mask(target.tail.left_padding, packing.width, keys.shape[2]))
        tail = Partial(*(packing.packed(x) for x in (tail.weighted, tail.peak, tail.total)))
        return merge([prefix, tail], sinks, queries.dtype)


PROBE_PREFIX = (1, 2, 3, 4, 5)  # token ids of the probe's prefix (any model's vocabulary has them)
PROBE_TAILS = ((6, 7, 8), (9,))  # two rows' tails of different lengths: padding in the padded grid


def probe_disagreement(model) -> str | None:
    """Why this model's tails' forward must not run packed (None: packed computes what padded does).

    Packing leans on what mlx-lm's llama-style modules do: RoPE from ``cache.offset`` one per row,
    the mask from ``cache.make_mask``, nothing sized from the sequence axis. A model that does
    otherwise (positions from ``arange(L)``, a rope scaled by the sequence length) would compute
    other positions silently, so once per model a two-row forward runs both ways (after
    kv/sharing_plan.py's probe, on the attention seam it installed) and their logits at every real
    cell are compared: equal up to the rounding of another row count in the GEMMs (1e-4 of the
    largest logit in float32, 5e-2 in 16-bit, where a wrong position moves logits by their size)."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    try:
        solo = make_prompt_cache(model)
        model(mx.array([PROBE_PREFIX]), cache=solo)
        prefix = [(c.keys[..., : len(PROBE_PREFIX), :], c.values[..., : len(PROBE_PREFIX), :]) for c in solo]
        lengths = [len(t) for t in PROBE_TAILS]
        padding = [max(lengths) - n for n in lengths]  # empty tails, right-aligned: as in the chunk

        def targets() -> list[SharedPrefixBatchCache]:
            out = []
            for keys, values in prefix:
                tail = BatchKVCache(padding)
                tail.keys, tail.values = (mx.zeros((len(lengths), a.shape[1], BatchKVCache.step, a.shape[3]), a.dtype)
                                          for a in (keys, values))
                out.append(SharedPrefixBatchCache.grouped([(keys, values)], tail, [0] * len(lengths)))
            return out

        padded = model(mx.array([[0] * p + list(t) for p, t in zip(padding, PROBE_TAILS, strict=True)]),
                       cache=targets())
        packing = Packing.of(padding, lengths)
        caches = targets()
        positions = packed_positions(caches[0], packing)
        packed = model(mx.array([[x] for t in PROBE_TAILS for x in t]),
                       cache=[PackedTailsCache(c, packing, positions) for c in caches])
        want, got = padded[packing.rows, packing.columns].astype(mx.float32), packed[:, 0].astype(mx.float32)
        size = max(1.0, mx.abs(want).max().item())
        difference = mx.abs(want - got).max().item()
    except Exception as exc:  # a model whose modules cannot take one position per row
        return f"a packed forward did not run ({type(exc).__name__}: {exc})"
    bound = (1e-4 if padded.dtype == mx.float32 else 5e-2) * size
    if not difference <= bound:
        return f"packed logits differ from padded ones by {difference:.3g} (bound {bound:.3g})"
    return None
