"""A burst of agents on a cached prefix, in process: the scheduler's steps until every row has token 0.

    python scripts/burst_step_probe.py --model DIR --rows 64 --prefix 2195 --out probe.json

Stores one ``--prefix``-token prompt in a RAM prompt cache, then ``--rounds``
times adds ``--rows`` requests (that prefix plus a tail of 40-64 tokens of
their own) at once and runs ``BatchScheduler.step()`` until each has its
first token. Odd rounds time every step whole (what a server pays); even
rounds put an evaluation fence after each stage (lease, merge, forward, row
moves, views, join, decode) and time the stages apart, so their sum is
larger than the unfenced step. The first round pays kernel compilation
(``--first-fenced`` fences it too, to see which stage pays; each round reports
how many kernels MLX's CUDA JIT cache holds, ``ptx_files``, so a round that
compiled kernels shows). ``--sharing auto,off`` runs both in one process, one
scheduler each, in that order. ``--warm`` runs the engine's start-up warm-up
(engine/warmup.py, with the prompt cache and sharing policy) first and times it.
``--arrivals``: the requests reach the scheduler one by one, the burst held
as a GPU server holds it, and the engine thread's work for that (admission
check, add, held step per arrival) is timed (``admit_one_by_one_ms``).
``--timeline``: the unfenced rounds record host time per stage (nothing fenced:
entry and exit of the scheduler's stages, evaluations included, nested), so
the steps from admission to token 0 show as a timeline: where the engine
thread builds graphs, where it waits on the device (``eval:*``, and the gaps:
reads of results), and which stage runs while the device is idle.
``--stored-head N``: each row's first N own tokens are the same every round, so
from the second round on each row leases the prefix plus N tokens of the chain
its previous round stored (a different chain per row, as in a server whose
agents' questions share their first tokens with stored ones).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
import time
from contextlib import ExitStack
from dataclasses import replace
from unittest import mock

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxq.engine import joining, prefill, running_batch, shared_tails, tail_placement
from mlxq.engine.burst_hold import BurstHold
from mlxq.engine.prefix_sharing import SharingPolicy
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.transient import ModelShape
from mlxq.engine.types import Request, SamplingParams
from mlxq.engine.warmup import warm_up
from mlxq.kv import attention_route, cuda_attention
from mlxq.kv.packed_tails import PackedTailsCache
from mlxq.kv.projection import measure_footprint
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache
from mlxq.kv.sharing_plan import plan_sharing
from mlxq.models.loader import load_model
from mlxq.store.prompt_cache import PromptCache


def _arrays(value) -> list:
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    if isinstance(value, SharedPrefixBatchCache):
        value = value.tail  # its state is the tail's (the prefix is referenced)
    state = getattr(value, "state", None)
    return _arrays(state) if state is not None and not callable(state) else []


class Fences:
    """Wraps functions so each call is evaluated and timed apart (ms summed per stage and call count)."""

    def __init__(self):
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn):
        def fenced(*args, **kwargs):
            mx.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(_arrays(out) + [a for arg in args for a in _arrays(arg)])
            mx.synchronize()
            self.ms[name] = round(self.ms.get(name, 0.0) + 1000 * (time.perf_counter() - start), 1)
            self.calls[name] = self.calls.get(name, 0) + 1
            return out
        return fenced


class Timeline:
    """Host time per stage, unfenced: wrapped callables record (depth, name, start, end); repeated calls
    of one name under one parent are summed into one line."""

    def __init__(self):
        self.events: list[list] = []  # [depth, name, start_s, end_s, calls]
        self._depth = 0
        self._open: list[int] = []
        self.t0 = time.perf_counter()

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            label = name(args, kwargs) if callable(name) else name
            parent = self._open[-1] if self._open else None
            last = self.events[-1] if self.events else None
            merge = (last is not None and last[0] == self._depth and last[1] == label
                     and (parent is None or self.events.index(last) > parent))
            start = time.perf_counter()
            if not merge:
                self.events.append([self._depth, label, start, start, 0, 0.0])
            entry = self.events[-1] if not merge else last
            self._open.append(self.events.index(entry))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self._open.pop()
                end = time.perf_counter()
                entry[3] = end
                entry[4] += 1
                entry[5] += end - start
        return timed

    def rows(self) -> list[dict]:
        return [{"at_ms": round(1000 * (start - self.t0), 2), "ms": round(1000 * busy, 2), "calls": calls,
                 "stage": "  " * depth + name} for depth, name, start, _, calls, busy in self.events]

    def print(self) -> None:
        for row in self.rows():
            print(f"    {row['at_ms']:9.2f} {row['ms']:8.2f} x{row['calls']:<3} {row['stage']}", flush=True)


def _model_stage(args: tuple, kwargs: dict) -> str:
    """A model call's stage: one position per row is a decode step, unless the rows are packed tails
    (kv/packed_tails.py: a prefill of one token per row)."""
    caches = kwargs.get("cache") or [None]
    if args[0].shape[1] > 1 or isinstance(caches[0], PackedTailsCache):
        return "model(prefill)"
    return "model(decode)"


def timeline_patches(stack: ExitStack, sched: BatchScheduler, timeline: Timeline) -> None:
    """The scheduler's stages from admission to token 0, each timed on the host (no fence)."""
    for name in ("step", "_intake", "_plan_and_prefill", "_prefill", "_advance_together", "_lease_sources",
                 "_shared_tails", "_placed_tails", "_placed", "_placed_forward", "_packed_forward",
                 "_right_padded_forward",
                 "_advanced", "_snapshot", "_start_decoding", "_join_shared_tails", "_decode_or_shed",
                 "_decode_step", "_sample", "_emit", "_evict", "_shed_before_decode"):
        if hasattr(sched, name):
            stack.enter_context(mock.patch.object(sched, name, timeline.wrap(name, getattr(sched, name))))
    for module, name in ((tail_placement, "gather_prefixes"), (prefill, "view_rows"),
                         (shared_tails, "tails_group"), (shared_tails, "prefix_from_spans"),
                         (shared_tails, "place_rows"), (prefill, "tails_in_place")):
        if hasattr(module, name):
            stack.enter_context(mock.patch.object(module, name, timeline.wrap(name, getattr(module, name))))
    stack.enter_context(mock.patch.object(sched.faults, "run", timeline.wrap(lambda a, kw: f"eval:{a[0]}",
                                                                             sched.faults.run)))
    model = sched.model
    stack.enter_context(mock.patch.object(sched, "model", timeline.wrap(_model_stage, model)))
    for name in ("eval", "async_eval"):
        stack.enter_context(mock.patch.object(mx, name, timeline.wrap(f"mx.{name}", getattr(mx, name))))


class FencedModel:
    def __init__(self, model, fences: Fences):
        self.model, self.fences = model, fences

    def __call__(self, *args, **kwargs):
        stage = "decode_forward" if args[0].shape[1] == 1 else "prefill_forward"
        return self.fences.wrap(stage, self.model)(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def scheduler_for(model, tokenizer, rows: int, sharing: str) -> BatchScheduler:
    plan = plan_sharing(model) if sharing != "off" else None
    policy = SharingPolicy(sharing, plan)
    cache = PromptCache(8_000_000_000)
    config = SchedulerConfig(max(rows, 128), 4, 2048, None, token0_in_decode=True, shape=ModelShape.of(model))
    return BatchScheduler(model, tokenizer, measure_footprint(model), config, prompt_cache=cache, sharing=policy)


def store_prefix(sched: BatchScheduler, model, prefix: list[int]) -> None:
    caches = make_prompt_cache(model)
    for start in range(0, len(prefix), 2048):
        model(mx.array([prefix[start : start + 2048]]), cache=caches)
        mx.eval([c.state for c in caches])
    sched.prompt_cache.put("", prefix, caches)


def tail_of(row: int, round_no: int, stored_head: int) -> list[int]:
    """Row ``row``'s own tokens: its first ``stored_head`` the same every round (so it leases the
    prefix plus those tokens of the chain its previous round stored, as agents whose questions share
    their first tokens with stored ones do in a server), the rest new each round."""
    head = [(row * 31 + j * 11) % 5000 + 100 for j in range(stored_head)]
    return head + [(round_no * 977 + row * 31 + j * 7) % 5000 + 100 for j in range(40 + (row * 7) % 25 - stored_head)]


def admit_one_by_one(sched: BatchScheduler, requests: list) -> float:
    """The engine thread's work for a burst reaching it a request at a time, held as a GPU server holds
    it (engine/burst_hold.py) from its first request on: per arrival the admission check, the add and
    a held step; returns its ms in all (host time: nothing is evaluated), then lets the hold end."""
    now = [0.0]
    config, clock = sched.config, sched.clock
    sched.config, sched.clock = replace(config, burst=BurstHold(window_s=3600.0, gap_s=3600.0)), lambda: now[0]
    sched.await_arrival = lambda timeout: None
    sched._admissions = (-0.002, -0.001)  # as if the burst had begun: its first request is held too
    spent = 0.0
    try:
        for request, emit in requests:
            start = time.perf_counter()
            if not sched.can_admit(request):
                raise RuntimeError(f"{request.request_id} was not admitted")
            sched.add(request, emit)
            sched.step()
            spent += time.perf_counter() - start
            now[0] += 0.001
    finally:
        sched.config, sched.clock = config, clock
    return round(1000 * spent, 1)


def one_round(sched: BatchScheduler, prefix: list[int], rows: int, round_no: int, fences: Fences | None,
              stored_head: int = 0, arrivals: bool = False, timeline: Timeline | None = None) -> dict:
    firsts: dict[str, float] = {}
    t0 = time.perf_counter()

    def emitter(rid):
        def emit(event):
            if rid not in firsts and getattr(event, "token_id", None) is not None:
                firsts[rid] = time.perf_counter() - t0
        return emit

    with ExitStack() as stack:
        if fences is not None:
            stack.enter_context(mock.patch.object(sched, "model", FencedModel(sched.model, fences)))
            for module, name in ((prefill, "merge_with_room"), (prefill, "merge_for_tails"),
                                 (prefill, "finalize_chunks"), (prefill, "view_rows"), (prefill, "extract_row"),
                                 (joining, "merge_solo_rows"),
                                 (running_batch, "extend_batch"), (running_batch, "_grouped_caches"),
                                 (running_batch, "share_groups"), (shared_tails, "share_groups"),
                                 (shared_tails, "prefix_from_spans"), (tail_placement, "gather_prefixes")):
                # The stages the code under test has (an older one lacks some). With the gather, the merge
                # reads the stored spans and not the leases' caches, which its fence would evaluate.
                gathered = hasattr(tail_placement, "gather_prefixes")
                if hasattr(module, name) and not (gathered and name == "merge_for_tails"):
                    stack.enter_context(mock.patch.object(module, name, fences.wrap(name, getattr(module, name))))
            stack.enter_context(mock.patch.object(sched, "_own_tails", fences.wrap("own_tails", sched._own_tails)))
            stack.enter_context(mock.patch.object(sched.prompt_cache, "lease",
                                                  fences.wrap("lease", sched.prompt_cache.lease)))
            stack.enter_context(mock.patch.object(sched.prompt_cache, "put", fences.wrap("put",
                                                                                         sched.prompt_cache.put)))
        if timeline is not None:
            timeline_patches(stack, sched, timeline)
        requests = [(Request(f"r{round_no}-{i}", prefix + tail_of(i, round_no, stored_head), SamplingParams(), 8,
                             ignore_eos=True), emitter(f"r{round_no}-{i}")) for i in range(rows)]
        if arrivals:
            admit_ms = admit_one_by_one(sched, requests)
        else:
            for request, emit in requests:
                sched.add(request, emit)
        added = time.perf_counter() - t0
        steps = []
        while len(firsts) < rows and len(steps) < 64:
            start = time.perf_counter()
            joiners = sched.num_prefilling
            sched.step()
            mx.synchronize()
            steps.append({"ms": round(1000 * (time.perf_counter() - start), 1), "joiners_before": joiners,
                          "rows": sched.num_rows, "first_tokens": len(firsts)})
    while not sched.is_idle:
        sched.step()
    ttfts = sorted(firsts.values())
    return {"round": round_no, "fenced": fences is not None, "add_ms": round(1000 * added, 1),
            "admit_one_by_one_ms": admit_ms if arrivals else None,
            "ttft_ms_p50": round(1000 * ttfts[len(ttfts) // 2], 1),
            "ttft_ms_max": round(1000 * ttfts[-1], 1), "steps": steps,
            "stages_ms": dict(fences.ms) if fences else None, "stage_calls": dict(fences.calls) if fences else None,
            "timeline": timeline.rows() if timeline is not None else None,
            "copies": sched.batch.copies.as_dict(), "groups": sched.sharing_stats.groups, "ptx_files": ptx_files()}


def ptx_files() -> int:
    """Kernels in MLX's CUDA JIT cache (MLX_PTX_CACHE_DIR, else <tmp>/mlx/<version>/ptx): a round that
    compiled kernels adds files."""
    root = os.environ.get("MLX_PTX_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "mlx", "*", "ptx")
    return len(glob.glob(os.path.join(root, "*.ptx")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=2195)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sharing", default="auto", help="off, auto or on; several comma-separated: one after another")
    ap.add_argument("--first-fenced", action="store_true", help="fence round 0 too (and not round 1)")
    ap.add_argument("--warm", action="store_true", help="run the engine's start-up warm-up first, timed")
    ap.add_argument("--stored-head", type=int, default=0,
                    help="each row's first N own tokens repeat every round: rows lease different stored chains")
    ap.add_argument("--arrivals", action="store_true",
                    help="requests reach the scheduler one by one, the burst held: time the engine's work for that")
    ap.add_argument("--submit-every", type=int, default=None,
                    help="layers of a placed forward built between submissions (tail_placement.SUBMIT_EVERY); "
                         "more than the model's layers: the whole forward built first")
    ap.add_argument("--timeline", action="store_true",
                    help="unfenced rounds record each stage's host time (a timeline to token 0)")
    ap.add_argument("--out", default="burst-step-probe.json")
    args = ap.parse_args()
    loaded = load_model(args.model)
    if args.submit_every is not None and hasattr(tail_placement, "SUBMIT_EVERY"):
        tail_placement.SUBMIT_EVERY = args.submit_every
    cuda_attention.install()  # as the engine does after a load
    modes = args.sharing.split(",")
    if any(mode != "off" for mode in modes):
        attention_route.install()  # turns the shared-prefix kernels on (their self-checks), then routes per batch
        attention_route.uninstall()
    prefix = [(7 * j) % 5000 + 100 for j in range(args.prefix)]
    results: dict[str, list] = {}
    for mode in modes:
        sched = scheduler_for(loaded.model, loaded.tokenizer, args.rows, mode)
        if args.warm:
            start, before = time.perf_counter(), ptx_files()
            warm_up(loaded.model, loaded.tokenizer, sched.scheme, 2048, sched)
            print(json.dumps({"sharing": mode, "warm_up_ms": round(1000 * (time.perf_counter() - start), 1),
                              "ptx_files": [before, ptx_files()]}), flush=True)
        store_prefix(sched, loaded.model, prefix)
        results[mode] = []
        for round_no in range(args.rounds):
            fenced = (round_no % 2 == 0) if args.first_fenced else bool(round_no % 2)
            timeline = Timeline() if args.timeline and not fenced else None
            results[mode].append(one_round(sched, prefix, args.rows, round_no, Fences() if fenced else None,
                                           args.stored_head, args.arrivals, timeline))
            print(json.dumps({"sharing": mode} | {k: v for k, v in results[mode][-1].items()
                                                  if k not in ("steps", "timeline")}), flush=True)
            if timeline is not None:
                timeline.print()
            print("  steps:", json.dumps(results[mode][-1]["steps"]), flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f)


if __name__ == "__main__":
    main()
