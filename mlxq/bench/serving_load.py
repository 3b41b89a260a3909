"""`mlxq bench serving-load`: a concurrency sweep against one server, or two side by side."""

from __future__ import annotations

import dataclasses
import datetime
import platform
from dataclasses import dataclass

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mlxq.bench import server_timing
from mlxq.bench.client import LoadConfig, run_load
from mlxq.bench.datasets import make_workload
from mlxq.bench.metrics import summarize


@dataclass(frozen=True)
class Workload:
    dataset: str = "random"  # random | shared-prefix | multi-turn
    num_requests: int = 32
    prompt_len: int = 150  # words
    num_groups: int = 4  # shared-prefix: agent groups
    turns: int = 3  # multi-turn: turns per conversation
    warmup: int = 1  # unrecorded requests before each measurement
    fresh_prompts: bool = True  # a new prompt set for every level and round (else repeats hit prompt caches)
    question_len: int = 16  # words of each request's own text after a shared prefix
    keep_systems: bool = False  # fresh prompts keep the shared system prompts: a new round finds its prefix cached


def _progress(quiet: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[status]}"), disable=quiet, transient=True)


async def measure(cfg: LoadConfig, work: Workload, concurrency: int, label: str, quiet: bool = False,
                  prompt_set: int = 0) -> dict:
    """One measurement: warm up, run the workload, summarize (with per-request records).

    ``prompt_set`` picks the workload's seed offset: both servers of a round get the same set.
    Against an mlxq server the summary also has ``server_timing``: its scheduler's split of
    the measurement (bench/server_timing.py); None for other servers."""
    if work.warmup:
        warm = make_workload("random", work.warmup, 8, seed=cfg.seed + 999)
        await run_load(dataclasses.replace(cfg, request_rate=float("inf")), warm, 1)
    conversations = make_workload(work.dataset, work.num_requests, work.prompt_len, seed=cfg.seed + 7919 * prompt_set,
                                  num_groups=work.num_groups, turns=work.turns, question_len=work.question_len,
                                  system_seed=cfg.seed if work.keep_systems else None)
    total = sum(len(c.turns) for c in conversations)
    before = await server_timing.read_totals(cfg.url, cfg.api_key)
    with _progress(quiet) as progress:
        task = progress.add_task(f"{label} c={concurrency}", total=total, status="")
        failures = 0

        def on_done(record):
            nonlocal failures
            failures += 0 if record.ok else 1
            progress.update(task, advance=1, status=f"failed {failures}" if failures else "")

        records = await run_load(cfg, conversations, concurrency, on_done)
    summary = summarize(records)
    timing = server_timing.split(before, await server_timing.read_totals(cfg.url, cfg.api_key))
    summary.update(label=label, url=cfg.url, concurrency=concurrency, server_timing=timing,
                   records=[r.as_dict() for r in records])
    return summary


async def sweep(cfg: LoadConfig, work: Workload, levels: list[int], compare: LoadConfig | None = None,
                rounds: int = 1, quiet: bool = False, labels: tuple[str, str] = ("a", "b")) -> dict:
    """Every concurrency level; with ``compare``, A and B alternate (A,B then B,A ...) each round."""
    results: dict = {"a": [], "b": []}
    for li, level in enumerate(levels):
        for r in range(rounds):
            prompt_set = li * rounds + r + 1 if work.fresh_prompts else 0
            order = [("a", cfg), ("b", compare)] if compare else [("a", cfg)]
            if compare and r % 2 == 1:
                order.reverse()
            for key, target in order:
                label = labels[0] if key == "a" else labels[1]
                results[key].append(await measure(target, work, level, label, quiet, prompt_set))
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.system()} {platform.machine()} {platform.node()}",
        "config": dataclasses.asdict(cfg) | {"request_rate": str(cfg.request_rate)},
        "compare_config": (dataclasses.asdict(compare) | {"request_rate": str(compare.request_rate)})
        if compare else None,
        "workload": dataclasses.asdict(work),
        "levels": levels,
        "rounds": rounds,
        "a": results["a"],
        "b": results["b"],
        "ratios": ratios(results["a"], results["b"]) if compare else None,
    }


def _median_by_level(runs: list[dict], key) -> dict[int, float]:
    import statistics

    by: dict[int, list[float]] = {}
    for run in runs:
        by.setdefault(run["concurrency"], []).append(key(run))
    return {level: statistics.median(vals) for level, vals in by.items()}


def ratios(a: list[dict], b: list[dict]) -> dict:
    """B relative to A per concurrency level (medians over rounds): >1 means B is higher."""
    out = {}
    metrics = {
        "output_throughput": lambda r: r["output_throughput_tok_s"],
        "ttft_p50": lambda r: r["ttft_ms"]["p50"],
        "ttft_p95": lambda r: r["ttft_ms"]["p95"],
        "itl_p50": lambda r: r["itl_ms"]["p50"],
    }
    for name, key in metrics.items():
        ma, mb = _median_by_level(a, key), _median_by_level(b, key)
        out[name] = {str(level): (mb[level] / ma[level]) if ma[level] else None for level in ma}
    return out
