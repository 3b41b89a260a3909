"""Whole-model decode steps for a group of rows on one shared prefix: per-row copies vs shared.

    python scripts/shared_prefix_step.py --preset llama3-8b --cases 64x2048+300,16x12288+300,64x16384+300
    python scripts/shared_prefix_step.py --preset small --cases 16x512+64,4x1536+64   # CPU

For each case (rows x shared prefix + own tokens per row) the prefix is
prefilled once; each row's own tokens are random K/V of the model's shape
(attention cost does not depend on their values). Then ``--steps`` greedy
decode steps of the whole model are timed for:

- ``copies``: every row holds its own copy of the prefix in a BatchKVCache
  (today's batch lane; on CUDA its decode attention is mlxq's decode
  kernel: kv/gqa_decode_kernel.py), skipped when the copies would not fit
  in ``--max-copies-gb``; on CUDA also ``copies_per_head``, the same
  through kv/decode_kernel.py (one block per row and query head);
- ``shared_ops``: SharedPrefixBatchCache with the plain-operations path;
- ``shared_full`` / ``shared_split`` / ``shared_gqa`` / ``shared_mma`` /
  ``shared_mma_gqa``: the same with each CUDA path of
  kv/shared_prefix_decode.py (CUDA only; ``--paths`` picks; ``auto``: the
  route's own choice, once per cache and query shape; ``auto_each``: the
  route worked out on every call). A path named twice is timed twice
  (both orders in one run: ``mma_gqa,auto,auto,mma_gqa``).

Also: the first step's max logit difference of each shared path to the
copies (bf16 rounding carried through the layers on the GPU), and with
``auto`` the path the route picks for the case's decode shape.

``--prefill-cases`` (rows x prefix + chunk) times the tails' prefill
instead: one forward of a chunk of that many tokens per row on a shared
prefix (engine/shared_tails.py's forward), for ``--prefill-paths``:
``ops_whole`` (plain operations, the prefix's scores in one product),
``ops`` (the same in blocks of kv/shared_prefix_attention.SCORE_BLOCK
scores), ``mma_prefill`` (the tensor-core prefix, CUDA; ``mma_prefill_w8``:
the one-tile cut of 8 warps instead of ``PREFILL_TILING``), and ``copies``
(per-row copies of the prefix through the model's own attention, where
they fit in ``--max-copies-gb``). Median of ``--prefill-reps`` after a
warm-up forward; logits of the last position against ``ops_whole``
(``--logits-out``: also saved, to compare two builds' runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlxq.kv import attention_route, cuda_attention, shared_prefix_decode
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache


def parse_case(text: str) -> tuple[int, int, int]:
    rows, rest = text.split("x")
    prefix, own = rest.split("+")
    return int(rows), int(prefix), int(own)


def prefill_prefix(model, length: int, vocab: int) -> list:
    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, vocab, (1, length))
    for start in range(0, length, 2048):
        model(tokens[:, start:start + 2048], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def batch_tail(keys: mx.array, values: mx.array, prefix: mx.array | None = None) -> BatchKVCache:
    """A right-aligned BatchKVCache over ``keys`` (rows x own), behind per-row copies of ``prefix``."""
    if prefix is not None:
        keys = mx.concatenate([mx.repeat(prefix[0], keys.shape[0], 0), keys], axis=2)
        values = mx.concatenate([mx.repeat(prefix[1], keys.shape[0], 0), values], axis=2)
    cache = BatchKVCache([0] * keys.shape[0])
    cache.keys, cache.values = keys, values
    cache.offset = cache.offset + keys.shape[2]
    cache._idx = keys.shape[2]
    return cache


def caches_for(prefix_cache: list, rows: int, own: int, shared: bool) -> list:
    mx.random.seed(1)  # the same tails for every path
    out = []
    for layer in prefix_cache:
        pk, pv = layer.keys[:, :, :layer.offset], layer.values[:, :, :layer.offset]
        shape = (rows, pk.shape[1], own, pk.shape[3])
        tk, tv = (mx.random.normal(shape).astype(pk.dtype) for _ in range(2))
        out.append(SharedPrefixBatchCache(pk, pv, batch_tail(tk, tv)) if shared else batch_tail(tk, tv, (pk, pv)))
    mx.eval([c.keys if not shared else c.tail.keys for c in out])
    return out


def time_steps(model, caches: list, rows: int, steps: int) -> tuple[float, mx.array]:
    tokens = mx.zeros((rows, 1), mx.int32)
    first = model(tokens, cache=caches)[:, -1, :].astype(mx.float32)
    mx.eval(first)
    start = time.perf_counter()
    for _ in range(steps):
        tokens = model(tokens, cache=caches)[:, -1, :].argmax(axis=-1)[:, None]
        mx.eval(tokens)
    return 1000 * (time.perf_counter() - start) / steps, first


def run_case(model, vocab, rows, prefix, own, steps, max_copies_gb, paths) -> dict:
    mx.random.seed(0)
    prefix_cache = prefill_prefix(model, prefix, vocab)
    layers = len(prefix_cache)
    per_token = sum(c.keys.shape[1] * c.keys.shape[3] * c.keys.itemsize * 2 for c in prefix_cache)
    result = {"rows": rows, "prefix": prefix, "own": own, "copies_gb": rows * (prefix + own) * per_token / 1e9,
              "shared_gb": (prefix + rows * own) * per_token / 1e9, "layers": layers}
    result["auto_path"] = routed_path(model, prefix_cache[0].keys[:, :, :prefix], rows, own)
    reference = None
    if result["copies_gb"] <= max_copies_gb:
        result["copies_ms"], reference = time_steps(model, caches_for(prefix_cache, rows, own, False), rows, steps)
        print(f"  {rows}x{prefix}+{own} copies: {result['copies_ms']:.2f} ms/step", flush=True)
        mx.clear_cache()
        if cuda_attention._gqa:
            cuda_attention._gqa = False  # the per-head kernel, side by side
            ms, logits = time_steps(model, caches_for(prefix_cache, rows, own, False), rows, steps)
            cuda_attention._gqa = True
            result["copies_per_head_ms"], result["copies_per_head_logit_diff"] = ms, mx.abs(
                logits - reference).max().item()
            mx.clear_cache()
    seen: dict[str, int] = {}
    for path in paths if shared_prefix_decode.is_enabled() else ("ops",):
        seen[path] = seen.get(path, 0) + 1  # a path named twice (both orders, e.g. mma_gqa,auto,auto,mma_gqa)
        name = f"shared_{path}" + (f"_{seen[path]}" if seen[path] > 1 else "")
        with _decode_path(path):
            ms, logits = time_steps(model, caches_for(prefix_cache, rows, own, True), rows, steps)
        result[f"{name}_ms"] = ms
        if reference is not None:
            result[f"{name}_logit_diff"] = mx.abs(logits - reference).max().item()
        print(f"  {rows}x{prefix}+{own} {name}: {ms:.2f} ms/step", flush=True)  # a run cut short keeps these
        mx.clear_cache()
    for key in [k for k in result if k.endswith("_ms")]:
        result[key.replace("_ms", "_tok_s")] = rows * 1000 / result[key]
    return result


def time_prefill(model, make_caches, rows: int, length: int, vocab: int, reps: int) -> tuple[float, mx.array]:
    """Median ms of one forward of ``length`` tokens per row on fresh caches (after a warm-up)."""
    tokens = mx.random.randint(0, vocab, (rows, length), key=mx.random.key(2))
    times, logits = [], None
    for rep in range(reps + 1):
        caches = make_caches()
        start = time.perf_counter()
        logits = model(tokens, cache=caches)[:, -1, :].astype(mx.float32)
        mx.eval(logits, [c.tail.state if isinstance(c, SharedPrefixBatchCache) else c.state for c in caches])
        if rep:
            times.append(1000 * (time.perf_counter() - start))
        del caches
        mx.clear_cache()
    return sorted(times)[len(times) // 2], logits


def prefill_case(model, vocab, rows, prefix, length, reps, max_copies_gb, paths, logits_out=None) -> dict:
    """The tails' prefill: one forward of ``length`` tokens per row on a shared ``prefix``."""
    mx.random.seed(0)
    prefix_cache = prefill_prefix(model, prefix, vocab)
    per_token = sum(c.keys.shape[1] * c.keys.shape[3] * c.keys.itemsize * 2 for c in prefix_cache)
    result = {"rows": rows, "prefix": prefix, "chunk": length, "copies_gb": rows * prefix * per_token / 1e9}
    spans = [(c.keys[:, :, :c.offset], c.values[:, :, :c.offset]) for c in prefix_cache]

    def shared():
        return [SharedPrefixBatchCache(pk, pv, BatchKVCache([0] * rows)) for pk, pv in spans]

    def copies():
        empty = [(mx.repeat(pk[:, :, :0], rows, 0), mx.repeat(pv[:, :, :0], rows, 0)) for pk, pv in spans]
        return [batch_tail(*none, prefix) for none, prefix in zip(empty, spans, strict=True)]

    reference = None
    for path in paths:
        if path == "copies" and result["copies_gb"] > max_copies_gb:
            continue
        if path.startswith("mma_prefill") and not shared_prefix_decode.is_enabled():
            continue
        with _prefill_path(path):
            ms, logits = time_prefill(model, copies if path == "copies" else shared, rows, length, vocab, reps)
        result[f"{path}_ms"] = ms
        reference = logits if reference is None else reference
        result[f"{path}_logit_diff"] = mx.abs(logits - reference).max().item()
        if logits_out:  # to compare builds: one file per case and path
            np.save(f"{logits_out}-{rows}x{prefix}+{length}-{path}.npy", np.array(logits))
        print(f"  prefill {rows}x{prefix}+{length} {path}: {ms:.1f} ms", flush=True)
    return result


@contextlib.contextmanager
def _prefill_path(path: str):
    from mlxq.kv import shared_prefix_attention

    if path == "copies":
        yield
    elif path == "ops_whole":
        block = shared_prefix_attention.SCORE_BLOCK
        shared_prefix_attention.SCORE_BLOCK = 1 << 62
        try:
            with shared_prefix_decode.forced("ops"):
                yield
        finally:
            shared_prefix_attention.SCORE_BLOCK = block
    elif path == "mma_prefill_w8":
        from mlxq.kv import prefix_mma_kernel

        tiling = prefix_mma_kernel.PREFILL_TILING
        prefix_mma_kernel.PREFILL_TILING = prefix_mma_kernel.Tiling(warps=8)
        try:
            with shared_prefix_decode.forced("mma_prefill"):
                yield
        finally:
            prefix_mma_kernel.PREFILL_TILING = tiling
    else:
        with shared_prefix_decode.forced(path):
            yield


@contextlib.contextmanager
def _decode_path(path: str):
    """``auto``: as routed (each cache's RouteMemo); ``auto_each``: routed afresh on every call, as
    before the memo; else the path forced."""
    if path == "auto":
        yield
    elif path == "auto_each":
        memo = shared_prefix_decode.RouteMemo.choose
        shared_prefix_decode.RouteMemo.choose = lambda self, *args: shared_prefix_decode.choose(*args)
        try:
            yield
        finally:
            shared_prefix_decode.RouteMemo.choose = memo
    else:
        with shared_prefix_decode.forced(path):
            yield


def routed_path(model, prefix_keys: mx.array, rows: int, own: int) -> str:
    """What ``auto`` picks for a decode step of this case (the route from the call's shape)."""
    _, kv_heads, _, dim = prefix_keys.shape
    q = mx.zeros((rows, model.args.num_attention_heads, 1, dim), prefix_keys.dtype)
    tk = mx.zeros((rows, kv_heads, own, dim), prefix_keys.dtype)
    return shared_prefix_decode.choose(q, prefix_keys, tk, tk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: build --preset with mlxq's factory)")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--cases", default="16x512+64")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max-copies-gb", type=float, default=60.0)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--paths", default="ops,full,split,gqa", help="shared paths to time (CUDA; auto: as routed)")
    parser.add_argument("--prefill-cases", default="", help="rows x prefix + chunk, e.g. 64x14500+56")
    parser.add_argument("--prefill-paths", default="ops_whole,ops,mma_prefill,copies")
    parser.add_argument("--prefill-reps", type=int, default=3)
    parser.add_argument("--logits-out", help="save each prefill's last-position logits as PREFIX-CASE-PATH.npy")
    args = parser.parse_args()
    import mlx_lm

    from mlxq.models.tiny import build_tiny_model

    path = args.model or str(build_tiny_model("llama", f"/tmp/mlxq-models/{args.preset}", preset=args.preset,
                                              fast_init=args.preset.startswith("llama3")))
    model, tokenizer = mlx_lm.load(path)
    cuda_attention.install()
    attention_route.install()
    results, vocab = [], len(tokenizer.vocab)
    for case in filter(None, args.cases.split(",")):
        rows, prefix, own = parse_case(case)
        results.append(run_case(model, vocab, rows, prefix, own, args.steps, args.max_copies_gb,
                                args.paths.split(",")))
        print(json.dumps(results[-1]), flush=True)
    for case in filter(None, args.prefill_cases.split(",")):
        results.append(prefill_case(model, vocab, *parse_case(case), args.prefill_reps, args.max_copies_gb,
                                    args.prefill_paths.split(","), args.logits_out))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "model": path, "steps": args.steps,
                       "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
