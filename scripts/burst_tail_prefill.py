"""Where a cached burst's tail prefill goes, in process: merge, forward, row moves; each evaluated apart.

    python scripts/burst_tail_prefill.py --model DIR --rows 40 --prefix 2195 --out probe.json

Builds one stored prefix (a span per layer, as the RAM tier holds it), then
``--rounds`` times: ``--rows`` joiners leasing it merged into one batch
(engine/wave_caches.merge_with_room), one forward of right-padded tails of
40-64 tokens, and the rows moved right by their padding, both by mlx-lm's
``finalize`` (a gather) and by ``finalize_chunks`` (slices) on copies of the
same batch. The first round pays kernel compilation.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxq.engine.wave_caches import finalize_chunks, merge_with_room
from mlxq.models.loader import load_model


def timed(out: dict, name: str, fn):
    mx.synchronize()
    start = time.perf_counter()
    result = fn()
    mx.synchronize()
    out.setdefault(name, []).append(round(1000 * (time.perf_counter() - start), 1))
    return result


def stored_prefix(model, length: int) -> list[tuple]:
    caches = make_prompt_cache(model)
    model(mx.array([[(7 * j) % 5000 + 100 for j in range(length)]]), cache=caches)
    spans = [(c.keys[..., :length, :], c.values[..., :length, :]) for c in caches]
    mx.eval(spans)
    return spans


def leased(spans: list[tuple], length: int) -> list[KVCache]:
    out = []
    for keys, values in spans:
        cache = KVCache()
        cache.keys, cache.values, cache.offset = keys, values, length
        out.append(cache)
    return out


def one_round(model, spans, rows: int, length: int, out: dict) -> None:
    tails = [40 + (i * 7) % 25 for i in range(rows)]
    longest = max(tails)
    joiners = [leased(spans, length) for _ in range(rows)]

    def merge():
        caches = merge_with_room(joiners, longest + 256)
        mx.eval([c.state for c in caches])
        return caches

    caches = timed(out, "merge_ms", merge)
    for cache in caches:
        cache.prepare(lengths=tails, right_padding=[longest - n for n in tails])
    tokens = mx.array([[(i * 31 + j) % 5000 + 100 for j in range(n)] + [0] * (longest - n)
                       for i, n in enumerate(tails)])
    timed(out, "forward_ms", lambda: mx.eval(model(tokens, cache=caches)))
    shifts = [longest - n for n in tails]
    for name, finalize in (("rows_moved_by_gather_ms", lambda c: c.finalize()),
                           ("rows_moved_by_slices_ms", lambda c: finalize_chunks(c, shifts))):
        moved = [copy.copy(c) for c in caches]

        def move(moved=moved, finalize=finalize):
            for cache in moved:
                finalize(cache)
            mx.eval([c.state for c in moved])

        timed(out, name, move)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--prefix", type=int, default=2195)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="burst-tail-prefill.json")
    args = ap.parse_args()
    model = load_model(args.model).model
    spans = stored_prefix(model, args.prefix)
    out: dict = {"rows": args.rows, "prefix": args.prefix}
    for _ in range(args.rounds):
        one_round(model, spans, args.rows, args.prefix, out)
        print(json.dumps(out), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
