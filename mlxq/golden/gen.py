"""Generate goldens: mlx-lm's own tokens for every case on every tiny architecture.

- serial: ``stream_generate`` per case (greedy, seeded, processors, chunked prefill).
- batched: ``batch_generate`` (BatchGenerator) on N prompts at once, static B=N; and
  model-free cache-operation goldens from mlx-lm's batch caches (golden/cache_ops.py).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from mlxq.golden.cases import ARCHS, BATCHED_MAX_TOKENS, BATCHED_PROMPTS, CASES
from mlxq.golden.oracle import oracle_batch_tokens, oracle_tokens
from mlxq.golden.store import golden_path, machine_key


def weights_digest(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


def _serial_cases(model, tokenizer) -> dict:
    cases = {}
    for case in CASES:
        prompt_ids = tokenizer.encode(case.prompt)
        cases[case.name] = {
            "case": asdict(case),
            "prompt_ids": prompt_ids,
            "tokens": oracle_tokens(model, tokenizer, prompt_ids, case),
        }
    return cases


def _batched_cases(model, tokenizer) -> dict:
    prompts = [tokenizer.encode(p) for p in BATCHED_PROMPTS]
    rows = oracle_batch_tokens(model, tokenizer, prompts, BATCHED_MAX_TOKENS)
    return {"static-b4": {"prompt_ids": prompts, "max_tokens": BATCHED_MAX_TOKENS, "tokens": rows}}


SUITES = {"serial": ("mlx_lm.stream_generate (the oracle)", _serial_cases),
          "batched": ("mlx_lm.generate.batch_generate: BatchGenerator at B=N (the oracle)", _batched_cases)}


def generate_goldens(suite: str, out_root: Path, *, machine: str | None = None, archs=ARCHS) -> Path:
    import mlx.core as mx
    import mlx_lm

    from mlxq.blas import active
    from mlxq.models.tiny import FACTORY_VERSION, build_tiny_model

    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            model_dir = build_tiny_model(arch, Path(tmp) / arch)
            model, tokenizer = mlx_lm.load(str(model_dir))
            cases = SUITES[suite][1](model, tokenizer)
            models[arch] = {"weights_sha256": weights_digest(model_dir), "cases": cases}
    doc = {
        "suite": suite,
        "generated_by": SUITES[suite][0],
        "meta": {
            "machine": machine_key(),
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "blas": active().name,
            "factory_version": FACTORY_VERSION,
        },
        "models": models,
    }
    if suite == "batched":
        from mlxq.golden.cache_ops import cache_op_goldens

        doc["cache_ops"] = cache_op_goldens()
    path = golden_path(suite, out_root, machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path
