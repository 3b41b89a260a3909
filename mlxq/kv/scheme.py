"""KV schemes: how each layer's KV is represented, resolved once at start-up.

``--kv-quant off|8|4|config`` (``--kv-group-size``, default 64). ``config``
reads ``kv_config.json`` beside the model: ``{"bits": [8, 4, null, ...]}``,
one entry per layer, ``null`` keeping that layer in full precision (an
optional ``"group_size"`` overrides the flag).

The scheme owns:

- **conversion**, at mlx-lm's point: after the first model call that
  populates a cache (the first prefill chunk), before it is evaluated, and
  never again. The serial lane hands mlx-lm's own hook (``generate_step``'s
  ``kv_bits`` with ``quantized_kv_start=0``) a per-layer ``to_quantized`` on
  each cache (``arm``), so full-attention layers under a uniform scheme
  convert exactly as mlx-lm converts them; the batch lane calls ``convert``
  at the same place in its own prefill. Sliding-window layers become
  ``QuantizedRotatingKVCache`` (mlx-lm cannot quantize them); recurrent
  state has no KV and is never touched.
- **its key**, folded into the SSD tier's identity: a file written under one
  scheme is never restored under another.
- **validation**: a group size that does not divide a layer's head_dim fails
  at start-up, naming the layer and the fix.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from mlxq.kv.capabilities import quantized, quantized_class
from mlxq.kv.quantized import use_contiguous_views

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
KV_CONFIG_FILE = "kv_config.json"


class KvSchemeError(ValueError):
    """A scheme that cannot work for this model (raised at start-up, never mid-request)."""


@dataclass(frozen=True)
class KvScheme:
    name: str  # "off", "8", "4", "config"
    group_size: int = 64
    layer_bits: tuple[int | None, ...] | None = None  # per layer; None everywhere = native; set by resolve

    @property
    def quantized(self) -> bool:
        return self.layer_bits is not None and any(b is not None for b in self.layer_bits)

    @property
    def key(self) -> str:
        """A short, stable id of the representation (part of the SSD identity)."""
        if not self.quantized:
            return "native"
        if self.name == "config":
            digest = hashlib.sha256(json.dumps([self.group_size, list(self.layer_bits)]).encode()).hexdigest()
            return f"config-{digest[:12]}"
        return f"kv{self.name}g{self.group_size}"

    @property
    def hook_bits(self) -> int | None:
        """What to pass mlx-lm as ``kv_bits`` so its hook calls each cache's ``to_quantized``."""
        return max((b for b in self.layer_bits if b is not None), default=None) if self.quantized else None

    def bits_for(self, layer: int) -> int | None:
        return None if self.layer_bits is None else self.layer_bits[layer]

    # --- conversion -----------------------------------------------------------------
    def _quantize(self, layer: int, cache):
        bits = self.bits_for(layer)
        if bits is None:
            return cache
        return quantized(cache, self.group_size, bits)

    def convert(self, caches: list) -> None:
        """Quantize, in place, every populated cache of a layer the scheme quantizes."""
        if not self.quantized:
            return
        for i, cache in enumerate(caches):
            if quantized_class(cache) is not None and cache.offset > 0:
                caches[i] = self._quantize(i, cache)

    def arm(self, caches: list) -> None:
        """Give every cache mlx-lm's hook may convert a ``to_quantized`` that follows this scheme.

        An instance attribute, so the cache keeps its class (the capability
        registry and the prompt cache see an ordinary KVCache / RotatingKVCache).
        """
        if not self.quantized:
            return
        for i, cache in enumerate(caches):
            if quantized_class(cache) is not None:
                cache.to_quantized = lambda group_size=None, bits=None, i=i, cache=cache: self._quantize(i, cache)


NATIVE = KvScheme("off")  # the model's own dtype, no conversion


def resolve_scheme(kv_quant: str, group_size: int, model_dir: Path, caches: list, head_dims: list[int]) -> KvScheme:
    """The scheme for this model: per-layer bits, validated against its caches and head dims."""
    num_layers = len(caches)
    if kv_quant == "off":
        return KvScheme("off", group_size, None)
    if kv_quant == "config":
        path = model_dir / KV_CONFIG_FILE
        if not path.exists():
            raise KvSchemeError(f"--kv-quant config needs {path}: {{\"bits\": [8, 4, null, ...]}}, one entry per "
                                f"layer ({num_layers} layers), null = full precision")
        try:
            doc = json.loads(path.read_text())
            bits = list(doc["bits"])
            group_size = int(doc.get("group_size", group_size))
        except (ValueError, KeyError, TypeError) as exc:
            raise KvSchemeError(f"{path} is not a KV config ({exc}); expected {{\"bits\": [...]}}") from None
        if len(bits) != num_layers:
            raise KvSchemeError(f"{path} lists {len(bits)} layers; the model has {num_layers}")
    elif kv_quant.isdigit():
        bits = [int(kv_quant)] * num_layers
    else:
        raise KvSchemeError(f"--kv-quant must be off, one of {SUPPORTED_BITS} or config; got {kv_quant!r}")
    for layer, (b, cache) in enumerate(zip(bits, caches, strict=True)):
        if quantized_class(cache) is None:
            bits[layer] = None  # recurrent state (or another kind): no KV to quantize
            continue
        if b is None:
            continue
        if b not in SUPPORTED_BITS:
            raise KvSchemeError(f"layer {layer}: {b}-bit KV is not supported; use one of {SUPPORTED_BITS}")
        if group_size not in (32, 64, 128):
            raise KvSchemeError(f"--kv-group-size must be 32, 64 or 128; got {group_size}")
        if head_dims[layer] % group_size:
            divisors = [g for g in (32, 64, 128) if head_dims[layer] % g == 0]
            raise KvSchemeError(f"layer {layer}: --kv-group-size {group_size} does not divide its head_dim "
                                f"{head_dims[layer]}; use --kv-group-size {divisors[-1] if divisors else 32}"
                                + ("" if divisors else " or --kv-quant off"))
    scheme = KvScheme(kv_quant, group_size, tuple(bits))
    if scheme.quantized:
        use_contiguous_views()  # CUDA: quantized attention needs contiguous operands
    return scheme


def probe_caches(model) -> list:
    """Fresh caches after a one-token forward: populated, so each layer's kind and head_dim are real."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def head_dims(caches: list) -> list[int]:
    """Per layer, the KV head_dim (keys and values must both divide; 0 for layers without KV)."""
    out = []
    for cache in caches:
        keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
        if keys is None or isinstance(keys, (list, tuple)):
            out.append(0)
        else:
            out.append(math.gcd(keys.shape[-1], values.shape[-1]))
    return out
