"""Samplers and logits processors for a request, built by mlx-lm exactly as mlx_lm.server does.

Building them the same way (same arguments, same order) is what makes a
seeded request here draw the same tokens as mlx_lm.server for the same seed.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
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
        xtc_special_tokens=list(_xtc_special_tokens(tokenizer)),
    )


@lru_cache(maxsize=8)
def _xtc_special_tokens(tokenizer) -> tuple[int, ...]:
    """What mlx_lm.server passes XTC (newline and EOS ids), once per tokenizer: tokenizing on every
    admission cost the engine thread a tokenizer call per request of a burst."""
    return tuple(tokenizer.encode("\n") + list(tokenizer.eos_token_ids))


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


def make_keyed_sampler(params: SamplingParams):
    """mlx-lm's sampler chain, drawing from an explicit PRNG key instead of MLX's global state.

    ``make_sampler`` draws with ``mx.random.categorical`` on the global key
    sequence, whose i-th draw uses ``split(key_i)[1]`` and moves on to
    ``split(key_i)[0]``. Passing those keys explicitly reproduces the draws of
    ``mx.random.seed(seed)`` + serial generation for one row, independent of
    its neighbours in a batch. XTC makes a second, hidden draw, so seeded XTC
    requests stay on the serial lane (see gateway.py).
    """
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    methods = []
    if 0 < params.top_p < 1.0:
        methods.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p != 0.0:
        methods.append(lambda x: apply_min_p(x, params.min_p, 1))
    if params.top_k > 0:
        methods.append(lambda x: apply_top_k(x, params.top_k))
    inverse_temp = 1.0 / params.temperature

    def sample(logprobs, key):
        for method in methods:
            logprobs = method(logprobs)
        return mx.random.categorical(logprobs * inverse_temp, key=key)

    return sample
