"""What the checkpoint writer thread costs a thread that needs the GIL (the engine thread's position).

    python scripts/bench_checkpoint_writer.py --arrays 64 --array-kb 512 --rate 3 --seconds 1 --phases 4

A stand-in for the engine thread runs Python work between GIL releases (an
MLX evaluation, as a decode step's submit and reads do) for ``--seconds``,
alone, then while store/checkpoints.py's writer thread puts links on disk
at ``--rate`` links per second (``--arrays`` tensors of ``--array-kb`` KiB
each, already on the host: what the writer gets from a staged link; an 8B
link is 64 x 512 KiB), ``--phases`` times. The loop's median rate with the writer over its rate alone
is what the writer's GIL turns (and, on a machine with few cores, its CPU
work) cost the engine; also printed, the writer's own pace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arrays", type=int, default=64)
    ap.add_argument("--array-kb", type=int, default=512)
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--seconds", type=float, default=1.0, help="each phase's length")
    ap.add_argument("--phases", type=int, default=4, help="alone / with the writer pairs, alternating")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    layers = link_layers(args.arrays, args.array_kb * 1024)
    alone, together = [], []
    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(Path(tmp), Identity("f" * 16, "native", ""))
        for _ in range(args.phases):  # alternating, so drifts in the machine's speed hit both alike
            alone.append(engine_loop(args.seconds))
            stop = threading.Event()
            publisher = threading.Thread(target=publish_at, args=(store, layers, 1024, args.rate, stop))
            publisher.start()
            together.append(engine_loop(args.seconds))
            stop.set()
            publisher.join()
            store.flush(60)
        written = store.counters.written
    alone_rate, together_rate = statistics.median(alone), statistics.median(together)
    summary = {"arrays": args.arrays, "array_kb": args.array_kb, "rate": args.rate, "seconds": args.seconds,
               "loop_per_s": {"alone": round(alone_rate), "with_writer": round(together_rate)},
               "with_over_alone": round(together_rate / alone_rate, 4),
               "links_written_per_s": round(written / (args.seconds * args.phases), 2)}
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "checkpoint-writer.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
