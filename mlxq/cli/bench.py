"""`mlxq bench ...`: load benchmarks over HTTP."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="Benchmarks over live SSE.")


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter("--concurrency takes integers, e.g. 1,4,8") from None
    if not levels or min(levels) < 1:
        raise typer.BadParameter("--concurrency levels must be >= 1")
    return levels


def _short(url: str) -> str:
    """A URL's host:port, the default name of a server in tables and plots."""
    return url.split("://", 1)[-1].rstrip("/")


def _require_reachable(url: str) -> None:
    """Fail at once on a server nobody answers at, instead of after a whole level of failed requests."""
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10)
    except httpx.HTTPError as exc:
        typer.echo(f"error: cannot reach {url}: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command("serving-load")
def serving_load(
    url: Annotated[str, typer.Option(help="Server base URL.")] = "http://127.0.0.1:8080",
    model: Annotated[str, typer.Option(help="Model name sent in requests.")] = "default_model",
    endpoint: Annotated[str, typer.Option(help="chat or completions.")] = "chat",
    concurrency: Annotated[str, typer.Option(help="Concurrency levels, comma-separated (a sweep).")] = "1",
    num_requests: Annotated[int, typer.Option(help="Requests per level.")] = 32,
    request_rate: Annotated[float, typer.Option(help="Requests/s (Poisson or gamma); inf = all at once.")]
    = math.inf,
    burstiness: Annotated[float, typer.Option(help="Gamma shape of inter-arrivals; 1 = Poisson.")] = 1.0,
    dataset: Annotated[str, typer.Option(help="random, shared-prefix, multi-turn or agents "
                                                     "(shared system prompt + multi-turn).")] = "random",
    prompt_len: Annotated[int, typer.Option(help="Prompt length in words (shared prefix length).")] = 150,
    max_tokens: Annotated[int, typer.Option(help="max_tokens per request.")] = 64,
    num_groups: Annotated[int, typer.Option(help="shared-prefix: agent groups.")] = 4,
    turns: Annotated[int, typer.Option(help="multi-turn, agents: turns per conversation.")] = 3,
    question_len: Annotated[int, typer.Option(help="shared-prefix, multi-turn, agents: words of each "
                                                   "request's own text (its turn after the shared part).")] = 16,
    ignore_eos: Annotated[bool, typer.Option(help="Ask for exactly max_tokens tokens.")] = False,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    warmup: Annotated[int, typer.Option(help="Unrecorded warm-up requests per measurement.")] = 1,
    rounds: Annotated[int, typer.Option(help="Repeats per level (alternating with --compare).")] = 1,
    fresh_prompts: Annotated[bool, typer.Option("--fresh-prompts/--repeat-prompts",
                                                help="A new prompt set for every level and round (both servers "
                                                     "of a round get the same one), or the same set every time "
                                                     "(a prompt-cache workload: repeats hit after the first).")]
    = True,
    keep_systems: Annotated[bool, typer.Option(help="With fresh prompts: shared-prefix and agents keep their "
                                                    "system prompts every round and change only their own text "
                                                    "(after the first round the shared prefix is cached).")]
    = False,
    compare: Annotated[str | None, typer.Option(help="Second server URL: run both, alternating.")] = None,
    compare_model: Annotated[str | None, typer.Option(help="Model name for --compare.")] = None,
    label: Annotated[str | None, typer.Option(help="Name of the first server in tables and plots.")] = None,
    compare_label: Annotated[str | None, typer.Option(help="Name of the --compare server.")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="MLXQ_API_KEY", help="Bearer key.")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the summaries (JSON) here.")] = None,
    records: Annotated[Path | None, typer.Option(help="Write per-request records here (gzipped JSON lines, "
                                                      "e.g. run.jsonl.gz); --json holds summaries only.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG: TTFT and tok/s vs concurrency.")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Load-test an OpenAI-compatible server (mlxq, mlx_lm.server, ...) with vLLM's metric definitions."""
    from mlxq.bench.client import LoadConfig
    from mlxq.bench.records import without_records, write_records
    from mlxq.bench.report import plot_sweep, print_sweep
    from mlxq.bench.serving_load import Workload, sweep

    try:
        cfg = LoadConfig(url=url, model=model, endpoint=endpoint, max_tokens=max_tokens, ignore_eos=ignore_eos,
                         request_rate=request_rate, burstiness=burstiness, seed=seed, api_key=api_key)
        other = None if compare is None else LoadConfig(**{**cfg.__dict__, "url": compare,
                                                            "model": compare_model or model})
        work = Workload(dataset, num_requests, prompt_len, num_groups, turns, warmup, fresh_prompts, question_len,
                        keep_systems)
        if dataset not in ("random", "shared-prefix", "multi-turn", "agents"):
            raise ValueError(f"unknown dataset {dataset!r}; choose random, shared-prefix, multi-turn or agents")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    for target in (url, compare):
        if target is not None:
            _require_reachable(target)
    result = asyncio.run(sweep(cfg, work, _levels(concurrency), other, rounds, quiet,
                               labels=(label or _short(url), compare_label or _short(compare or ""))))
    print_sweep(result)
    if json_path:
        json_path.write_text(json.dumps(without_records(result), indent=1))
    if records:
        write_records(result, records)
    if plot:
        plot_sweep(result, str(plot))
    if any(r["failed"] for r in result["a"] + result["b"]):
        raise typer.Exit(1)


matrix_app = typer.Typer(no_args_is_help=True, help="Composition matrices over live SSE.")
app.add_typer(matrix_app, name="matrix")


@matrix_app.command("features")
def matrix_features(
    model: Annotated[str | None, typer.Option(help="Model for both servers (default: the embedded one).")] = None,
    concurrency: Annotated[int, typer.Option(help="Concurrent requests per cell.")] = 8,
    requests: Annotated[int, typer.Option(help="Requests per cell.")] = 16,
    max_tokens: Annotated[int, typer.Option(help="max_tokens per request.")] = 32,
    serve_arg: Annotated[list[str] | None, typer.Option(help="Extra `mlxq serve` flag for the server under "
                                                            "test (repeatable), e.g. --serve-arg=--batch=16.")]
    = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the cells.")] = None,
) -> None:
    """Six cells (greedy, shared prefix, stop+seed, quantized KV, logprobs, mixed) with conformance gates."""
    from rich.console import Console

    from mlxq.bench.matrix import make_cells, run_cell
    from mlxq.bench.report import matrix_table, plot_matrix
    from mlxq.bench.servers import ServeProcess

    console = Console()
    model_args = ["--model", model] if model else []
    cells = make_cells(requests, max_tokens)
    results: dict[str, dict] = {}
    # Cells that need other server flags (e.g. --kv-quant) get a pair of servers of their own.
    for flags in dict.fromkeys(cell.serve_args for cell in cells):
        with ServeProcess(*model_args, "--batch", str(max(concurrency, 2)), *flags, *(serve_arg or [])) as server, \
                ServeProcess(*model_args, "--batch", "1", *flags) as reference:
            for cell in cells:
                if cell.serve_args == flags:
                    results[cell.name] = run_cell(cell, server.url, reference.url, concurrency,
                                                  on_progress=lambda name: console.print(f"cell {name} ..."))
    results = [results[cell.name] for cell in cells]
    console.print(matrix_table(results))
    for r in results:
        for problem in r.get("problems", []):
            console.print(f"[red]{r['cell']}: {problem}")
    doc = {"concurrency": concurrency, "requests": requests, "max_tokens": max_tokens, "model": model,
           "cells": results}
    if json_path:
        json_path.write_text(json.dumps(doc, indent=1))
    if plot:
        plot_matrix(results, str(plot))
    if any(r["status"] == "fail" for r in results):
        raise typer.Exit(1)
