"""A burst's tails' forward on a shared prefix: left-padded to the longest vs packed, side by side.

    python scripts/packed_tails_forward.py --model DIR --cases 64x16000+40-66,64x2200+40-66,64x16000+56 \
        --json-out packed-tails.json
    python scripts/packed_tails_forward.py --model DIR --cases 6x300+3-12,4x300+5 --reps 2   # CPU, tiny model

A case ``RxP+LO-HI`` is R rows on a prefix of P random tokens, each row's
tail of LO-HI tokens (drawn uniformly, ``--seed``; ``+N``: all N). The
prefix is prefilled once (a solo cache, 2048 tokens a forward); each rep
builds fresh empty tails over it (SharedPrefixBatchCache layers, as
kv/packed_tails.probe_disagreement builds them), evaluated untimed, then
times one forward of the tails plus the evaluation of each row's last
logits and every layer's tail K/V, two ways:

- ``padded``: [R, W] tokens, each row left-padded to the longest tail W;
- ``packed``: T rows of one token (T the tails' own tokens) through
  kv/packed_tails.PackedTailsCache (the host-side ``Packing.of`` is timed
  apart: ``packing_ms``); on CUDA, once its check passed, its attention is
  one kernel (kv/packed_tails_kernel.py);
- ``parts`` (only where that kernel runs): packed, its attention in three
  parts (the prefix kernel's level, the tails in plain operations, merged).

Reps alternate (padded, packed[, parts], then the reverse, ...) after one
untimed warm-up of each. Per case: median ms of each, ``packed_over_padded``
(below 1: packing pays), T against the grid R x W (``padding_share``: the
cells the padded forward computes for nothing), and the packed logits
against the padded ones at each row's last token (float32): on the CPU in
float32 ``max_logit_diff`` is 0.0 and ``argmax_agree`` 1.0; on the GPU in
bf16 a GEMM's other row count moves the rounding, argmax stays ~1.0.
``kernels`` says whether the CUDA shared-prefix kernels passed their checks.
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
from mlxq.kv.packed_tails import PackedTailsCache, Packing, packed_positions
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache
from mlxq.models.loader import load_model


def parse_case(text: str) -> tuple[int, int, int, int]:
    """``64x16000+40-66`` -> (64, 16000, 40, 66); ``64x16000+56`` -> (64, 16000, 56, 56)."""
    rows, rest = text.split("x")
    prefix, tails = rest.split("+")
    lo, _, hi = tails.partition("-")
    return int(rows), int(prefix), int(lo), int(hi or lo)


def prefill_prefix(model, tokens: mx.array) -> list[tuple[mx.array, mx.array]]:
    """Each layer's prefix (keys, values), from one solo forward in chunks of 2048 tokens."""
    cache = make_prompt_cache(model)
    length = tokens.shape[1]
    for start in range(0, length, 2048):
        model(tokens[:, start:start + 2048], cache=cache)
        mx.eval([c.state for c in cache])
    spans = [(c.keys[..., :length, :], c.values[..., :length, :]) for c in cache]
    mx.eval(spans)
    return spans


def targets(prefix: list, padding: list[int], width: int) -> list[SharedPrefixBatchCache]:
    """Empty tails, right-aligned (``padding`` per row), over the shared ``prefix``: evaluated."""
    capacity = -(-width // BatchKVCache.step) * BatchKVCache.step
    out = []
    for keys, values in prefix:
        tail = BatchKVCache(padding)
        tail.keys, tail.values = (mx.zeros((len(padding), a.shape[1], capacity, a.shape[3]), a.dtype)
                                  for a in (keys, values))
        out.append(SharedPrefixBatchCache.grouped([(keys, values)], tail, [0] * len(padding)))
    mx.eval([(c.tail.keys, c.tail.values, c.tail.offset, c.tail.left_padding) for c in out])
    return out


def ways() -> tuple[str, ...]:
    """The ways compared: ``parts`` only where the packed tails' kernel runs (elsewhere it is ``packed``)."""
    return ("padded", "packed", "parts") if shared_prefix_decode.packed_kernel_on() else ("padded", "packed")


def forward(model, prefix, tails: list[list[int]], way: str) -> tuple[float, float, mx.array]:
    """(ms of the forward and its evaluation, host ms of ``Packing.of``, [B, vocab] float32 last logits)."""
    packed = way != "padded"
    lengths = [len(t) for t in tails]
    width = max(lengths)
    padding = [width - n for n in lengths]
    caches = targets(prefix, padding, width)
    packing_ms = 0.0
    if packed:
        start = time.perf_counter()
        packing = Packing.of(padding, lengths)
        packing_ms = 1000 * (time.perf_counter() - start)
        positions = packed_positions(caches[0], packing)
        tokens = mx.array([[x] for t in tails for x in t])
        layers = [PackedTailsCache(c, packing, positions) for c in caches]
    else:
        tokens = mx.array([[0] * p + t for p, t in zip(padding, tails, strict=True)])
        layers = caches
    three_parts = shared_prefix_decode.forced("mma_prefill") if way == "parts" else contextlib.nullcontext()
    start = time.perf_counter()
    with three_parts:
        out = model(tokens, cache=layers)
        logits = (out[packing.ends, 0] if packed else out[:, -1]).astype(mx.float32)
        mx.eval(logits, [(c.tail.keys, c.tail.values) for c in caches])
    ms = 1000 * (time.perf_counter() - start)
    del out, layers, caches
    mx.clear_cache()
    return ms, packing_ms, logits


def run_case(model, vocab: int, text: str, reps: int, seed: int) -> dict:
    rows, prefix_len, lo, hi = parse_case(text)
    rng = np.random.default_rng(seed)
    prefix = prefill_prefix(model, mx.array(rng.integers(0, vocab, (1, prefix_len)), mx.int32))
    lengths = [int(n) for n in rng.integers(lo, hi + 1, rows)]
    tails = [[int(x) for x in rng.integers(0, vocab, n)] for n in lengths]
    for way in ways():  # warm-ups: compilation
        forward(model, prefix, tails, way)
    times: dict[str, list[float]] = {way: [] for way in ways()} | {"packing": []}
    logits: dict[str, mx.array] = {}
    for rep in range(reps):
        for way in ways() if rep % 2 == 0 else ways()[::-1]:
            ms, packing_ms, logits[way] = forward(model, prefix, tails, way)
            times[way].append(ms)
            if way == "packed":
                times["packing"].append(packing_ms)
    median = {way: float(np.median(t)) for way, t in times.items()}
    tokens, grid = sum(lengths), rows * max(lengths)
    agree = (logits["padded"].argmax(axis=-1) == logits["packed"].argmax(axis=-1)).astype(mx.float32)
    parts = {} if "parts" not in times else {
        "parts_ms": median["parts"], "packed_over_parts": median["packed"] / median["parts"],
        "parts_max_logit_diff": mx.abs(logits["parts"] - logits["packed"]).max().item(), "parts_all_ms": times["parts"]}
    return {**parts, "case": text, "rows": rows, "prefix": prefix_len, "tail_lengths": [lo, hi],
            "padded_ms": median["padded"], "packed_ms": median["packed"], "packing_ms": median["packing"],
            "packed_over_padded": median["packed"] / median["padded"],
            "tokens": tokens, "grid": grid, "padding_share": 1 - tokens / grid,
            "max_logit_diff": mx.abs(logits["padded"] - logits["packed"]).max().item(),
            "argmax_agree": agree.mean().item(), "padded_all_ms": times["padded"], "packed_all_ms": times["packed"]}


def run_fresh(model, vocab: int, text: str, reps: int, seed: int) -> dict:
    """As a server sees bursts: every rep draws new tail lengths (a new packed shape each time; the
    padded width, the longest tail, repeats more often), run padded and packed in alternating order.
    Medians over the reps, first runs at a shape included."""
    rows, prefix_len, lo, hi = parse_case(text)
    rng = np.random.default_rng(seed)
    prefix = prefill_prefix(model, mx.array(rng.integers(0, vocab, (1, prefix_len)), mx.int32))
    times: dict[str, list[float]] = {}
    for rep in range(reps):
        lengths = [int(n) for n in rng.integers(lo, hi + 1, rows)]
        tails = [[int(x) for x in rng.integers(0, vocab, n)] for n in lengths]
        for way in ways() if rep % 2 == 0 else ways()[::-1]:
            times.setdefault(way, []).append(forward(model, prefix, tails, way)[0])
    return {"case": text, "fresh": True, **{f"{way}_ms": float(np.median(t)) for way, t in times.items()},
            **{f"{way}_all_ms": t for way, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an mlx-lm model directory")
    parser.add_argument("--cases", default="64x16000+40-66,64x2200+40-66,64x16000+56",
                        help="rows x prefix + tail length (LO-HI: drawn per row; N: all N), comma separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", help="write the results here")
    parser.add_argument("--fresh", action="store_true",
                        help="new tail lengths every rep (``run_fresh``): what a server's bursts see")
    args = parser.parse_args()
    loaded = load_model(args.model)
    cuda_attention.install()
    attention_route.install()  # routes SharedPrefixBatchCache/PackedTailsCache; on CUDA checks and enables the kernels
    shared_prefix_decode.enable()
    results = []
    for case in filter(None, args.cases.split(",")):
        if args.fresh:
            r = run_fresh(loaded.model, loaded.vocab_size, case, args.reps, args.seed)
            results.append(r)
            medians = {k: round(v, 1) for k, v in r.items() if k.endswith("_ms") and not k.endswith("_all_ms")}
            print(case, "fresh shapes:", medians, flush=True)
            continue
        r = run_case(loaded.model, loaded.vocab_size, case, args.reps, args.seed)
        results.append(r)
        print(f"{case}: padded {r['padded_ms']:.2f} ms, packed {r['packed_ms']:.2f} ms "
              f"(x{r['packed_over_padded']:.3f}, packing {r['packing_ms']:.2f} ms host); "
              f"T={r['tokens']} of {r['grid']} cells ({100 * r['padding_share']:.1f}% padding); "
              f"max|dlogit| {r['max_logit_diff']:.3g}, argmax agree {r['argmax_agree']:.3f}"
              + (f"; three-part attention {r['parts_ms']:.2f} ms (kernel x{r['packed_over_parts']:.3f}, "
                 f"max|dlogit| {r['parts_max_logit_diff']:.3g})" if "parts_ms" in r else ""), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": str(mx.default_device()), "model": args.model, "reps": args.reps,
                       "seed": args.seed, "kernels": shared_prefix_decode.is_enabled(),
                       "check": shared_prefix_decode.check_report(), "cases": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
