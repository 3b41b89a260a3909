"""Prompt-cache lookups: the entry-by-entry scan against the prefix tree, side by side in one run.

    python scripts/bench_prefix_lookup.py --prefix 10000 --entries 25 300 1000

N entries share one ``--prefix``-token system prompt and differ in a 50-token
tail (the agents load). Each lookup is a prompt of the prefix, one entry's
tail and a fresh turn. *scan* is the former RAM tier's lookup: every entry
compared with the prompt token by token (store.prefix.usable_prefix), which
is what ``take`` ran on the engine thread. *tree* is the prefix tree's
lookup (the walk ``take`` does before assembling caches); *tree take* adds
assembling the row's caches (one full-attention layer of 1x1 heads, so the
copy costs next to nothing and the number is the lookup's overhead). *SSD
tree* is the SSD tier's lookup over the same prefixes as node files (the
shared prompt's file and one file per tail, as a restart indexes them from
their headers; before the tree the SSD tier ran the scan).
Prints a markdown table; the median of ``--repeat`` lookups per cell, in CPU
time of this process (``time.process_time``: on a shared machine, wall time
would also count other processes' turns on the cores).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxq.store.prefix import usable_prefix
from mlxq.store.prompt_cache import PromptCache
from mlxq.store.ssd_tree import FileNode, attach, make_root, search, served_at_snapshots

TAIL = 50


def agents(prefix: int, entries: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 30000) for _ in range(prefix)]
    return shared, [shared + [rng.randrange(1, 30000) for _ in range(TAIL)] for _ in range(entries)]


def tiny_caches(tokens: list[int]) -> list[KVCache]:
    cache = KVCache()
    x = mx.zeros((1, 1, len(tokens), 1), mx.float16)
    cache.update_and_fetch(x, x)
    return [cache]


def scan(entries: list[tuple[int, ...]], prompt: list[int]) -> int:
    """The former lookup: every entry, token by token."""
    best = 0
    for tokens in entries:
        best = max(best, usable_prefix(tokens, True, prompt))
    return best


def file_tree(shared: list[int], prompts: list[list[int]]) -> FileNode:
    """The node files a restart would index for these prompts (no files: the tree is built from headers)."""
    root = make_root("")
    head = FileNode(None, "shared", root, 0, tuple(shared), 0, 0.0, True, True)
    attach(root, head)
    for i, tokens in enumerate(prompts):
        attach(head, FileNode(None, str(i), head, len(shared), tuple(tokens[len(shared):]), 0, 0.0, True, True))
    return root


def timed_ms(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        samples.append((time.process_time() - start) * 1e3)
    return statistics.median(samples)


def measure(prefix: int, entries: int, repeat: int) -> dict:
    shared, prompts = agents(prefix, entries)
    tree = PromptCache(1 << 40)
    for tokens in prompts:
        tree.put("", tokens, tiny_caches(tokens))
    flat = [tuple(p) for p in prompts]
    files = file_tree(shared, prompts)
    asked = prompts[len(prompts) // 2] + [7, 8, 9]
    want = len(asked) - 3
    assert scan(flat, asked) == want and tree._lookup("", asked)[2] == want
    assert search(files, asked, len(asked) - 1, served_at_snapshots).n == want
    return {
        "entries": entries,
        "scan_ms": timed_ms(lambda: scan(flat, asked), max(3, repeat // max(1, entries // 25))),
        "tree_ms": timed_ms(lambda: tree._lookup("", asked), repeat),
        "take_ms": timed_ms(lambda: mx.eval(tree.take("", asked)[0][0].keys), repeat),
        "ssd_ms": timed_ms(lambda: search(files, asked, len(asked) - 1, served_at_snapshots), repeat),
        "nodes": tree.nodes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=10000)
    parser.add_argument("--entries", type=int, nargs="+", default=[25, 300, 1000])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    print(f"machine: {platform.machine()} {platform.processor() or ''}, python {platform.python_version()}; "
          f"prefix {args.prefix} tokens + {TAIL}-token tails")
    print("| entries | tree nodes | scan (ms) | tree lookup (ms) | tree take (ms) | scan / tree "
          "| SSD tree lookup (ms) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.entries:
        r = measure(args.prefix, n, args.repeat)
        print(f"| {r['entries']} | {r['nodes']} | {r['scan_ms']:.2f} | {r['tree_ms']:.3f} | {r['take_ms']:.3f} "
              f"| {r['scan_ms'] / r['tree_ms']:.0f}x | {r['ssd_ms']:.3f} |")


if __name__ == "__main__":
    main()
