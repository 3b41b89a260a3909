"""LoRA adapters under `--tensor-parallel 2` and `--pipeline-parallel 2` (CPU, ring over loopback): each rank
holds its part of every adapter (tensor: split like its layers; pipeline: its own layers), and a batch
mixing the base model and two adapters gives one process's greedy tokens."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlxq.bench.servers import free_port
from mlxq.models.tiny import build_tiny_model
from mlxq.models.tiny_adapter import make_tiny_adapter
from tests.conftest import ServerProcess

PROMPTS = ["The quick brown fox", "Once upon a time in a land", "1 2 3 4 5 6", "Tensor parallel serving is",
           "Adapters split like their layers", "A low-rank partial before the sum"]
MODELS = ["base", "qv", "all"] * 2
SERVE = ("--log-level", "warning", "--warmup", "off", "--prompt-cache", "0", "--served-model-name", "base")


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory) -> tuple[str, list[str]]:
    """The "default" llama (2 KV heads) with a LoRA on every linear layer (outputs- and inputs-sharded ones)
    and one on q_proj / v_proj only (the other layers: the base for its rows)."""
    root = tmp_path_factory.mktemp("tp-lora")
    model = build_tiny_model("llama", root / "llama", preset="default")
    everywhere = make_tiny_adapter(model, root / "all", seed=11, rank=4)
    some = make_tiny_adapter(model, root / "qv", seed=13, rank=8, keys=["self_attn.q_proj", "self_attn.v_proj"])
    return str(model), [f"all={everywhere}", f"qv={some}"]


def _complete(url: str, model: str, prompt: str) -> list[str]:
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 1}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def _mixed_batch(url: str) -> list[list[str]]:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda pair: _complete(url, *pair), zip(MODELS, PROMPTS, strict=True)))


@pytest.mark.slow  # two tensor-parallel ranks with adapters and one process: about 26 s
def test_a_mixed_adapter_batch_on_two_ranks_equals_one_process(model_and_adapters):
    model, adapters = model_and_adapters
    flags = [arg for spec in adapters for arg in ("--adapter", spec)]
    with ServerProcess("--model", model, *flags, *SERVE) as one:
        alone = _mixed_batch(one.url)
        per_model = {name: _complete(one.url, name, PROMPTS[0]) for name in ("base", "qv", "all")}
    assert len({tuple(tokens) for tokens in per_model.values()}) == 3, "each adapter must change the output"
    with ServerProcess("--model", model, *flags, "--tensor-parallel", "2", *SERVE) as two:
        sharded = _mixed_batch(two.url)
        models = [m["id"] for m in httpx.get(f"{two.url}/v1/models", timeout=10).json()["data"]]
    assert sharded == alone
    assert set(models) >= {"base", "qv", "all"}


@pytest.fixture(scope="module")
def pipeline_model_and_adapters(tmp_path_factory) -> tuple[str, list[str]]:
    """qwen3_next (pipeline() only): a LoRA on every linear layer, and a DoRA on two MLP projections of
    every layer (served as "qv", the name the mixed batch asks for)."""
    root = tmp_path_factory.mktemp("pp-lora")
    model = build_tiny_model("qwen3_next", root / "qwen3_next", preset="default")
    everywhere = make_tiny_adapter(model, root / "all", seed=11, rank=4)
    some = make_tiny_adapter(model, root / "qv", seed=13, rank=8, kind="dora", keys=["mlp.gate_proj", "mlp.down_proj"])
    return str(model), [f"all={everywhere}", f"qv={some}"]


@pytest.mark.slow  # two pipeline ranks with adapters: about 14 s
def test_a_mixed_adapter_batch_on_two_pipeline_ranks_equals_one_process(pipeline_model_and_adapters):
    model, adapters = pipeline_model_and_adapters
    flags = [arg for spec in adapters for arg in ("--adapter", spec)]
    with ServerProcess("--model", model, *flags, *SERVE) as one:
        alone = _mixed_batch(one.url)
        per_model = {name: _complete(one.url, name, PROMPTS[0]) for name in ("base", "qv", "all")}
    assert len({tuple(tokens) for tokens in per_model.values()}) == 3, "each adapter must change the output"
    with ServerProcess("--model", model, *flags, "--pipeline-parallel", "2", *SERVE) as two:
        split = _mixed_batch(two.url)
    assert split == alone


def test_an_adapter_on_one_pipeline_rank_only_is_refused_on_every_rank(pipeline_model_and_adapters, tmp_path):
    """Adapting only the last layer (rank 0's): refused at load on both ranks alike, so the server exits
    with the reason instead of one rank waiting for the other."""
    model, _ = pipeline_model_and_adapters
    last = make_tiny_adapter(Path(model), tmp_path / "last", seed=5, rank=4, num_layers=1)
    done = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--model", model, "--port",
                           str(free_port()), "--pipeline-parallel", "2", "--adapter", f"last={last}", *SERVE],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "adapts none of the layers pipeline rank 1 holds (0-1)" in done.stdout + done.stderr
