"""Measure MLX CPU speed under each BLAS, side by side in one run.

Each BLAS runs in its own fresh interpreter (the library must be loaded
before mlx), alternating rounds so machine noise hits all of them alike.
Reports fp32 1024^3 matmul GFLOP/s, a 1x768 @ 768x2048 matvec, and serial
decode tok/s (32-token prompt) and prefill tok/s (512-token prompt) of mlxq's
engine on the ~33M-parameter `small` preset.

    python scripts/bench_blas.py --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import mlxq
from mlxq.blas import active
import mlx.core as mx
mx.set_default_device(mx.cpu)
n = 1024
a = mx.random.normal((n, n)); b = mx.random.normal((n, n)); mx.eval(a, b)
for _ in range(2): mx.eval(a @ b)
t = time.perf_counter(); k = 5
for _ in range(k): mx.eval(a @ b)
gflops = 2 * n**3 / ((time.perf_counter() - t) / k) / 1e9
x = mx.random.normal((1, 768)); w = mx.random.normal((768, 2048)); mx.eval(x, w)
for _ in range(10): mx.eval(x @ w)
t = time.perf_counter(); k = 300
for _ in range(k): mx.eval(x @ w)
matvec_ms = (time.perf_counter() - t) / k * 1e3
from mlxq.models.loader import load_model
from mlxq.engine.serial import run_serial
from mlxq.engine.types import Request, SamplingParams
lm = load_model(sys.argv[1])
def generate(n_prompt, n_tokens):
    events = []
    prompt = [1 + i % 1000 for i in range(n_prompt)]
    out = run_serial(lm.model, lm.tokenizer, Request("b", prompt, SamplingParams(), n_tokens),
                     events.append, prefill_step_size=2048)
    return out.usage()
generate(32, 8)
u = generate(32, int(sys.argv[2]))
p = generate(512, 1)
print(json.dumps({"blas": active().name, "gflops": gflops, "matvec_ms": matvec_ms,
                  "decode_tok_s": u.decode_tok_s, "prefill_tok_s": 512 / p.ttft_s}))
"""

CANDIDATES = {
    "bundled": "bundled",
    "mkl": "",  # the default search finds the mkl wheel
    "openblas": "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from mlxq.models.tiny import build_tiny_model

    model_dir = build_tiny_model("llama", os.path.join(tempfile.mkdtemp(), "small"), preset="small")
    available = {k: v for k, v in CANDIDATES.items() if not v.startswith("/") or os.path.exists(v)}
    runs: dict[str, list[dict]] = {k: [] for k in available}
    for _ in range(args.rounds):
        for name, value in available.items():
            env = {**os.environ, "MLXQ_BLAS": value}
            out = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), str(args.tokens)],
                                 capture_output=True, text=True, env=env, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {}
    for name, rs in runs.items():
        keys = ("gflops", "matvec_ms", "decode_tok_s", "prefill_tok_s")
        summary[name] = {key: statistics.median(r[key] for r in rs) for key in keys}
        summary[name]["loaded"] = rs[0]["blas"]
    base = summary["bundled"]
    print(f"{'BLAS':10} {'loaded':18} {'GFLOP/s':>9} {'matvec ms':>10} {'decode tok/s':>13} {'decode x':>9} "
          f"{'prefill tok/s':>14} {'prefill x':>10}")
    for name, s in summary.items():
        print(f"{name:10} {s['loaded']:18} {s['gflops']:9.1f} {s['matvec_ms']:10.3f} {s['decode_tok_s']:13.1f} "
              f"{s['decode_tok_s'] / base['decode_tok_s']:9.2f} {s['prefill_tok_s']:14.1f} "
              f"{s['prefill_tok_s'] / base['prefill_tok_s']:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": runs, "rounds": args.rounds, "tokens": args.tokens}, f, indent=1)


if __name__ == "__main__":
    main()
