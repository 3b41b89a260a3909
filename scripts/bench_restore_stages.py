"""Where an SSD restore's time goes on this host, stage by stage (page-cached file, no model).

    python scripts/bench_restore_stages.py            # one JSON line per read path

One 12.7k-token prefix of the Llama-3-8B KV shape (32 layers x K/V, each
8 KV heads x 12,700 x 128 bf16 = 26 MB; 1.66 GB) in one file in the OS page
cache, read into MLX arrays by each read path in a *fresh process* (as after
a restart: no buffer MLX or malloc freed before), twice (round 1 shows what
reusing freed buffers changes). Per path: the read (``read_s``), then what the
first use on the default device costs (``use_s``: each tensor grown by one
256-token block, as mlx-lm's KVCache does on the first new token).

Paths:
  zeros       fresh MLX buffers (``mx.zeros`` on the CPU stream, evaluated), ``os.preadv`` into them,
              xxh3 per tensor: the restore before the Load path
  zeros-par   the same buffers, the reads spread over threads, hashing in the threads
  load        ``mx.load`` of a safetensors view of the file (a Python reader): MLX allocates the result
              where the default device wants it and copies the bytes in (on CUDA: a host buffer, then one
              copy to the device), no hashing
  load-par    the same, each tensor's read split over threads
  load-ver    load-par, with every tensor's xxh3 computed by a thread pool over a map of the file at
              the same time (the restore's verification)
  verify      that verification alone
  load-file   ``mx.load`` of a real safetensors file of the same tensors, by path (MLX's own reader threads,
              arrays evaluated together so reads and copies to the device overlap): what a node file
              MLX could open itself would give
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TENSORS = 64
SHAPE = (1, 8, int(os.environ.get("RESTORE_STAGES_TOKENS", "12700")), 128)
NBYTES = 8 * SHAPE[2] * 128 * 2
PATHS = ("zeros", "zeros-par", "load", "load-par", "load-ver", "verify", "load-file")


def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="restore")


def read_zeros(fd: int, threads: int) -> list:
    pool = _pool(threads) if threads > 1 else None
    arrays = []
    for i in range(TENSORS):
        a = mx.zeros(SHAPE, mx.bfloat16, stream=mx.cpu)
        mx.eval(a)
        view = memoryview(a).cast("B")
        if pool is None:
            os.preadv(fd, [view], i * NBYTES)
            xxhash.xxh3_128_hexdigest(view)
        else:
            step = -(-NBYTES // threads)
            list(pool.map(lambda o, v=view, i=i, step=step: os.preadv(fd, [v[o:o + step]], i * NBYTES + o),
                          range(0, NBYTES, step)))
            xxhash.xxh3_128_hexdigest(view)
        arrays.append(a)
    return arrays


def read_load(fd: int, threads: int) -> list:
    from mlxq.store.tensor_view import SafetensorsView, TensorPiece

    pieces = [TensorPiece(f"t{i}", fd, i * NBYTES, NBYTES, SHAPE, "bfloat16") for i in range(TENSORS)]
    pool = _pool(threads) if threads > 1 else None
    view = SafetensorsView(pieces, pool)
    loaded = mx.load(view, format="safetensors")
    return [loaded[f"t{i}"] for i in range(TENSORS)]


def verify(path: str, threads: int) -> list[str]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m, _pool(threads) as pool:
        view = memoryview(m)
        try:
            return list(pool.map(lambda i: xxhash.xxh3_128_hexdigest(view[i * NBYTES:(i + 1) * NBYTES]),
                                 range(TENSORS)))
        finally:
            view.release()


def use(arrays: list) -> None:
    grown = [mx.concatenate([a, mx.zeros((*SHAPE[:2], 256, SHAPE[3]), a.dtype)], axis=2) for a in arrays]
    mx.eval(grown)


def one_path(path: str, kind: str, threads: int) -> dict:
    import mlxq.store.tensor_view  # noqa: F401  (its import, mlx-lm's included, is not a read)

    out = {}
    for r in range(2):
        mx.clear_cache()
        fd = os.open(path, os.O_RDONLY)
        start = time.perf_counter()
        arrays = []
        if kind == "zeros":
            arrays = read_zeros(fd, 1)
        elif kind == "zeros-par":
            arrays = read_zeros(fd, threads)
        elif kind in ("load", "load-par"):
            arrays = read_load(fd, 1 if kind == "load" else threads)
        elif kind == "load-file":
            loaded = mx.load(path + ".safetensors")
            arrays = [loaded[f"t{i}"] for i in range(TENSORS)]
        elif kind == "load-ver":
            with _pool(1) as one:
                checked = one.submit(verify, path, threads)
                arrays = read_load(fd, threads)
                checked.result()
        else:
            verify(path, threads)
        mx.eval(arrays)
        read_s = time.perf_counter() - start
        use(arrays) if arrays else None
        use_s = time.perf_counter() - start - read_s
        os.close(fd)
        gb = TENSORS * NBYTES / 1e9
        out[f"round{r}"] = {"read_s": round(read_s, 4), "read_gb_s": round(gb / read_s, 2),
                            "use_s": round(use_s, 4)}
        del arrays
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=12_700, help="tokens of the prefix")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one path in this process
    parser.add_argument("--file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps({"path": args.one, "threads": args.threads, "device": str(mx.default_device()),
                          **one_path(args.file, args.one, args.threads)}), flush=True)
        return
    os.environ["RESTORE_STAGES_TOKENS"] = str(args.tokens)
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR")) as f:
        block = os.urandom(8 * args.tokens * 128 * 2)
        for _ in range(TENSORS):
            f.write(block)
        f.flush()
        if "load-file" in args.paths:
            with open(f.name + ".safetensors", "wb") as st:
                header = {f"t{i}": {"dtype": "BF16", "shape": [*SHAPE[:2], args.tokens, SHAPE[3]],
                                    "data_offsets": [i * len(block), (i + 1) * len(block)]} for i in range(TENSORS)}
                body = json.dumps(header).encode()
                st.write(len(body).to_bytes(8, "little") + body)
                for _ in range(TENSORS):
                    st.write(block)
        for kind in args.paths.split(","):
            subprocess.run([sys.executable, __file__, "--one", kind, "--file", f.name,
                            "--threads", str(args.threads)], check=False, timeout=120,
                           env={**os.environ, "RESTORE_STAGES_TOKENS": str(args.tokens)})
        if os.path.exists(f.name + ".safetensors"):
            os.unlink(f.name + ".safetensors")


if __name__ == "__main__":
    main()
