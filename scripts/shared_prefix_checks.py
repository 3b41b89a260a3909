"""What the shared-prefix kernels' start-up self-check costs, without a model or a server.

In one fresh process (run it with an empty ``MLX_PTX_CACHE_DIR`` to pay
MLX's compilations as a first start does): the check on one model layout
(``--heads/--kv-heads/--dim``, sinks or not: what ``enable`` runs for such a
model), then the default check (every variant, with and without sinks: what
it ran for every model before the layout was read), whose time here is
what the variants the layout left out add (the layout's kernels are already
compiled), then the same layout's check again (compiled: the comparisons
alone). One JSON line per step, flushed as it ends.

    MLX_PTX_CACHE_DIR=/tmp/ptx-empty python scripts/shared_prefix_checks.py --heads 32 --kv-heads 8 --dim 128
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--sinks", action="store_true")
    args = ap.parse_args()
    t = time.perf_counter()
    mx.eval(mx.zeros((4,)) + 1)  # the device's own start-up, apart
    from mlxq.kv import shared_prefix_decode as decode

    print(json.dumps({"step": "device", "seconds": round(time.perf_counter() - t, 2)}), flush=True)
    layout = decode.Layout(mx.bfloat16, args.heads, args.kv_heads, args.dim, args.sinks)
    steps = [("layout", lambda: decode.self_check(layout=layout), lambda: decode._mma_partials_agree(layout)),
             ("default_extra", lambda: decode.self_check(), lambda: decode._mma_partials_agree()),
             ("layout_again", lambda: decode.self_check(layout=layout), lambda: decode._mma_partials_agree(layout))]
    for name, check, partials in steps:
        t = time.perf_counter()
        errors = check() if mx.cuda.is_available() else {}
        agree = partials() if mx.cuda.is_available() else None
        print(json.dumps({"step": name, "seconds": round(time.perf_counter() - t, 2), "max_diff": errors,
                          "mma_partials_agree": agree}), flush=True)


if __name__ == "__main__":
    main()
