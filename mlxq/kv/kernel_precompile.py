"""The shared-prefix kernels' variants compiled side by side, before their self-check runs here.

MLX compiles a custom CUDA kernel (NVRTC) the first time one of its
variants runs, one after another on the calling thread, and keeps the
result in its PTX cache on disk (``MLX_PTX_CACHE_DIR``, by default under
the temp directory), named by the kernel and its template arguments. The
self-check's kernel variants are independent of each other: ``precompile``
runs each group of them in a child process of its own, all at once, so
that the check which follows in this process finds them in the disk cache
instead of compiling them in turn. Best effort: a child that fails or is
late changes nothing but the time (the check compiles whatever it does not
find), and the check itself still runs here, in full, and decides.

Each child compiles a disjoint set of variants (two processes never write
the same cache file): ``full`` the one-kernel path, ``split`` the tails and
merge kernel, ``gqa`` the gqa kernel with a prefix, ``mma_gqa`` the
tensor-core prefix kernel (decode warps) and the gqa kernel with levels,
``mma_prefill`` the tensor-core prefix kernel with the prefill's warps.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

log = logging.getLogger("mlxq.kv")

GROUPS = ("full", "split", "gqa", "mma_gqa", "mma_prefill")  # disjoint kernel variants, one child each
TIMEOUT_S = 60.0  # a child still compiling after this is left to finish alone; the check goes on


def precompile(layout, paths: tuple[str, ...]) -> dict:
    """Compile ``paths``' variants for ``layout`` (kv/shared_prefix_decode.Layout; None: the default
    check's) in child processes at once; returns what each did (seconds, exit status)."""
    spec = None if layout is None else {"dtype": str(layout.dtype).removeprefix("mlx.core."), "heads": layout.heads,
                                        "kv_heads": layout.kv_heads, "dim": layout.dim, "sinks": layout.sinks}
    began = time.perf_counter()
    children = {}
    for path in (p for p in GROUPS if p in paths):
        try:
            children[path] = subprocess.Popen(
                [sys.executable, "-m", "mlxq.kv.kernel_precompile", path, json.dumps(spec)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(),
                                                                               os.environ.get("PYTHONPATH")]))})
        except OSError as exc:
            log.info("shared-prefix kernels: no child compiles (%s)", exc)
            break
    done = {}
    for path, child in children.items():
        try:
            _, err = child.communicate(timeout=max(1.0, TIMEOUT_S - (time.perf_counter() - began)))
            done[path] = {"rc": child.returncode, "seconds": round(time.perf_counter() - began, 2)}
            if child.returncode:
                done[path]["error"] = err[-300:]
        except subprocess.TimeoutExpired:  # never killed: a half-written cache file would cost more than waiting
            done[path] = {"rc": None, "seconds": round(time.perf_counter() - began, 2)}
    return done


def _package_root() -> str:
    """The directory holding this ``mlxq`` package, so a child imports the same code."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compile_group(path: str, spec: dict | None) -> None:
    """Run ``path``'s kernel variants once for the layout ``spec`` (the check's inputs and its sinks cases)."""
    import mlx.core as mx

    from mlxq.kv import shared_prefix_decode as decode

    layout = None if spec is None else decode.Layout(getattr(mx, spec["dtype"]), spec["heads"], spec["kv_heads"],
                                                     spec["dim"], spec["sinks"])
    dtype = mx.bfloat16 if layout is None else layout.dtype
    heads = {} if layout is None else {"heads": layout.heads, "kv_heads": layout.kv_heads, "dim": layout.dim}
    positions = decode.CHECK_QUERIES if path == "mma_prefill" else 1
    args = decode._check_inputs(dtype, positions, **heads)
    sink_logits = mx.random.normal((args[0].shape[1],))
    sinks_cases = (None, sink_logits) if layout is None else ((sink_logits if layout.sinks else None),)
    with decode.forced(path):
        mx.eval([decode.attention(*args, sinks) for sinks in sinks_cases])


if __name__ == "__main__":
    compile_group(sys.argv[1], json.loads(sys.argv[2]))
