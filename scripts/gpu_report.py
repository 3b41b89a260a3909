"""Table (markdown) and PNG from a gpu_bench.py results folder (run where matplotlib is).

    python scripts/gpu_report.py docs/results/gpu-h200/run4
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlxq.bench.report import plot_sweep


def main() -> None:
    folder = Path(sys.argv[1])
    runs = {"a": [], "b": []}
    for path in sorted(folder.glob("http-c*.json"), key=lambda p: int(p.stem.split("c")[-1])):
        doc = json.loads(path.read_text())
        for key in runs:
            runs[key] += doc[key]
    plot_sweep(runs, str(folder / "http-sweep.png"))
    print("| c | mlxq out tok/s | mlx_lm.server out tok/s | x | mlxq TTFT p50/p95 ms | mlx_lm TTFT p50/p95 ms "
          "| mlxq ITL p50 ms | mlx_lm ITL p50 ms | failed mlxq / mlx_lm |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for a, b in zip(runs["a"], runs["b"], strict=True):
        ratio = a["output_throughput_tok_s"] / b["output_throughput_tok_s"]
        print(f"| {a['concurrency']} | {a['output_throughput_tok_s']:.1f} | {b['output_throughput_tok_s']:.1f} | "
              f"{ratio:.2f} | {a['ttft_ms']['p50']:.0f} / {a['ttft_ms']['p95']:.0f} | "
              f"{b['ttft_ms']['p50']:.0f} / {b['ttft_ms']['p95']:.0f} | {a['itl_ms']['p50']:.1f} | "
              f"{b['itl_ms']['p50']:.1f} | {a['failed']} / {b['failed']} |")


if __name__ == "__main__":
    main()
