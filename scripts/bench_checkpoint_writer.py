"""What the checkpoint writer thread costs a thread that needs the GIL (the engine thread's position).

    python scripts/bench_checkpoint_writer.py --arrays 64 --array-kb 512 --rate 3 --seconds 1 --phases 4

A stand-in for the engine thread runs Python work between GIL releases (an
MLX evaluation, as a decode step's submit and reads do) for ``--seconds``,
alone, then while store/checkpoints.py's writer thread puts links on disk
at ``--rate`` links per second (``--arrays`` tensors of ``--array-kb`` KiB
each, already on the host: what the writer gets from a staged link; an 8B
link is 64 x 512 KiB), ``--phases`` times. The loop's median rate with the writer over its rate alone
is what the writer's GIL turns (and, on a machine with few cores, its CPU
work) cost the engine; also printed, the writer's own pace. ``--writer
steps`` writes as the writer did before ``mlxkv.write_file``: python-xxhash,
which holds the GIL while it hashes, and a seek and a write per tensor;
``--writer both`` measures the two, phase by phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import xxhash

from mlxq.store import checkpoints as checkpoints_module
from mlxq.store import mlxkv
from mlxq.store.checkpoint_links import CheckpointRecord
from mlxq.store.checkpoint_pack import Pack, PackedTensor
from mlxq.store.checkpoints import CheckpointStore
from mlxq.store.mlxkv import Identity


def link_layers(arrays: int, array_bytes: int) -> list:
    pack = Pack(mx.zeros((arrays * array_bytes,), mx.uint8))
    mx.eval(pack.flat)
    shape = (1, 1, array_bytes // 2, 1)
    tensors = [PackedTensor(pack, t * array_bytes, array_bytes, shape, mx.bfloat16) for t in range(arrays)]
    return [("kv", {"offset": array_bytes // 2}, [("keys", tensors[2 * i]), ("values", tensors[2 * i + 1])])
            for i in range(arrays // 2)]


def engine_loop(seconds: float) -> float:
    """Iterations per second of Python work between GIL releases."""
    a = mx.ones((8, 8))
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(100):
            sum(range(50))
        mx.eval(a + n)
        n += 1
    return n / (time.perf_counter() - start)


def publish_at(store: CheckpointStore, layers: list, tokens: int, rate: float, stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        record = CheckpointRecord(f"{n:032x}", 1, tuple(range(tokens - 1)), 0, None, time.time())
        store.publish(record, list(range(tokens)), layers, True)
        stop.wait(1 / rate)


def _stepped_write(path, header, layers, host_bytes) -> None:
    module = mlxkv.xxh3
    mlxkv.xxh3 = SimpleNamespace(hexdigest=xxhash.xxh3_128_hexdigest)  # the writer thread is the only hasher
    try:
        for _ in mlxkv.write_steps(path, header, layers, host_bytes=host_bytes):
            pass
    finally:
        mlxkv.xxh3 = module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arrays", type=int, default=64)
    ap.add_argument("--array-kb", type=int, default=512)
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--seconds", type=float, default=1.0, help="each phase's length")
    ap.add_argument("--phases", type=int, default=4, help="alone / with the writer pairs, alternating")
    ap.add_argument("--writer", choices=("file", "steps", "both"), default="file")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    layers = link_layers(args.arrays, args.array_kb * 1024)
    writers = ("file", "steps") if args.writer == "both" else (args.writer,)
    alone, together = [], {w: [] for w in writers}
    written = dict.fromkeys(writers, 0)
    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(Path(tmp), Identity("f" * 16, "native", ""))
        for _ in range(args.phases):  # alternating, so drifts in the machine's speed hit both alike
            for writer in writers:
                alone.append(engine_loop(args.seconds))
                if writer == "steps":
                    checkpoints_module.write_file = _stepped_write
                before = store.counters.written
                stop = threading.Event()
                publisher = threading.Thread(target=publish_at, args=(store, layers, 1024, args.rate, stop))
                publisher.start()
                together[writer].append(engine_loop(args.seconds))
                stop.set()
                publisher.join()
                store.flush(60)
                checkpoints_module.write_file = mlxkv.write_file
                written[writer] += store.counters.written - before
    alone_rate = statistics.median(alone)
    summary = {"arrays": args.arrays, "array_kb": args.array_kb, "rate": args.rate, "seconds": args.seconds,
               "loop_per_s": {"alone": round(alone_rate),
                              **{f"with_{w}_writer": round(statistics.median(r)) for w, r in together.items()}},
               **{f"{w}_writer_over_alone": round(statistics.median(r) / alone_rate, 4) for w, r in together.items()},
               "links_written_per_s": {w: round(n / (args.seconds * args.phases), 2) for w, n in written.items()}}
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "checkpoint-writer.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
