"""Run mlx-lm itself — the oracle — on one case."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlxq.golden.cases import GoldenCase


def oracle_tokens(model, tokenizer, prompt_ids: list[int], case: GoldenCase) -> list[int]:
    """Token ids mlx_lm.stream_generate produces (EOS excluded), sampled as mlx_lm.server samples."""
    s = case.sampling
    if s.get("seed") is not None:
        mx.random.seed(s["seed"])
    sampler = make_sampler(
        s.get("temperature", 0.0),
        top_p=s.get("top_p", 1.0),
        top_k=s.get("top_k", 0),
        min_p=s.get("min_p", 0.0),
        xtc_probability=s.get("xtc_probability", 0.0),
        xtc_threshold=s.get("xtc_threshold", 0.1),
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )
    processors = make_logits_processors(
        s.get("logit_bias"),
        s.get("repetition_penalty", 0.0),
        s.get("repetition_context_size", 20),
        s.get("presence_penalty", 0.0),
        s.get("presence_context_size", 20),
        s.get("frequency_penalty", 0.0),
        s.get("frequency_context_size", 20),
    )
    tokens = []
    for response in stream_generate(
        model, tokenizer, mx.array(prompt_ids), max_tokens=case.max_tokens, sampler=sampler,
        logits_processors=processors, prefill_step_size=case.prefill_step_size,
    ):
        if response.finish_reason == "stop" and response.token in tokenizer.eos_token_ids:
            break
        tokens.append(response.token)
    return tokens


def oracle_batch_tokens(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """mlx-lm's BatchGenerator (via batch_generate) on all prompts at once: static B=N, greedy."""
    from mlx_lm.generate import batch_generate

    response = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True,
                              completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    return [list(ids) for ids in response.token_ids]
