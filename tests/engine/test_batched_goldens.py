"""Static B=N: the batch lane against mlx-lm's BatchGenerator at the same B (goldens and in-process)."""

from __future__ import annotations

import pytest

from mlxq.engine.types import Request, SamplingParams
from mlxq.golden.cases import ARCHS
from mlxq.golden.gen import weights_digest
from mlxq.golden.oracle import oracle_batch_tokens
from mlxq.golden.store import load_goldens
from tests.engine.test_batch_parity import run_schedule


@pytest.fixture(scope="module")
def goldens():
    return load_goldens("batched")[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_static_batch_equals_batch_generator(arch, load_tiny, tiny_model_dirs, goldens):
    model, tokenizer = load_tiny(arch)
    golden = goldens["models"][arch]
    assert weights_digest(tiny_model_dirs[arch]) == golden["weights_sha256"]
    case = golden["cases"]["static-b4"]
    prompts, max_tokens = case["prompt_ids"], case["max_tokens"]
    arrivals = [(0, Request(f"r{i}", p, SamplingParams(), max_tokens)) for i, p in enumerate(prompts)]
    ours, widest = run_schedule(model, tokenizer, arrivals, max_rows=len(prompts), prompt_concurrency=len(prompts))
    assert widest == len(prompts)
    rows = [ours[f"r{i}"] for i in range(len(prompts))]
    assert rows == case["tokens"]
    assert rows == oracle_batch_tokens(model, tokenizer, prompts, max_tokens)
