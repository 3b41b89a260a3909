"""Run in a fresh interpreter with MLXQ_BLAS=bundled (a batch-invariant BLAS): every
batched row's logits must equal its solo run's bit for bit, so seeded sampling
agrees too. Prints one JSON line: {arch: {"mismatched_rows": [...], "max_logit_diff": x}}.
"""

from __future__ import annotations

import json
import random
import sys

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

import mlxq  # noqa: F401  (BLAS choice happens here, from MLXQ_BLAS)
from mlxq.engine import scheduler as sched
from mlxq.engine.types import Request, SamplingParams
from tests.engine.test_batch_parity import run_schedule, solo_tokens


def requests(tokenizer, n: int) -> list[Request]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, 500) for _ in range(rng.randint(8, 40))]
        params = [SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i), SamplingParams(),
                  SamplingParams(temperature=0.7, top_k=30, repetition_penalty=1.3, seed=i)][i % 3]
        out.append(Request(f"r{i}", prompt, params, 24))
    return out


def solo_logits(model, request: Request, tokens: list[int]) -> list[mx.array]:
    cache = make_prompt_cache(model)
    p = request.prompt_ids
    model(mx.array(p[:-1])[None], cache=cache)
    first = model(mx.array(p[-1:])[None], cache=cache)[0, -1]  # token 0's logits
    return [first] + [model(mx.array([[t]]), cache=cache)[0, -1] for t in tokens]


def main(model_dirs: list[str]) -> None:
    report = {}
    for path in model_dirs:
        model, tokenizer = mlx_lm.load(path)
        recorded: dict[str, list] = {}
        original = sched.BatchScheduler._sample

        def spy(self, logits, inputs, original=original, recorded=recorded):
            for i, row in enumerate(self.batch.rows):
                recorded.setdefault(row.request.request_id, []).append(logits[i])
            return original(self, logits, inputs)

        sched.BatchScheduler._sample = spy
        mismatched, max_diff = [], 0.0
        for trial in range(4):
            rng = random.Random(trial)
            reqs = requests(tokenizer, 12)
            recorded.clear()
            arrivals = [(rng.randint(0, 30), r) for r in reqs]
            in_decode = trial % 2 == 0  # both places token 0 can come from
            got, _ = run_schedule(model, tokenizer, arrivals, max_rows=8, prompt_concurrency=rng.choice([1, 3]),
                                  token0_in_decode=in_decode)
            for r in reqs:
                solo = solo_tokens(model, tokenizer, r, 2048)
                if solo != got[r.request_id]:
                    mismatched.append(f"trial{trial}:{r.request_id}")
                    continue
                fed = solo[:-1]  # after token 0 (the last prompt token's step), the tokens each step fed
                want = solo_logits(model, r, fed)
                if not in_decode:
                    want = want[1:]  # token 0 came from the joiners' own forward, not a decode step
                for a, b in zip(recorded.get(r.request_id, []), want, strict=False):
                    max_diff = max(max_diff, mx.abs(a - b).max().item())
        sched.BatchScheduler._sample = original
        report[path.rsplit("/", 1)[-1]] = {"mismatched_rows": mismatched, "max_logit_diff": max_diff}
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
