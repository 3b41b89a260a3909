"""Which implementation runs a shared-prefix group's attention, decided per call from plain data.

- ``ops``: kv/shared_prefix_attention.py, plain MLX operations (every
  backend; prefill chunks of a group, quantized K/V and anything the
  kernels do not take);
- ``full``: kv/shared_prefix_kernel.py, one CUDA kernel per layer (small
  groups, where the split path's dozen launches dominate);
- ``split``: kv/tail_merge_kernel.py, the prefix as stacked GEMMs plus one
  CUDA kernel for the tails and the merge (large groups);
- ``gqa``: kv/gqa_decode_kernel.py, one block per (row, KV head) walking the
  prefix (mostly from L2: every row's blocks read it at about the same
  time) then the row's tail, one online softmax over both: below
  ``GQA_MAX_GROUP_TOKENS``, where its own self-check passed;
- ``mma``: kv/prefix_mma_kernel.py, the prefix on tensor cores in splits
  (flash-decoding), then the split path's kernel for the tails and the
  merge of every split: bf16 groups from ``MMA_MIN_GROUP_TOKENS`` on where
  the gqa kernel cannot take the tails (its self-check failed, or a group
  of query heads wider than it holds);
- ``mma_gqa``: the same prefix levels merged by kv/gqa_decode_kernel.py
  walking the tails (one block per row and KV head, every query head of the
  group at once): bf16 groups from ``MMA_MIN_GROUP_TOKENS`` on, where both
  kernels' self-checks and this path's own passed;
- ``mma_prefill``: many queries per row (the tails' prefill on a shared
  prefix, engine/shared_tails.py): every row's queries stacked per KV head
  against the prefix in the tensor-core kernel (its levels merged into one,
  no score matrix in memory), each row's causal tail and the merge as plain
  operations in float32. bf16, any group size, where its checks passed
  (H200 8B, one forward of 64 rows: 56 queries each on 14.5k, 252 ms vs
  828 in plain operations; 50 on 2k, 125 vs 191, per-row copies 202).
  Everything else with several queries per row takes ``ops``, whose prefix
  product goes in blocks of at most ``SCORE_BLOCK`` scores;
- ``metal``: kv/metal_decode_kernel.py, the gqa kernel's plan on Metal
  (one threadgroup per row and KV head), once ``enable_metal``'s check
  passed on the device; nothing of it was measured (``_metal_route``).

The CUDA kernels run only on CUDA, only after ``enable()``'s self-check agrees
with the plain path, and only for a head width they have (one query per row
but for ``mma_prefill``). ``route`` decides from a ``CallShape``, plain
data. The thresholds come from the H200 measurements in docs/benchmarks.md
("H200: shared-prefix attention per layer"), in group tokens (rows x prefix
length). Per layer (2026-12-01, one run): the mma_gqa path wins from 131k
on (64 x 2k + 50: 0.113 ms vs mma 0.198, gqa 0.215; 64 x 2k + 300: 0.126
vs 0.224 / 0.227; 16 x 12k + 300: 0.104 vs 0.138 / 0.275; 64 x 16k + 300:
0.211 vs 0.358, split 0.837): the split path's tail kernel (one block per
row and query head) reads each tail once per query head of a KV head's
group (four times at 32 on 8), the gqa kernel once. Below 131k the gqa
path (32 x 2k: 0.13 vs 0.14-0.20; 64 x 512: 0.11 vs 0.22). Whole-model
steps agreed for the mma path (64 x 2k + 50: 15.2 vs gqa 16.1 ms; 16 x 12k:
19.6 vs 26.7). For float16 and float32, which the mma kernel does not
take, the split path's GEMMs beat the gqa path from 524k on (64 x 16k: 0.81
vs 1.37 ms) and one kernel below 32k (64 x 512: 0.26 vs 0.36 ms).

``worth_sharing``, the scheduler's gate: whole-model steps shared beat
per-row copies from 131k group tokens (64 x 2k + 50: 15.2 vs 16.2 ms; 16 x
12k + 300: 19.6 vs 24.8); end to end 64 agents on a 2k prefix decoded 1.19x
faster shared, while 16 agents on a 2.2k prefix (35k) were slower (ITL p50
12.5 vs 10.7 ms, before the gqa and mma kernels) (docs/benchmarks.md, "H200:
shared-prefix attention end to end"). With mma_gqa routed, 64 agents on a
cached 2.2k prefix ran at 0.88x of copies end to end, losing 0.44-0.86 s
at the first token (the group's join) in rounds of only 128 tokens out:
the gate weighs the decode step, which sharing speeds up. On the CPU
sharing measured at parity with copies (the exponentials, not the reads,
bound it there), so it says no.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import mlx.core as mx

from mlxq.kv import (
    gqa_decode_kernel,
    metal_decode_kernel,
    packed_tails_kernel,
    prefix_mma_kernel,
    shared_prefix_kernel,
    tail_merge_kernel,
)
from mlxq.kv.shared_prefix_attention import (
    Partial,
    Quant,
    RowGroups,
    grouped_shared_prefix_attention,
    prefix_partial,
    shared_prefix_attention,
    unstacked,
    with_tails,
)

log = logging.getLogger("mlxq.kv")

SPLIT_MIN_GROUP_TOKENS = 32_768  # rows x prefix tokens from which the split path beats one kernel (H200)
GQA_MAX_GROUP_TOKENS = 524_288  # from here the split path's GEMMs beat the gqa path (float16, float32)
MMA_MIN_GROUP_TOKENS = 131_072  # from here the tensor-core prefix takes bf16 groups (H200, 8B shape)
AUTO_MIN_GROUP_TOKENS = 131_072  # the smallest group measured faster in whole-model steps (64 x 2k, H200)
METAL_MAX_GROUP_TOKENS = GQA_MAX_GROUP_TOKENS  # the CUDA gqa kernel's bound, taken over: not measured on Metal
PATHS = ("ops", "full", "split", "gqa", "mma", "mma_gqa", "mma_prefill")
AGREEMENT = 2e-2  # a kernel's largest difference to the plain path, bf16 outputs of order 1: a few ulps

_kernels: frozenset[str] = frozenset()  # the kernel paths whose self-checks passed (``passing_paths``)
_checked = False  # enable() ran its self-check
_metal_checked = False  # enable_metal() ran the Metal kernel's check
_declined: str | None = None  # why a backend's kernel stays off (``kernel_status``; set on Metal)
_grouped_enabled: bool | None = None  # the split path for several groups per batch (None: not checked yet)
_forced: str | None = None  # set by ``forced`` (benchmarks, tests)
_OPTIONAL = ("gqa", "mma", "mma_gqa", "mma_prefill")  # paths whose failed self-check keeps the others on
_report: dict | None = None  # what enable()'s self-check ran, found and took (``check_report``)
_path_seconds: dict[str, float] = {}  # self_check's time per kernel path (its first launches compile it)


@dataclass(frozen=True)
class CallShape:
    """What the route of one call of a group's attention depends on (plain data)."""

    rows: int
    queries: int  # per row: 1 in a decode step, a chunk's length in a prefill
    prefix: int  # shared prefix tokens
    quantized: bool  # --kv-quant triples
    one_kernel: bool  # kv/shared_prefix_kernel.py takes it (and so the split path)
    gqa_tails: bool  # kv/gqa_decode_kernel.py takes its tails
    mma_prefix: bool  # kv/prefix_mma_kernel.py takes its queries and prefix (bf16)
    metal: bool = False  # kv/metal_decode_kernel.py takes it

    @property
    def group_tokens(self) -> int:
        return self.rows * self.prefix


@dataclass(frozen=True)
class Layout:
    """What a model's attention calls hand the shared-prefix paths, read by kv/sharing_plan.py's probe.

    The kernels are compiled per dtype, head width, query heads per KV head and with or without
    sinks (their template arguments): ``enable`` checks the variants this model runs, and only
    those, so the check compiles what serving launches and nothing it never will (a model without
    sinks never runs the sinks variants, half of the kernels' compilations at start-up)."""

    dtype: mx.Dtype
    heads: int
    kv_heads: int
    dim: int
    sinks: bool

    def describe(self) -> str:
        return (f"{str(self.dtype).removeprefix('mlx.core.')}, {self.heads} query / {self.kv_heads} KV heads of "
                f"{self.dim}, {'with' if self.sinks else 'no'} sinks")


def checkable(layout: Layout | None) -> Layout | None:
    """``layout`` when the one-kernel path takes its shapes (else the kernels never run for this
    model, and ``enable`` checks the default variants, as for an unknown model); None stays None."""
    if layout is None or layout.kv_heads <= 0 or layout.heads % layout.kv_heads:
        return None
    if layout.dim not in shared_prefix_kernel.HEAD_DIMS or layout.dtype not in (mx.bfloat16, mx.float16, mx.float32):
        return None
    return layout


def route(shape: CallShape, kernels: frozenset[str]) -> str:
    """The path for ``shape`` given the kernel paths whose self-checks passed."""
    if "metal" in kernels:
        return _metal_route(shape)
    if shape.quantized or "split" not in kernels:
        return "ops"
    if shape.queries > 1:  # a prefill chunk: the prefix on tensor cores, never a float32 score matrix of it
        return "mma_prefill" if "mma_prefill" in kernels and shape.mma_prefix else "ops"
    if not shape.one_kernel:
        return "ops"
    tokens = shape.group_tokens
    if "mma" in kernels and tokens >= MMA_MIN_GROUP_TOKENS and shape.mma_prefix:
        return "mma_gqa" if "mma_gqa" in kernels and shape.gqa_tails else "mma"
    if "gqa" in kernels and tokens < GQA_MAX_GROUP_TOKENS and shape.gqa_tails:
        return "gqa"
    return "split" if tokens >= SPLIT_MIN_GROUP_TOKENS else "full"


def call_shape(queries: mx.array, prefix_keys, tail_keys, tail_values, quant: Quant | None = None) -> CallShape:
    if quant is not None:  # triples: no kernel takes them
        return CallShape(queries.shape[0], queries.shape[2], prefix_keys[0].shape[2], True, False, False, False)
    return CallShape(queries.shape[0], queries.shape[2], prefix_keys.shape[2], False,
                     shared_prefix_kernel.can_run(queries, prefix_keys, tail_keys, tail_values),
                     gqa_decode_kernel.can_run(queries, tail_keys, tail_values),
                     prefix_mma_kernel.can_run(queries, prefix_keys),
                     metal_decode_kernel.on_metal()
                     and metal_decode_kernel.can_run(queries, prefix_keys, tail_keys, tail_values))


def choose(queries: mx.array, prefix_keys, tail_keys, tail_values, quant: Quant | None = None) -> str:
    if _forced is not None:
        return _forced
    if not _kernels:
        return "ops"
    return route(call_shape(queries, prefix_keys, tail_keys, tail_values, quant), _kernels)


class RouteMemo:
    """One cache's route, worked out again only when what it depends on changes.

    ``route`` reads the call's rows, queries per row, prefix length, head widths and dtypes. A
    cache's prefix, dtypes and widths are fixed between its ``reset``s (a change of its groups), and
    a decode step's queries have the same shape every step (the tails' growing length decides no
    route): so the queries' shape and the set of passing kernels are the key. Reading the six arrays'
    shapes and dtypes costs ~13 us of host time per layer on a slow core (0.4 ms per 32-layer
    step; "H200: the tails' prefill on a shared prefix" measured the route ~5 us per layer); one
    shape read costs ~0.5 us."""

    __slots__ = ("kernels", "path", "shape")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.shape, self.kernels, self.path = None, None, "ops"

    def choose(self, queries: mx.array, prefix_keys, tail_keys, tail_values, quant: Quant | None = None) -> str:
        if _forced is not None:
            return _forced
        shape = queries.shape
        if shape != self.shape or self.kernels is not _kernels:
            self.path = choose(queries, prefix_keys, tail_keys, tail_values, quant)
            self.shape, self.kernels = shape, _kernels
        return self.path


def worth_sharing(rows: int, prefix_length: int) -> bool:
    """Whether a decode step of ``rows`` rows on a ``prefix_length``-token prefix is faster shared
    than over per-row copies (measured on the H200; the CPU measured no gain)."""
    return not_worth_sharing(rows, prefix_length) is None


def not_worth_sharing(rows: int, prefix_length: int) -> str | None:
    """Why ``worth_sharing`` says no for this group (None: it says yes), for /stats."""
    if not is_enabled():
        return "the shared-prefix kernels are off (CUDA only, once their start-up self-check passed)"
    if rows * prefix_length < AUTO_MIN_GROUP_TOKENS:
        return (f"{rows} rows x {prefix_length} prefix tokens: below the {AUTO_MIN_GROUP_TOKENS} group tokens "
                f"from which shared decode steps measured faster")
    return None


def attention(queries, prefix_keys, prefix_values, tail_keys, tail_values, tail_starts, scale: float,
              sinks: mx.array | None = None, quant: Quant | None = None, shares: mx.array | None = None,
              memo: RouteMemo | None = None) -> mx.array:
    """Plain MLX arrays, or quantized triples with ``quant`` (which always take plain operations);
    ``shares`` [B] bool marks the rows that see the prefix (None: all); ``memo``: the calling
    cache's last route (``RouteMemo``), else it is worked out for this call."""
    args = (queries, prefix_keys, prefix_values, tail_keys, tail_values, tail_starts, scale, sinks)
    path = (memo.choose if memo is not None else choose)(queries, prefix_keys, tail_keys, tail_values, quant)
    if path == "full":
        return shared_prefix_kernel.shared_prefix_decode(*args, shares)
    if path == "split":
        return tail_merge_kernel.split_shared_prefix_decode(*args, shares)
    if path == "gqa":
        return gqa_decode_kernel.gqa_shared_prefix_decode(*args, shares)
    if path == "mma":
        return tail_merge_kernel.mma_shared_prefix_decode(*args, shares)
    if path == "mma_gqa":
        return _mma_gqa_decode(*args, shares)
    if path == "mma_prefill":
        return _mma_prefill(*args, shares)
    if path == "metal":
        return metal_decode_kernel.metal_shared_prefix_decode(*args, shares)
    return shared_prefix_attention(*args, quant, shares)


def _mma_prefill(queries, prefix_keys, prefix_values, tail_keys, tail_values, tail_starts, scale: float,
                 sinks: mx.array | None, shares: mx.array | None) -> mx.array:
    """Many queries per row (the tails' prefill): the prefix on tensor cores as one level (no score
    matrix in memory), each row's causal tail and the merge in plain operations (float32)."""
    levels = prefix_mma_kernel.prefix_level(queries, prefix_keys, prefix_values, scale)
    prefix = unstacked(queries, prefix_keys.shape[1], levels)
    return with_tails(queries, prefix, tail_keys, tail_values, tail_starts, scale, sinks, None, shares)


def packed_prefix_partial(queries: mx.array, prefix_keys: mx.array, prefix_values: mx.array, scale: float
                          ) -> Partial:
    """The prefix's level for a packed tails' forward (kv/packed_tails.py): queries [T, Hq, 1, D], one
    position per row but as many rows as a prefill chunk's cells, so the tensor-core kernel takes them
    in the prefill's cut (``mma_prefill``'s check covers it: the same kernel, stacked rows of one
    position); plain operations in bounded blocks where that path is off. Never ``RouteMemo``: one
    query per row would pick a decode path, which reads one tail per row."""
    path = _forced or ("mma_prefill" if "mma_prefill" in _kernels else "ops")
    if path == "mma_prefill" and prefix_mma_kernel.can_run(queries, prefix_keys):
        levels = prefix_mma_kernel.prefix_level(queries, prefix_keys, prefix_values, scale,
                                                tiling=prefix_mma_kernel.PREFILL_TILING)
        return unstacked(queries, prefix_keys.shape[1], levels)
    return prefix_partial(queries, prefix_keys, prefix_values, scale)


def _mma_gqa_decode(queries, prefix_keys, prefix_values, tail_keys, tail_values, tail_starts, scale: float,
                    sinks: mx.array | None, shares: mx.array | None) -> mx.array:
    """The prefix's levels on tensor cores, then the gqa kernel walks each row's tail and merges them."""
    levels = prefix_mma_kernel.prefix_partials(queries, prefix_keys, prefix_values, scale)
    return gqa_decode_kernel.gqa_levels_decode(queries, tail_keys, tail_values, tail_starts, scale, sinks, levels,
                                               shares)


def grouped_attention(queries, prefixes, tail_keys, tail_values, tail_starts, scale: float,
                      sinks: mx.array | None = None, quant: Quant | None = None,
                      layout: RowGroups | None = None) -> mx.array:
    """Several groups in one batch (``layout``: which rows read which prefix): on CUDA with the
    kernels on, each group's prefix GEMMs then the split path's one kernel for every row (not
    measured; ``self_check`` compares it with the plain path before the kernels are enabled);
    plain operations elsewhere."""
    if _forced != "ops" and quant is None and _grouped_ready() and all(
            shared_prefix_kernel.can_run(queries, keys, tail_keys, tail_values) for keys, _ in prefixes):
        return tail_merge_kernel.split_grouped_decode(queries, prefixes, tail_keys, tail_values, tail_starts, scale,
                                                      sinks, layout)
    return grouped_shared_prefix_attention(queries, prefixes, tail_keys, tail_values, tail_starts, scale, layout,
                                           sinks, quant)


@contextlib.contextmanager
def forced(path: str):
    """Within: every call takes ``path`` (which must be able to run it)."""
    global _forced
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; choose one of {', '.join(PATHS)}")
    _forced = path
    try:
        yield
    finally:
        _forced = None


CHECK_QUERIES = 7  # queries per row in the prefill paths' self-check (a chunk, the padded row's first ones masked)


def _check_inputs(dtype, positions: int = 1, heads: int = 8, kv_heads: int = 2, dim: int = 128):
    rows, prefix, own = 6, 333, 40
    if positions == 1:
        q = mx.random.normal((rows, heads, 1, dim)).astype(dtype)
    else:  # the strided view mlx-lm's models hand over: [B, L, Hq, D] transposed
        q = mx.random.normal((rows, positions, heads, dim)).astype(dtype).swapaxes(1, 2)
    pk, pv = (mx.random.normal((1, kv_heads, prefix, dim)).astype(dtype) for _ in range(2))
    buffer = mx.random.normal((2, rows, kv_heads, own + 24, dim)).astype(dtype)
    return q, pk, pv, buffer[0, :, :, :own], buffer[1, :, :, :own], mx.array([0, 1, 17, 39, 5, 20]), dim**-0.5


def checked_paths(dtype) -> tuple[str, ...]:
    """The kernel paths ``self_check`` compares with the plain path in ``dtype``."""
    return ("full", "split", "gqa") + (("mma", "mma_gqa", "mma_prefill") if dtype == mx.bfloat16 else ())


def self_check(dtype=mx.bfloat16, layout: Layout | None = None) -> dict[str, float]:
    """Max |kernel - plain path| per kernel on a random group with padding, rows outside the group,
    tails as strided views (``mma``, ``mma_gqa`` and ``mma_prefill`` in bf16 only; the prefill path
    with CHECK_QUERIES queries per row, the others with one). With ``layout`` (the model's): in its
    dtype and head layout, with sinks only if it has them; without: ``dtype`` on 8 query / 2 KV
    heads of 128, without sinks and with them."""
    if layout is not None:
        dtype, heads = layout.dtype, dict(heads=layout.heads, kv_heads=layout.kv_heads, dim=layout.dim)
    else:
        heads = {}
    inputs = {1: _check_inputs(dtype, **heads), CHECK_QUERIES: _check_inputs(dtype, CHECK_QUERIES, **heads)}
    worst = dict.fromkeys(checked_paths(dtype), 0.0)
    sink_logits = mx.random.normal((inputs[1][0].shape[1],))
    some = mx.array([True, False, True, True, False, True])
    if layout is None:
        cases = ((None, None), (sink_logits, some))
    else:  # the variants this model launches: with sinks or without, every row in the group or not
        sinks = sink_logits if layout.sinks else None
        cases = ((sinks, None), (sinks, some))
    for sinks, shares in cases:
        for positions, args in inputs.items():
            q, pk, pv, tk, tv, starts, scale = args
            want = shared_prefix_attention(q, pk, pv, tk, tv, starts, scale, sinks, None, shares).astype(mx.float32)
            for path in [p for p in worst if (p == "mma_prefill") == (positions > 1)]:
                began = time.perf_counter()
                worst[path] = max(worst[path], _path_error(path, (*args, sinks, None, shares), want))
                _path_seconds[path] = _path_seconds.get(path, 0.0) + time.perf_counter() - began
    return worst


def _path_error(path: str, args: tuple, want: mx.array) -> float:
    try:
        with forced(path):
            got = attention(*args).astype(mx.float32)
    except Exception as exc:  # one kernel that does not build must not take the others down
        if path not in _OPTIONAL:
            raise
        log.warning("%s shared-prefix path unavailable (%s: %s)", path, type(exc).__name__, exc)
        return float("inf")
    return mx.abs(got - want).max().item()


def grouped_self_check(dtype=mx.bfloat16) -> float:
    """Max |grouped kernel path - plain path| on two groups (the second prefix shorter) and a stray."""
    q, pk, pv, tk, tv, starts, scale = _check_inputs(dtype)
    prefixes = [(pk, pv), (pk[:, :, :100], pv[:, :, :100])]
    layout = RowGroups.of([1, 0, -1, 0, 1, 0], 2)
    want = grouped_shared_prefix_attention(q, prefixes, tk, tv, starts, scale, layout).astype(mx.float32)
    got = tail_merge_kernel.split_grouped_decode(q, prefixes, tk, tv, starts, scale, None, layout)
    return mx.abs(got.astype(mx.float32) - want).max().item()


def enable(layout: Layout | None = None) -> bool:
    """Let the kernels run from now on, if CUDA is here and the self-checks agree with the plain
    path (bf16 outputs of order 1: a few ulps), checked on ``layout`` (the model's, see ``Layout``;
    None: the default variants). Each variant's first launch costs ~1.7-2 s on the H200 even with
    its NVRTC output in MLX's disk cache ("H200: auto or off as the default, side by side"), so
    the check runs only the variants the model launches. ``MLXQ_CUDA_ATTENTION=mlx`` keeps the
    plain path. Runs once per process; ``check_report`` says what it ran and found."""
    global _kernels, _checked, _report
    if not _checked and mx.cuda.is_available() and os.environ.get("MLXQ_CUDA_ATTENTION", "").lower() != "mlx":
        _checked = True  # once: a batch forming groups again does not repeat a failed check
        layout = checkable(layout)
        began = time.perf_counter()
        _report = {"layout": layout.describe() if layout is not None else "default (bf16, with and without sinks)"}
        try:
            errors = self_check(layout=layout)
        except Exception as exc:  # no compiler, an unsupported GPU: the plain path stays
            log.warning("shared-prefix kernels unavailable (%s: %s)", type(exc).__name__, exc)
            _report |= {"error": f"{type(exc).__name__}: {exc}", "seconds": round(time.perf_counter() - began, 2)}
            return False
        checked = time.perf_counter()
        _kernels = passing_paths(errors, _mma_partials_agree(layout))
        if "mma_prefill" in _kernels and _packs(layout):  # the packed tails' kernel extends the prefill's
            errors["mma_packed"] = _packed_error(layout)
            if errors["mma_packed"] < AGREEMENT:
                _kernels |= {"mma_packed"}
        seconds = time.perf_counter() - began
        _report |= {"seconds": round(seconds, 2), "passed": sorted(_kernels),
                    "max_diff": {path: round(error, 6) for path, error in errors.items()},
                    "path_s": {path: round(t, 2) for path, t in _path_seconds.items()},
                    "mma_partials_s": round(time.perf_counter() - checked, 2)}
        log.info("shared-prefix kernels checked in %.1fs on %s: %s pass", seconds, _report["layout"],
                 ", ".join(sorted(_kernels)) or "none")
        if "mma_gqa" not in _kernels:
            log.warning("shared-prefix kernels disagree with the plain path (max diffs %s)", errors)
    return is_enabled() or enable_metal()


def check_failed() -> str | None:
    """Why the kernels stay off although their self-check ran (None: it passed, or did not run)."""
    if _report is None or is_enabled():
        return None
    return (f"the shared-prefix kernels failed their start-up self-check on {_report['layout']}: "
            f"{_report.get('error') or _report.get('max_diff')}")


def check_report() -> dict | None:
    """What ``enable``'s self-check ran on, how long it took and which paths passed (None: it did not
    run: not CUDA, or no layer shares), for /stats."""
    return _report


def passing_paths(errors: dict[str, float], mma_partials_agree: bool, bound: float = AGREEMENT) -> frozenset[str]:
    """The kernel paths that may run, from ``self_check``'s max differences: ``full`` and ``split`` both
    or none (the base of every other), ``mma`` also needs the tensor-core kernel's own check, ``mma_gqa``
    needs ``gqa`` and ``mma`` too, ``mma_prefill`` the tensor-core kernel's check and its own; a path
    that failed leaves the others on."""
    if max(errors["full"], errors["split"]) >= bound:
        return frozenset()
    passed = {"full", "split"} | {path for path in ("gqa", "mma") if errors.get(path, float("inf")) < bound}
    if not mma_partials_agree:
        passed.discard("mma")
    if {"gqa", "mma"} <= passed and errors.get("mma_gqa", float("inf")) < bound:
        passed.add("mma_gqa")
    if mma_partials_agree and errors.get("mma_prefill", float("inf")) < bound:
        passed.add("mma_prefill")
    return frozenset(passed)


def _mma_partials_agree(layout: Layout | None = None) -> bool:
    """The tensor-core kernel's own check over whole chunks of several staged blocks, with one query
    per row and with a prefill chunk's several (on ``layout``'s heads; a model the kernel does not
    take, not bf16 or of another head width, skips it: its paths stay off)."""
    heads = {} if layout is None else dict(heads=layout.heads, kv_heads=layout.kv_heads, dim=layout.dim)
    if layout is not None and (layout.dtype != mx.bfloat16 or layout.dim not in prefix_mma_kernel.HEAD_DIMS):
        return False
    try:
        prefill = prefix_mma_kernel.self_check(rows=5, positions=9, **heads)
        return max(prefix_mma_kernel.self_check(**heads), prefill) < AGREEMENT
    except Exception as exc:
        log.warning("mma prefix kernel unavailable (%s: %s)", type(exc).__name__, exc)
        return False


def _packs(layout: Layout | None) -> bool:
    """Whether the packed tails' kernel takes ``layout``'s model (bf16, a head width it has, no sinks)."""
    return layout is None or (not layout.sinks and layout.dtype == mx.bfloat16
                              and layout.dim in prefix_mma_kernel.HEAD_DIMS)


def _packed_error(layout: Layout | None = None) -> float:
    """Max |packed tails' kernel - its plain reference| on ``layout``'s heads (kv/packed_tails_kernel.py);
    infinite where it does not build."""
    heads = {} if layout is None else dict(heads=layout.heads, kv_heads=layout.kv_heads, dim=layout.dim)
    began = time.perf_counter()
    try:
        return packed_tails_kernel.self_check(**heads)
    except Exception as exc:
        log.warning("packed tails' kernel unavailable (%s: %s)", type(exc).__name__, exc)
        return float("inf")
    finally:
        _path_seconds["mma_packed"] = time.perf_counter() - began


def packed_kernel_on() -> bool:
    """Whether a packed tails' forward may attend through kv/packed_tails_kernel.py (its start-up check
    passed, and no benchmark or test forced another path)."""
    return "mma_packed" in _kernels and _forced is None


def _grouped_ready() -> bool:
    """The grouped kernel path, checked once on its first use (a batch of several groups, which only
    ``--shared-prefix-attention on`` forms): failing the check keeps just that path on plain
    operations, and servers that never group twice never run it."""
    global _grouped_enabled
    if _grouped_enabled is None and is_enabled():
        try:
            error = grouped_self_check()
        except Exception as exc:
            log.warning("grouped shared-prefix kernel path unavailable (%s: %s)", type(exc).__name__, exc)
            error = float("inf")
        _grouped_enabled = error < AGREEMENT
        if not _grouped_enabled:
            log.warning("grouped shared-prefix kernel path disagrees with the plain path (max diff %s)", error)
    return bool(_grouped_enabled)


def is_enabled() -> bool:
    return "split" in _kernels


def _metal_route(shape: CallShape) -> str:
    """On Metal, once the kernel's check passed: the kernel for one query per row below
    METAL_MAX_GROUP_TOKENS, where the CUDA gqa kernel (the same plan: every row re-reads the prefix)
    measured faster than the prefix as GEMMs; the plain path (those GEMMs) for larger groups,
    prefill chunks and quantized K/V. Neither side was measured on Metal."""
    if shape.quantized or shape.queries > 1 or not shape.metal or shape.group_tokens >= METAL_MAX_GROUP_TOKENS:
        return "ops"
    return "metal"


def enable_metal() -> bool:
    """Let kv/metal_decode_kernel.py run from now on if its check agrees with the plain path on this
    device in every dtype it takes (once). A kernel that does not build (no Metal back-end, a compile
    error, an API MLX lacks) or disagrees keeps the plain path: said in the log and in /stats
    (``kernel_status``). ``MLXQ_METAL_ATTENTION=mlx`` keeps the plain path without a check. Off
    Metal (CPU, CUDA) it does nothing: ``enable`` asks it after the CUDA kernels' check."""
    global _kernels, _metal_checked, _declined
    if not metal_decode_kernel.on_metal():
        return False
    if _metal_checked:
        return "metal" in _kernels
    _metal_checked = True
    if os.environ.get("MLXQ_METAL_ATTENTION", "").lower() == "mlx":
        _declined = "MLXQ_METAL_ATTENTION=mlx"
        return False
    try:
        errors = metal_decode_kernel.self_check()
    except Exception as exc:
        _declined = f"the Metal decode kernel did not run ({type(exc).__name__}: {exc})"
        log.warning("shared-prefix attention stays on plain operations: %s", _declined)
        return False
    failed = metal_decode_kernel.disagreeing(errors)
    if failed:
        _declined = f"the Metal decode kernel disagrees with the plain path (max diffs {failed})"
        log.warning("shared-prefix attention stays on plain operations: %s", _declined)
        return False
    _kernels = frozenset({"metal"})
    log.info("shared-prefix Metal decode kernel on (max diffs to the plain path %s)", errors)
    return True


def kernel_status() -> dict:
    """/stats.batch.shared_prefix.kernels: the kernel paths that may run (none before their check),
    why a backend's kernel was turned down (on Metal; None otherwise) and what the CUDA start-up
    self-check ran, took and found (``check_report``; None where it did not run)."""
    return {"paths": sorted(_kernels), "declined": _declined, "check": _report}
