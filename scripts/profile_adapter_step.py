"""One decode step with LoRA adapters, in process: base-only vs one adapter vs mixed rows.

Loads the model, attaches ``--adapters`` random rank ``--rank`` adapters on every
linear layer (models/tiny_adapter.py, models/multi_lora.py), prefills ``--rows``
rows of ``--context`` tokens, then times ``--steps`` one-token forwards (trimmed
back, so every step sees the same context) per routing, interleaved, and prints
per routing the median and the best wall time and the median process CPU time of
a step, each with its ratio to base-only (on a busy shared host the best step is
the least disturbed; CPU time counts BLAS threads spinning too), and the median
time Python takes to build a step's graph (the host's share of a step on a GPU,
where building the next step overlaps the device's work on this one):

- base:       every row on the base model (the base layers alone)
- one:        every row on adapter 0
- mixed:      row i on adapter i mod N
- mixed+base: row i on the base or one of the adapters, in turn

(With adapters, one or mixed, a step gathers each row's shrink and the
expand rides in the base matmul: models/lora_shrink.py, lora_linear.py.)

    python scripts/profile_adapter_step.py [--model PATH] [--rows 8,32] [--adapters 2] [--rank 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from mlxq.models.adapters import AdapterSpec
from mlxq.models.default import ensure_default_model
from mlxq.models.loader import load_model
from mlxq.models.multi_lora import adapter_rows, attach_adapters
from mlxq.models.tiny_adapter import make_tiny_adapter


def routings(rows: int, names: list[str]) -> dict[str, list[str]]:
    everyone = ["", *names]
    return {"base": [""] * rows, "one": [names[0]] * rows, "mixed": [names[i % len(names)] for i in range(rows)],
            "mixed+base": [everyone[i % len(everyone)] for i in range(rows)]}


def time_steps(model, rows: int, names: list[str], context: int, steps: int) -> dict[str, list[tuple]]:
    import mlx.core as mx  # after mlxq: its fast BLAS loads before mlx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    mx.eval(model(mx.ones((rows, context), dtype=mx.uint32), cache=caches))
    token = mx.ones((rows, 1), dtype=mx.uint32)
    plan = routings(rows, names)
    times: dict[str, list[tuple]] = {name: [] for name in plan}
    for step in range(steps + 2):
        for name, row_names in plan.items():
            start, cpu = time.perf_counter(), time.process_time()
            with adapter_rows(model, row_names):
                logits = model(token, cache=caches)
            built = time.perf_counter()
            mx.eval(logits)
            for cache in caches:
                cache.trim(1)
            if step >= 2:  # the first two compile and allocate
                times[name].append((time.perf_counter() - start, time.process_time() - cpu, built - start))
    return times


def summary(samples: list[tuple]) -> tuple[float, float, float, float]:
    """(median wall, best wall, median CPU, median graph build) seconds of a step."""
    return (statistics.median(t[0] for t in samples), min(t[0] for t in samples),
            statistics.median(t[1] for t in samples), statistics.median(t[2] for t in samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", default="8", help="comma-separated batch sizes")
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else ensure_default_model()
    work = Path(tempfile.mkdtemp(prefix="mlxq-adapters-"))
    specs = [AdapterSpec(f"a{i}", make_tiny_adapter(model_dir, work / f"a{i}", seed=i, rank=args.rank))
             for i in range(args.adapters)]
    loaded = attach_adapters(load_model(str(model_dir)), specs)
    names = [spec.name for spec in specs]
    print(f"| rows | routing ({args.adapters} adapters, rank {args.rank}, context {args.context}) "
          "| step ms (median) | vs base | best step ms | vs base | CPU ms per step (median) | vs base "
          "| graph build ms (median) |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        times = time_steps(loaded.model, rows, names, args.context, args.steps)
        base = summary(times["base"])
        for name, samples in times.items():
            wall, best, cpu, build = summary(samples)
            print(f"| {rows} | {name} | {1e3 * wall:.2f} | {base[0] / wall:.2f}x | {1e3 * best:.2f} | "
                  f"{base[1] / best:.2f}x | {1e3 * cpu:.2f} | {base[2] / cpu:.2f}x | {1e3 * build:.2f} |", flush=True)


if __name__ == "__main__":
    main()
