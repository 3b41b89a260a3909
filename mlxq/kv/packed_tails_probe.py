"""Whether a model's tails' forward may run packed: both ways on the model itself, once, at start-up.

Packing (kv/packed_tails.py) leans on what mlx-lm's llama-style modules do:
RoPE from ``cache.offset``, one offset per row, the mask from
``cache.make_mask``, nothing sized from the sequence axis. A model that does
otherwise (positions from ``arange(L)``, a rope scaled by the sequence
length) would compute other positions silently, so ``probe_disagreement``
runs two rows' tails padded and packed on the served model (after
kv/sharing_plan.py's probe, on the attention seam it installed, the
kernels checked: the paths serving takes) and compares their logits at
every real cell. Three forwards of at most six tokens; the same on every
rank of a tensor-parallel model (same inputs, same collectives).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlxq.kv.packed_tails import PackedTailsCache, Packing, packed_positions
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache

PROBE_PREFIX = (1, 2, 3, 4, 5)  # token ids of the probe's prefix (modulo the vocabulary size)
PROBE_TAILS = ((6, 7, 8), (9,))  # two rows' tails of different lengths: padding in the padded grid


def probe_disagreement(model) -> str | None:
    """Why this model's tails' forward must not run packed (None: packed computes what padded does):
    the logits equal up to the rounding of another row count in the GEMMs (1e-4 of the largest logit
    where the K/V are float32, 5e-2 in 16-bit, where a wrong position moves logits by their size)."""
    try:
        vocab = getattr(getattr(model, "args", None), "vocab_size", None) or max(PROBE_PREFIX) + 1
        ids = lambda tokens: [t % vocab for t in tokens]  # noqa: E731 (a vocabulary of under ten tokens)
        solo = make_prompt_cache(model)
        model(mx.array([ids(PROBE_PREFIX)]), cache=solo)
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

        padded = model(mx.array([[0] * p + ids(t) for p, t in zip(padding, PROBE_TAILS, strict=True)]),
                       cache=targets())
        packing = Packing.of(padding, lengths)
        caches = targets()
        positions = packed_positions(caches[0], packing)
        packed = model(mx.array([[x] for t in PROBE_TAILS for x in ids(t)]),
                       cache=[PackedTailsCache(c, packing, positions) for c in caches])
        want, got = padded[packing.rows, packing.columns].astype(mx.float32), packed[:, 0].astype(mx.float32)
        size = max(1.0, mx.abs(want).max().item())
        difference = mx.abs(want - got).max().item()
    except Exception as exc:  # a model whose modules cannot take one position per row
        return f"a packed forward did not run ({type(exc).__name__}: {exc})"
    bound = (1e-4 if prefix[0][0].dtype == mx.float32 else 5e-2) * size
    if not difference <= bound:
        return f"packed logits differ from padded ones by {difference:.3g} (bound {bound:.3g})"
    return None
