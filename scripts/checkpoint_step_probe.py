"""Where checkpoints cost a batch's decode steps: one Engine, variants of the publish path side by side.

    python scripts/checkpoint_step_probe.py --model DIR --rows 32 --tokens 576 --out OUT

The server's Engine in-process (its warm-up, memory limits, SSD tier and
``--checkpoint-interval``, 256 unless ``--interval``), ``--rows`` greedy rows of ``--tokens``
tokens (``ignore_eos``) submitted at once per run, runs one after the other
with the publish path changed between them (each change undone after its
run). The first runs after start-up are slower whatever they change (on the
H200 an 8B model's first two took 39.6 and 22.1 ms per step, the third
15.4): put throwaway runs first, and each variant next to an ``on`` run.

A run is named by ``off`` (no checkpoints: the scheduler's ``checkpoints``
unset for the run) or ``on`` (as shipped), or by changes joined with
``+``:

- ``nohold``: a written link's host-read buffers go back to MLX's buffer
  cache at once (store/spent_buffers.py holds them until the engine
  clears the cache), where a later device allocation can take them;
- ``keep``: the writer keeps every link's buffers alive to the end of the
  run;
- ``nowrite``: the writer registers each link without reading or writing its
  bytes (no disk, no host reads);
- ``nohost``: no move of the Packs to host memory (with ``nowrite``);
- ``hostonly``: the writer moves each link's Packs to host memory and
  registers the link (no hashing, no disk);
- ``nodisk``: as ``hostonly``, and hashes every tensor (no disk);
- ``nohash``: the link written to disk with placeholder checksums;
- ``pyhash``: the writer as it was: python-xxhash (which holds the GIL
  while it hashes) and a seek and a write per tensor (``write_steps``),
  instead of ``write_file``'s GIL-free hashing and few ``pwritev``;
- ``sync``: the staged copies evaluated at once (the engine thread waits for
  them before building the next step);
- ``ops``: the copy by MLX operations instead of the kernel;
- ``rowsN``: at most N due rows stage in one step (instead of an eighth of
  the batch), ``mibM``: up to M MiB of copies per step (instead of
  ``STAGE_BYTES_PER_STEP``; ``mib32`` was its former value);
- ``pyspy``: under ``py-spy record --native --threads --idle`` for
  ``--pyspy-seconds`` (raw stacks in ``OUT/pyspy-<run>.txt``).

Per run: decode tok/s per request (the engine's usage), the decode step in
its parts (``/stats batch.decode_timing``), and each step's wall time
grouped by its distance from the last step that staged a link (0: the
staging step itself; 1, 2, 3: the steps after; ``far``: the others), which
says whether the cost sits at the publishes or on every step. Writes
``probe.json``; prints a line per run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import xxhash

from mlxq.engine import checkpoint_rows, checkpoint_spans, checkpoint_staging
from mlxq.engine.engine import Engine, EngineConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.models.loader import load_model
from mlxq.store import checkpoints as checkpoints_module
from mlxq.store import mlxkv, xxh3
from mlxq.store.checkpoint_pack import Pack
from mlxq.store.checkpoints import CheckpointStore
from mlxq.store.ssd_config import SsdConfig


@contextmanager
def patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _no_write(store, job) -> None:
    store._register(job)  # durable as far as the chain goes: the next link chains on


def _keeping(original, kept: list):
    def run(store, job):
        original(store, job)
        kept.append(job.layers)
    return run


def _tensors(job):
    return [t for _, _, named in job.layers for _, t in named]


def _host_only(store, job) -> None:
    for t in _tensors(job):
        t.host_bytes()
    store._register(job)


def _no_disk(store, job) -> None:
    for t in _tensors(job):
        xxh3.hexdigest(t.host_bytes())
    store._register(job)


def _stepped_write(path, header, layers, host_bytes) -> None:
    for _ in mlxkv.write_steps(path, header, layers, host_bytes=host_bytes):
        pass


def _no_host(flat, host_side):
    return Pack(flat)


def _sync_stage(original):
    def stage(self, items):
        original(self, items)
        mx.eval(*(p.flat for item in items for p in item.link.packs))  # the device copy, not the host move
    return stage


def variant_patches(changes: set[str], kept: list, store):
    """The context managers that make a run with ``changes`` (see the module's doc)."""
    rows = []
    if "keep" in changes:
        rows.append(patched(CheckpointStore, "_run", _keeping(CheckpointStore._run, kept)))
    if "nohold" in changes and store is not None:
        rows.append(patched(store.spent, "hold", False))
    if "nowrite" in changes:
        rows.append(patched(CheckpointStore, "_run", _no_write))
    if "hostonly" in changes:
        rows.append(patched(CheckpointStore, "_run", _host_only))
    if "nodisk" in changes:
        rows.append(patched(CheckpointStore, "_run", _no_disk))
    if "nohash" in changes:
        rows.append(patched(mlxkv, "xxh3", SimpleNamespace(hexdigest=lambda data: "0" * 32)))
    if "pyhash" in changes:
        rows.append(patched(mlxkv, "xxh3", SimpleNamespace(hexdigest=xxhash.xxh3_128_hexdigest)))
        rows.append(patched(checkpoints_module, "write_file", _stepped_write))
    if "nohost" in changes:
        rows.append(patched(checkpoint_spans, "host_side_pack", _no_host))
    if "sync" in changes:
        rows.append(patched(checkpoint_staging.StagedLinks, "stage",
                            _sync_stage(checkpoint_staging.StagedLinks.stage)))
    if "ops" in changes:
        rows.append(patched(checkpoint_spans, "_kernel_checked", lambda count, dtype: False))
    for change in changes:
        if change.startswith("rows") and change[4:].isdigit():
            rows.append(patched(checkpoint_rows, "publishes_per_step", lambda batch, n=int(change[4:]): n))
        if change.startswith("mib") and change[3:].isdigit():
            rows.append(patched(checkpoint_rows, "STAGE_BYTES_PER_STEP", int(change[3:]) * 2**20))
    return rows


class StepLog:
    """Each decode step's wall time and whether it staged links (wraps the scheduler's decode step)."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.steps: list[tuple[float, bool]] = []
        self.gaps: list[float] = []  # from a step's end to the next one's start (the engine loop's other work)
        self._inner = scheduler._decode_step
        self._ended: float | None = None

    def __call__(self) -> None:
        start = time.perf_counter()
        if self._ended is not None and self.scheduler.batch.rows:
            self.gaps.append(start - self._ended)
        self._inner()
        self._ended = time.perf_counter()
        took = self._ended - start
        checkpoints = self.scheduler.checkpoints  # a step publishes the last one's links, then stages its own
        self.steps.append((took, checkpoints is not None and len(checkpoints.batch_staged) > 0))

    def by_distance(self) -> dict:
        groups: dict[str, list[float]] = {}
        last = None
        for i, (took, staged) in enumerate(self.steps):
            if staged:
                last = i
            distance = None if last is None else i - last
            key = str(distance) if distance is not None and distance <= 3 else "far"
            groups.setdefault(key, []).append(took)
        return {k: {"steps": len(v), "mean_ms": round(1000 * statistics.fmean(v), 3),
                    "median_ms": round(1000 * statistics.median(v), 3)} for k, v in sorted(groups.items())}


class Parts:
    """Wall time of the checkpoint path's parts on the engine thread, each wrapped on its instance for a
    run: staging (the due rows' links described, ``_staged_links``, and their copies queued,
    ``StagedLinks.stage``), publishing the last step's links (``StagedLinks.publish``), and the cache
    clear after a step (``_clear_cache``, where spent buffers are let go)."""

    def __init__(self, sched) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list = []
        self._wrap(sched, "_clear_cache", "clear_cache")
        checkpoints = sched.checkpoints
        if checkpoints is not None:
            self._wrap(sched, "_stage_due", "stage_due")
            self._wrap(sched, "_staged_links", "describe")
            self._wrap(checkpoints.batch_staged, "stage", "queue_copies")
            self._wrap(checkpoints.batch_staged, "publish", "publish")

    def _wrap(self, owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr))

    def undo(self) -> None:
        for owner, attr in self._undo:
            delattr(owner, attr)  # the instance attribute goes: the class's method again

    def as_dict(self, steps: int) -> dict:
        return {name: {"calls": self.calls[name], "ms": round(1000 * total, 2),
                       "per_call_ms": round(1000 * total / self.calls[name], 3),
                       "per_step_ms": round(1000 * total / max(steps, 1), 4)} for name, total in self.totals.items()}


def _pyspy(path: Path, seconds: int):
    """py-spy on this process (native frames, every thread, idle ones too), or None without py-spy."""
    exe = shutil.which("py-spy")
    if exe is None:
        print("py-spy not found: the run goes on without it", flush=True)
        return None
    try:  # Yama's ptrace scope 1 lets only ancestors attach: let py-spy, a child, attach to its parent
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(2**64 - 1), 0, 0, 0)  # PR_SET_PTRACER, ANY
    except (OSError, AttributeError):
        pass
    return subprocess.Popen([exe, "record", "--pid", str(os.getpid()), "--native", "--threads", "--idle",
                             "--rate", "25", "--format", "raw", "--duration", str(seconds), "-o", str(path)])


def run_once(engine, name: str, rows: int, tokens: int, tag: str, offset: int, vocab: int, out: Path,
             pyspy_seconds: int) -> dict:
    sched = engine.scheduler
    checkpoints = sched.checkpoints
    log = StepLog(sched)
    sched._decode_step = log
    before = dict(sched.timing.as_dict()["totals"], steps=sched.timing.steps)
    written = dict(vars(checkpoints.store.counters)) if checkpoints is not None else {}
    rates: list[float] = []
    done = threading.Semaphore(0)
    changes = set(name.split("+"))
    spy = _pyspy(out / f"pyspy-{tag}.txt", pyspy_seconds) if "pyspy" in changes else None
    kept: list = []
    with ExitStack() as stack:
        for patch in variant_patches(changes, kept, None if checkpoints is None else checkpoints.store):
            stack.enter_context(patch)
        if "off" in changes:
            stack.enter_context(patched(sched, "checkpoints", None))
        parts = Parts(sched)
        stack.callback(parts.undo)
        engine.call_between_steps(mx.reset_peak_memory, 60)  # MLX called on the engine thread only
        for i in range(rows):
            def emit(event):
                if event.finish_reason is not None:
                    rates.append(event.usage.decode_tok_s)
                    done.release()
            prompt = [(1000 + 37 * offset + 7 * i + j) % vocab for j in range(24)]
            engine.submit(Request(f"{tag}-{i}", prompt, SamplingParams(), tokens, ignore_eos=True), emit)
        for _ in range(rows):
            done.acquire()
        if checkpoints is not None:
            engine.flush_cache(120)  # the last step's staged links published (engine thread), then written
    if spy is not None:
        spy.wait(timeout=60)
    kept.clear()
    del sched._decode_step
    memory = engine.call_between_steps(lambda: (mx.get_peak_memory(), mx.get_cache_memory()), 60)
    after = dict(sched.timing.as_dict()["totals"], steps=sched.timing.steps)
    steps = after["steps"] - before["steps"]
    split = {k[:-2] + "_ms": round(1000 * (after[k] - before[k]) / max(steps, 1), 3)
             for k in ("step_s", "build_s", "submit_s", "device_wait_s")}
    split["output_ms"] = round(split["step_ms"] - split["build_ms"] - split["submit_ms"] - split["device_wait_ms"], 3)
    counters = vars(checkpoints.store.counters) if checkpoints is not None else {}
    return {"variant": name, "tok_s_median": round(statistics.median(rates), 2), "steps": steps, "split": split,
            "by_distance": log.by_distance(), "staging_steps": sum(s for _, s in log.steps),
            "parts": parts.as_dict(steps),
            "between_steps_ms": round(1000 * statistics.fmean(log.gaps), 3) if log.gaps else None,
            "links": {k: counters[k] - written.get(k, 0) for k in ("written", "dropped", "kernel_links")
                      if k in counters} if name != "off" else {},
            "peak_gb": round(memory[0] / 1e9, 2), "cache_gb": round(memory[1] / 1e9, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=576)
    ap.add_argument("--interval", type=int, default=256, help="--checkpoint-interval")
    ap.add_argument("--variants", default="off,on,nohold,keep,nowrite,nowrite+nohost,sync,ops,off,on+pyspy")
    ap.add_argument("--pyspy-seconds", type=int, default=8)
    ap.add_argument("--warmup", default="auto", help="the engine's warm-up: auto (the server's), on, off")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with tempfile.TemporaryDirectory() as tmp:  # the SSD files: GBs, never under --out
        ssd = SsdConfig(str(Path(tmp) / "ssd"), max_bytes=100 * 10**9, checkpoint_interval=args.interval)
        # The model loads on the engine thread, as the server's does (MLX's GPU streams belong to a thread).
        engine = Engine(lambda: load_model(args.model),
                        EngineConfig(max_rows=args.rows, kv_budget_auto=True, warmup=args.warmup, ssd=ssd))
        engine.start()
        while not engine.ready.wait(1):
            if engine.fatal_error:
                raise SystemExit(f"the engine failed to start: {engine.fatal_error}")
        results = []
        for n, name in enumerate(args.variants.split(",")):
            try:
                result = run_once(engine, name, args.rows, args.tokens, f"run{n}", n, engine.loaded.vocab_size,
                                  args.out, args.pyspy_seconds)
            except Exception as exc:  # the other variants still run
                traceback.print_exc()
                result = {"variant": name, "error": f"{type(exc).__name__}: {exc}"}
            results.append(result)
            print(json.dumps(result), flush=True)
            (args.out / "probe.json").write_text(json.dumps(results, indent=1) + "\n")
        engine.stop(30)


if __name__ == "__main__":
    main()
