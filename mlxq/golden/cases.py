"""The serial-suite cases: prompts x sampling settings every architecture runs."""

from __future__ import annotations

from dataclasses import dataclass, field

SHORT = "Once upon a time there was a small model"
# ~90 tokens: well past the tiny gemma's 16-token sliding window.
LONG = (
    "The server keeps the prefix of every prompt in a cache, so the second agent does not pay "
    "for the first one's prefill. When memory runs low, the oldest entries move from RAM to a "
    "file on disk, and come back when a prompt asks for them. Every decode step reads the "
    "weights once and produces one token for each row in the batch."
)


@dataclass(frozen=True)
class GoldenCase:
    name: str
    prompt: str
    max_tokens: int
    sampling: dict = field(default_factory=dict)  # SamplingParams fields (mlx_lm.server names)
    prefill_step_size: int = 2048


CASES: tuple[GoldenCase, ...] = (
    GoldenCase("greedy-short", SHORT, 24),
    GoldenCase("greedy-long", LONG, 32),
    GoldenCase("greedy-long-chunked", LONG, 24, prefill_step_size=7),
    GoldenCase("seeded-sample", SHORT, 24, {"temperature": 0.9, "top_p": 0.95, "seed": 7}),
    GoldenCase(
        "seeded-processors",
        LONG,
        24,
        {
            "temperature": 0.7,
            "top_k": 40,
            "min_p": 0.02,
            "repetition_penalty": 1.3,
            "presence_penalty": 0.4,
            "frequency_penalty": 0.2,
            "logit_bias": {5: 2.0, 17: -5.0},
            "seed": 3,
        },
    ),
)

ARCHS = ("llama", "qwen3", "gemma3_text", "qwen3_next")


# The batched suite: N prompts of different lengths decoded together (static B=N), greedy.
BATCHED_PROMPTS = (
    SHORT,
    LONG,
    "Every decode step reads the weights once.",
    LONG[:120],
)
BATCHED_MAX_TOKENS = 16
