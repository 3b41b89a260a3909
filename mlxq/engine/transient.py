"""Memory a prefill step needs beyond the KV: activations, logits and attention scores.

A KV budget counts what stays; a prefill step also allocates, for a while,
one layer's activations for every chunk token, the logits of every chunk
token (mlx-lm's models return them all), and, where attention is not fused,
a [heads, chunk, context] score matrix per row in float32. Several joiners
prefilled as one forward multiply it. The budgets leave a transient reserve
(engine/memory.py); admission keeps joiners within it, and a lone joiner
always runs (a long prompt then prefills alone rather than never).
"""

from __future__ import annotations

from dataclasses import dataclass

SCORE_BYTES = 4  # attention scores are computed in float32


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    dtype_bytes: int

    @classmethod
    def of(cls, model) -> ModelShape | None:
        """From an mlx-lm model's args; None when it does not say (then nothing is reserved)."""
        from mlx.utils import tree_flatten

        args = getattr(model, "args", None)
        names = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
        values = [getattr(args, name, None) for name in names]
        if not all(isinstance(v, int) and v > 0 for v in values):
            return None
        params = tree_flatten(model.parameters())
        dtype_bytes = max((v.dtype.size for _, v in params if v.dtype.size <= 4), default=2)
        return cls(*values, dtype_bytes=dtype_bytes)

    def prefill_step_bytes(self, rows: int, chunk: int, context: int) -> int:
        """``rows`` joiners advancing ``chunk`` tokens each (right-padded) over ``context`` tokens."""
        tokens = rows * chunk
        activations = tokens * (4 * self.hidden + 3 * self.intermediate) * self.dtype_bytes
        logits = tokens * self.vocab * self.dtype_bytes
        scores = rows * self.heads * chunk * context * SCORE_BYTES
        return activations + logits + scores


def decode_step_bytes(shape: ModelShape | None, context: int) -> int:
    """Per row of a decode step: logits (and their float32 log-softmax) and one layer's scores."""
    if shape is None:
        return 0
    return shape.vocab * (shape.dtype_bytes + 2 * SCORE_BYTES) + shape.heads * context * SCORE_BYTES


def joiners_transient(shape: ModelShape | None, prompts: list[int], chunk_cap: int, group_cap: int) -> int:
    """The worst prefill step of joiners with these prompt lengths (each step spends ~one chunk cap)."""
    if shape is None or not prompts:
        return 0
    longest = max(prompts)
    chunk = min(chunk_cap, longest)
    rows = min(len(prompts), group_cap, max(1, (2 * chunk_cap) // chunk))
    return shape.prefill_step_bytes(rows, chunk, longest)
