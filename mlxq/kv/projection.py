"""Worst-case KV bytes of a batch, for byte-budget admission.

Measured, not derived from config fields: one token is prefilled into a
fresh cache list and each layer's bytes are read back (full and rotating
layers: bytes per token; recurrent layers: a fixed state). The batch lane
keeps contiguous padded caches, so a full-attention layer costs every row
the *longest* row's length, rounded up to the cache's 256-token growth step.

Sliding-window layers hold their window once a row decodes, but while a
prompt chunk of n tokens is written a ring holds window - 1 + n tokens (the
chunk must attend to the window before it): a prefilling row pays that
transient on top (``prefill_bytes``).

Rows that read a shared prefix by reference (kv/shared_prefix_cache.py)
hold only their tails in the shared layers: ``grouped_bytes`` counts each
prefix once and the rows' tails padded to the longest tail.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxq.kv.capabilities import CacheKind, layer_kind

GROWTH_STEP = 256  # KVCache / BatchKVCache allocate in 256-token granules


@dataclass(frozen=True)
class LayerFootprint:
    kind: CacheKind
    bytes_per_token: int  # full / rotating layers
    fixed_bytes: int  # recurrent layers: state size per row
    window: int | None  # rotating layers: ring size


@dataclass(frozen=True)
class KvFootprint:
    layers: tuple[LayerFootprint, ...]
    prefill_chunk: int = 2048  # prompt tokens written per prefill step

    def row_bytes(self, num_tokens: int, prompt_tokens: int = 0) -> int:
        """One row alone: ``num_tokens`` (prompt + max_tokens), with its prefill transient."""
        return self.batch_bytes([num_tokens]) + self.prefill_bytes(prompt_tokens)

    def prefill_bytes(self, prompt_tokens: int) -> int:
        """Extra ring bytes while a prompt is prefilled in chunks (sliding-window layers only)."""
        chunk = min(prompt_tokens, self.prefill_chunk)
        return sum(chunk * layer.bytes_per_token for layer in self.layers if layer.kind is CacheKind.ROTATING)

    def batch_bytes(self, row_tokens: list[int]) -> int:
        """Rows padded to the longest, as the batch lane stores them."""
        return self.grouped_bytes(row_tokens, [0] * len(row_tokens), [], ())

    def grouped_bytes(self, row_tokens: list[int], row_shared: list[int], prefixes: list[int],
                      shared_layers: tuple[bool, ...]) -> int:
        """Rows of which ``row_shared[i]`` leading tokens are read by reference from a shared prefix.

        ``prefixes``: each shared prefix's tokens, counted once; ``shared_layers``: per layer,
        whether it holds the prefix by reference (kv/sharing_plan.py; others keep per-row copies)."""
        if not row_tokens:
            return 0
        rows = len(row_tokens)
        padded = _padded(max(row_tokens))
        tails = _padded(max(t - s for t, s in zip(row_tokens, row_shared, strict=True)))
        total = 0
        for index, layer in enumerate(self.layers):
            if layer.kind is CacheKind.FULL and index < len(shared_layers) and shared_layers[index]:
                total += (rows * tails + sum(prefixes)) * layer.bytes_per_token
            elif layer.kind is CacheKind.FULL:
                total += rows * padded * layer.bytes_per_token
            elif layer.kind is CacheKind.ROTATING:
                total += rows * min(padded, layer.window) * layer.bytes_per_token
            else:
                total += rows * layer.fixed_bytes
        return total


def _padded(tokens: int) -> int:
    return -(-tokens // GROWTH_STEP) * GROWTH_STEP


def measure_footprint(model, prefill_chunk: int = 2048, scheme=None, probe: list | None = None) -> KvFootprint:
    """Prefill one token into fresh caches, convert them as ``scheme`` (kv.scheme.KvScheme) would,
    and read each layer's bytes (engine thread only). Quantized layers cost their packed bytes.
    ``probe``: such caches already made (kv.scheme.probe_caches), to skip the forward."""
    from mlxq.kv.scheme import probe_caches

    caches = probe if probe is not None else probe_caches(model)
    if scheme is not None:
        scheme.convert(caches)
    layers = []
    for cache in caches:
        kind = layer_kind(cache)
        if kind is CacheKind.RECURRENT:
            layers.append(LayerFootprint(kind, 0, int(cache.nbytes), None))
        else:
            keys = cache.keys[0] if isinstance(cache.keys, (list, tuple)) else cache.keys
            allocated = keys.shape[2]
            per_token = int(cache.nbytes) // allocated
            window = getattr(cache, "max_size", None) if kind is CacheKind.ROTATING else None
            layers.append(LayerFootprint(kind, per_token, 0, window))
    return KvFootprint(tuple(layers), prefill_chunk)
