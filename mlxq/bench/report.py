"""Tables (rich) and plots (matplotlib, optional) of benchmark results."""

from __future__ import annotations

from statistics import median

from rich.console import Console
from rich.table import Table


def results_table(runs: list[dict], title: str) -> Table:
    table = Table(title=title)
    for col in ("target", "c", "done", "failed", "out tok/s", "req/s", "TTFT p50", "TTFT p95", "ITL p50",
                "TPOT p50", "E2EL p50", "cached"):
        table.add_column(col, justify="right" if col != "target" else "left")
    for r in runs:
        cached = r.get("cached_token_ratio")
        table.add_row(
            r["label"], str(r["concurrency"]), str(r["completed"]), str(r["failed"]),
            f"{r['output_throughput_tok_s']:.1f}", f"{r['request_throughput']:.2f}",
            f"{r['ttft_ms']['p50']:.0f} ms", f"{r['ttft_ms']['p95']:.0f} ms", f"{r['itl_ms']['p50']:.1f} ms",
            f"{r['tpot_ms']['p50']:.1f} ms", f"{r['e2el_ms']['p50']:.0f} ms",
            "-" if cached is None else f"{cached:.0%}",
        )
    return table


def print_sweep(result: dict, console: Console | None = None) -> None:
    # Not a terminal (a pipe, a CI log): rich would fold the table into 80 columns.
    console = console or Console(width=None if Console().is_terminal else 160)
    console.print(results_table(result["a"] + result["b"], "serving-load"))
    for r in result["a"] + result["b"]:
        timing = r.get("server_timing")
        if timing:
            share = timing["busy_share"]
            console.print(f"{r['label']} c={r['concurrency']} server: decode step {timing['step_ms']:.2f} ms "
                          f"(graph {timing['build_ms']:.2f}, async_eval {timing['submit_ms']:.2f}, "
                          f"read {timing['device_wait_ms']:.2f}); busy: decode {share['decode']:.0%}, "
                          f"prefill {share['prefill']:.0%}, join {share['join']:.0%}")
    for r in result["a"] + result["b"]:
        if r["errors"]:
            console.print(f"[red]{r['label']} c={r['concurrency']}: {r['failed']} failed, e.g. {r['errors'][0]}")
    if result.get("ratios"):
        table = Table(title="B / A (medians over rounds)")
        table.add_column("metric")
        levels = list(next(iter(result["ratios"].values())).keys())
        for level in levels:
            table.add_column(f"c={level}", justify="right")
        for metric, by_level in result["ratios"].items():
            table.add_row(metric, *[("-" if by_level[lv] is None else f"{by_level[lv]:.2f}x") for lv in levels])
        console.print(table)


def plot_sweep(result: dict, path: str) -> None:
    """TTFT p50/p95 and output tok/s against concurrency, one line per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    fig, (ax_tps, ax_ttft, ax_cached) = plt.subplots(1, 3, figsize=(15, 4.4))
    for key in ("a", "b"):
        runs = result[key]
        if not runs:
            continue
        label = runs[0]["label"]
        levels = sorted({r["concurrency"] for r in runs})
        def at(level, key, runs=runs):
            return median(key(r) for r in runs if r["concurrency"] == level)

        tps = [at(lv, lambda r: r["output_throughput_tok_s"]) for lv in levels]
        p50 = [at(lv, lambda r: r["ttft_ms"]["p50"]) for lv in levels]
        p95 = [at(lv, lambda r: r["ttft_ms"]["p95"]) for lv in levels]
        ax_tps.plot(levels, tps, marker="o", label=label)
        ax_ttft.plot(levels, p50, marker="o", label=f"{label} p50")
        ax_ttft.plot(levels, p95, marker="x", linestyle="--", label=f"{label} p95")
        cached = [at(lv, lambda r: 100 * (r.get("cached_token_ratio") or 0.0)) for lv in levels]
        ax_cached.plot(levels, cached, marker="o", label=label)
    ax_tps.set(xlabel="concurrent requests", ylabel="output tokens/s (all requests)", title="Throughput")
    ax_ttft.set(xlabel="concurrent requests", ylabel="time to first token (ms)", title="TTFT p50 and p95")
    ax_cached.set(xlabel="concurrent requests", ylabel="prompt tokens served from cache (%)",
                  title="Prompt cache share", ylim=(-2, 102))
    all_levels = sorted({r["concurrency"] for r in result["a"] + result["b"]})
    for ax in (ax_tps, ax_ttft, ax_cached):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(all_levels))  # 1, 8, 32 ... rather than 2^0, 2^3
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(result: dict) -> str:
    cfg, work = result.get("config") or {}, result.get("workload") or {}
    prompts = "fresh prompts per level" if work.get("fresh_prompts") else "the same prompts at every level"
    return (f"{cfg.get('url', '?')} ({cfg.get('model', '?')}, {cfg.get('endpoint', 'chat')}): "
            f"{work.get('dataset', '?')} dataset, {work.get('prompt_len', '?')}-word prompts, "
            f"{cfg.get('max_tokens', '?')} output tokens, {work.get('num_requests', '?')} requests per level, "
            f"{prompts}")


def matrix_table(cells: list[dict]) -> Table:
    table = Table(title="feature matrix")
    for col in ("cell", "gate", "requests", "out tok/s", "TTFT p50", "TTFT p95", "note"):
        table.add_column(col, justify="left" if col in ("cell", "gate", "note") else "right")
    for c in cells:
        if c["status"] == "skipped":
            table.add_row(c["cell"], "[yellow]skipped", "-", "-", "-", "-", c["note"])
            continue
        gate = "[green]pass" if c["status"] == "pass" else "[red]FAIL"
        table.add_row(c["cell"], gate, str(c["requests"]), f"{c['output_throughput_tok_s']:.1f}",
                      f"{c['ttft_ms']['p50']:.0f} ms", f"{c['ttft_ms']['p95']:.0f} ms", c["note"])
    return table


def plot_matrix(cells: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [c for c in cells if c["status"] != "skipped"]
    names = [c["cell"] for c in ran]
    colors = ["tab:green" if c["status"] == "pass" else "tab:red" for c in ran]
    fig, (ax_tps, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    ax_tps.bar(names, [c["output_throughput_tok_s"] for c in ran], color=colors)
    ax_tps.set(ylabel="aggregate output tok/s", title="Throughput (green: gate passed)")
    xs = range(len(ran))
    ax_ttft.bar([x - 0.2 for x in xs], [c["ttft_ms"]["p50"] for c in ran], width=0.4, label="p50")
    ax_ttft.bar([x + 0.2 for x in xs], [c["ttft_ms"]["p95"] for c in ran], width=0.4, label="p95")
    ax_ttft.set_xticks(list(xs), names)
    ax_ttft.set(ylabel="TTFT (ms)", title="Time to first token")
    ax_ttft.legend()
    for ax in (ax_tps, ax_ttft):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
