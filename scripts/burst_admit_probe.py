"""The engine thread's host work to take in a cached burst, on prompt-cache spans of the 8B shape.

    python scripts/burst_admit_probe.py --model DIR --prefix 2195,14500 [--sharing auto] --out admit.json

A RAM prompt cache holds, per agent, a ``--prefix``-token system prompt and
its previous question (a stored chain per agent, as in a server after one
wave) in spans of ``--layers`` layers of 8 KV heads of 128 (bf16), whatever
the small ``--model`` is: nothing runs a forward, only host work is timed.
Per prefix: ``leases_ms``, 64 leases of the agents' next prompts (each the
prefix, two stored tokens of its own chain, new ones), and
``caches_ms``, building those leases' caches (what every lease did before
the gather read the stored spans instead); ``admit_ms``, per round, the
scheduler taking the burst one request at a time as a GPU server holds it
(admission check, add, held step per arrival); ``one_pass_ms``, per round, the
burst taken in one pass once it has arrived (admission check and add per
request), with what admission keeps between two steps (``kept``) and read
anew for every request (``anew``), alternating.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from burst_step_probe import admit_one_by_one, scheduler_for, tail_of
from mlx_lm.models.cache import KVCache

from mlxq.engine.types import Request, SamplingParams
from mlxq.models.loader import load_model


def spans_of(tokens: int, layers: int) -> list:
    out = []
    for _ in range(layers):
        cache = KVCache()
        cache.keys, cache.values = (mx.zeros((1, 8, tokens, 128), mx.bfloat16) for _ in range(2))
        cache.offset = tokens
        out.append(cache)
    mx.eval([(c.keys, c.values) for c in out])
    return out


def probe(sched, prefix: list[int], rows: int, layers: int, rounds: int) -> dict:
    stored = spans_of(len(prefix) + 80, layers)
    prompt = lambda row, round_no: prefix + [t % 500 for t in tail_of(row, round_no, 2)]  # noqa: E731
    for row in range(rows):
        sched.prompt_cache.put("", prompt(row, 0), stored)
    start = time.perf_counter()
    leases = [sched.prompt_cache.lease("", prompt(row, 1)) for row in range(rows)]
    leased = time.perf_counter()
    for lease in leases:
        lease.caches  # noqa: B018 (built when first read)
    built = time.perf_counter()
    for lease in leases:
        lease.release()
    admit, one_pass = [], {"kept": [], "anew": []}

    def burst(round_no: int) -> list:
        return [(Request(f"r{round_no}-{row}", prompt(row, round_no), SamplingParams(), 4, ignore_eos=True),
                 lambda event: None) for row in range(rows)]

    def drop() -> None:
        for joiner in list(sched.joiners):  # dropped unprefilled: the stored layers are not the model's
            sched.joiners.remove(joiner)
            sched._let_go(joiner.row)

    for round_no in range(1, rounds + 1):
        admit.append(admit_one_by_one(sched, burst(round_no)))
        drop()
        for how in ("anew", "kept"):  # side by side, alternating
            one_pass[how].append(admit_in_one_pass(sched, burst(round_no), anew=how == "anew"))
            drop()
    return {"prefix": len(prefix), "leases_ms": round(1000 * (leased - start), 1),
            "caches_ms": round(1000 * (built - leased), 1), "admit_ms": admit, "one_pass_ms": one_pass}


def admit_in_one_pass(sched, requests: list, anew: bool) -> float:
    """The engine taking a held burst in once it has arrived: per request the admission check and the add,
    no step between; ``anew``: each check reads every row and joiner again (what admission kept between
    two steps is dropped before each), as it did before it kept them. Host ms in all."""
    start = time.perf_counter()
    for request, emit in requests:
        if anew:
            sched._between = None
        if not sched.can_admit(request):
            raise RuntimeError(f"{request.request_id} was not admitted")
        sched.add(request, emit, arrived=0.0)
    return round(1000 * (time.perf_counter() - start), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prefix", default="2195,14500", help="system prompt tokens; several comma-separated")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sharing", default="off", help="--shared-prefix-attention of the scheduler: off, auto, on")
    ap.add_argument("--out", default="burst-admit-probe.json")
    args = ap.parse_args()
    loaded = load_model(args.model)
    results = []
    for size in (int(p) for p in args.prefix.split(",")):
        sched = scheduler_for(loaded.model, loaded.tokenizer, args.rows, args.sharing)
        results.append(probe(sched, [(7 * j) % 500 + 3 for j in range(size)], args.rows, args.layers, args.rounds))
        print(json.dumps(results[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"rows": args.rows, "layers": args.layers, "results": results}, f)


if __name__ == "__main__":
    main()
