"""The serial lane against the oracle: committed goldens and mlx-lm in this process."""

from __future__ import annotations

import pytest

from mlxq.engine.serial import run_serial
from mlxq.engine.types import Request, SamplingParams
from mlxq.golden.cases import ARCHS, CASES, GoldenCase
from mlxq.golden.gen import weights_digest
from mlxq.golden.oracle import oracle_tokens
from mlxq.golden.store import load_goldens


def serial_tokens(model, tokenizer, prompt_ids, case: GoldenCase) -> list[int]:
    events = []
    request = Request("t", list(prompt_ids), SamplingParams(**case.sampling), case.max_tokens)
    out = run_serial(model, tokenizer, request, events.append, prefill_step_size=case.prefill_step_size)
    assert events[-1].finish_reason is not None
    return out.tokens


@pytest.fixture(scope="module")
def goldens():
    doc, _ = load_goldens("serial")
    return doc


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_match_the_goldens_model(arch, tiny_model_dirs, goldens):
    # The factory must rebuild the very weights the goldens were made on.
    assert weights_digest(tiny_model_dirs[arch]) == goldens["models"][arch]["weights_sha256"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("arch", ARCHS)
def test_serial_lane_equals_goldens_and_mlx_lm(arch, case, load_tiny, goldens):
    model, tokenizer = load_tiny(arch)
    golden = goldens["models"][arch]["cases"][case.name]
    prompt_ids = tokenizer.encode(case.prompt)
    assert prompt_ids == golden["prompt_ids"]
    ours = serial_tokens(model, tokenizer, prompt_ids, case)
    assert ours == golden["tokens"]
    assert ours == oracle_tokens(model, tokenizer, prompt_ids, case)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_next"])
def test_unseen_model_equals_mlx_lm(arch, tmp_path):
    """A model no golden was made for (other seed, other size): parity must still hold."""
    import mlx_lm

    from mlxq.models.tiny import build_tiny_model

    path = build_tiny_model(arch, tmp_path / arch, seed=4242, preset="default")
    model, tokenizer = mlx_lm.load(str(path))
    for case in (CASES[1], CASES[2], CASES[4]):
        prompt_ids = tokenizer.encode(case.prompt)
        assert serial_tokens(model, tokenizer, prompt_ids, case) == oracle_tokens(
            model, tokenizer, prompt_ids, case
        ), case.name
