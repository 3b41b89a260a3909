"""Where an SSD restore's time goes on this host, stage by stage (page-cached file, no model).

    python scripts/bench_restore_stages.py            # prints one JSON line: GB/s per stage and round

Stages, over 64 buffers of one 12k-token tensor of the Llama-3-8B KV shape
(8 KV heads x 128 x bf16 = 24.6 MB): fresh MLX buffers (``mx.zeros`` on the
CPU stream, evaluated: allocation and first touch), the file read into them
(``os.preadv``), xxh3-128 over them; and the other route, a read into fresh
numpy buffers, then ``mx.array``. Run it with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
to see what transparent huge pages change.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import mlx.core as mx
import numpy as np
import xxhash

TENSOR = 24_576_000


def one_round(path: str, buffers: int) -> dict:
    mx.clear_cache()
    start = time.perf_counter()
    arrays = [mx.zeros((TENSOR // 2,), mx.bfloat16, stream=mx.cpu) for _ in range(buffers)]
    mx.eval(arrays)
    allocated = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    for i, a in enumerate(arrays):
        os.preadv(fd, [memoryview(a).cast("B")], (i % 8) * TENSOR)
    read = time.perf_counter()
    for a in arrays:
        xxhash.xxh3_128_hexdigest(memoryview(a).cast("B"))
    hashed = time.perf_counter()
    host = [np.empty(TENSOR, np.uint8) for _ in range(8)]
    for i, h in enumerate(host):
        os.preadv(fd, [memoryview(h)], i * TENSOR)
    os.close(fd)
    staged = time.perf_counter()
    mx.eval([mx.array(h) for h in host])
    copied = time.perf_counter()
    total = buffers * TENSOR
    return {"mlx_alloc_fill_gb_s": total / (allocated - start) / 1e9,
            "read_into_mlx_gb_s": total / (read - allocated) / 1e9,
            "hash_gb_s": total / (hashed - read) / 1e9,
            "read_into_numpy_gb_s": 8 * TENSOR / (staged - hashed) / 1e9,
            "numpy_to_mlx_gb_s": 8 * TENSOR / (copied - staged) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buffers", type=int, default=64, help="tensors per round (64: one 12k-token 8B prefix)")
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile() as f:
        f.write(os.urandom(8 * TENSOR))
        f.flush()
        open(f.name, "rb").read()  # into the OS page cache
        rounds = {r: {k: round(v, 2) for k, v in one_round(f.name, args.buffers).items()} for r in range(3)}
    print(json.dumps({"glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "rounds": rounds}))


if __name__ == "__main__":
    main()
