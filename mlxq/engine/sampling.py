"""Samplers and logits processors for a request, built by mlx-lm exactly as mlx_lm.server does.

Building them the same way (same arguments, same order) is what makes a
seeded request here draw the same tokens as mlx_lm.server for the same seed.
"""

from __future__ import annotations

from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlxq.engine.types import SamplingParams


def make_request_sampler(params: SamplingParams, tokenizer):
    return make_sampler(
        params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        xtc_probability=params.xtc_probability,
        xtc_threshold=params.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )


def make_request_processors(params: SamplingParams) -> list:
    return make_logits_processors(
        params.logit_bias,
        params.repetition_penalty,
        params.repetition_context_size,
        params.presence_penalty,
        params.presence_context_size,
        params.frequency_penalty,
        params.frequency_context_size,
    )
