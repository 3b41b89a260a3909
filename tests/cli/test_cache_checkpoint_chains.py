"""`mlxq cache` on generation checkpoint chains: one line per request, chains verified, pruned from the top."""

from __future__ import annotations

import json
import os

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from typer.testing import CliRunner

from mlxq.cli.main import app
from mlxq.engine.checkpointing import owned_layers
from mlxq.store.checkpoints import CheckpointRecord, CheckpointStore
from mlxq.store.mlxkv import Identity
from mlxq.store.ssd_config import CHECKPOINT_DIR

IDENTITY = Identity("a" * 16, "native", "")
KEY = "c" * 32


def write_chain(root, links: int = 3, per_link: int = 4096) -> list:
    """A request's chain of ``links`` links of ``per_link`` tokens each (float32 KV, 2 heads x 8)."""
    store = CheckpointStore(root / IDENTITY.directory / CHECKPOINT_DIR, IDENTITY)
    kv = KVCache()
    kv.update_and_fetch(mx.ones((1, 2, links * per_link, 8)), mx.ones((1, 2, links * per_link, 8)))
    prompt = [1] * per_link
    for n in range(1, links + 1):
        emitted = tuple([2] * (n * per_link - len(prompt)))
        view = KVCache()
        view.keys, view.values, view.offset = kv.keys, kv.values, n * per_link
        start = (n - 1) * per_link
        assert store.publish(CheckpointRecord(KEY, len(prompt), emitted, 3, None, 0.0), prompt + list(emitted),
                             owned_layers([view], start), True, start)
    assert store.flush(10).durable
    paths = sorted(store.directory.iterdir(), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    for age, path in enumerate(reversed(paths)):  # the first link the least recently used
        os.utime(path, (1e9 - age, 1e9 - age))
    return paths


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_ls_shows_one_line_per_request_and_verify_checks_the_chain(tmp_path):
    paths = write_chain(tmp_path)
    shown = run("cache", "ls", str(tmp_path)).stdout
    assert "generation checkpoints: 1 requests, 3 files" in shown and KEY in shown
    rows = [r for r in json.loads(run("cache", "ls", str(tmp_path), "--json").stdout) if r["kind"] == "checkpoint"]
    assert sorted((r["start"], r["end"]) for r in rows) == [(0, 4096), (4096, 8192), (8192, 12288)]
    assert run("cache", "verify", str(tmp_path)).exit_code == 0
    paths[0].unlink()  # the first link: the two above it can never restore
    result = run("cache", "verify", str(tmp_path))
    assert result.exit_code == 1 and result.stdout.count("BAD") == 2


def test_a_write_cut_by_a_crash_is_shown_under_its_request(tmp_path):
    """A kill during a link's write leaves ``<key>-<end>.mlxkv.tmp`` (no header yet): still one request."""
    paths = write_chain(tmp_path)
    cut = paths[-1].with_name(f"{KEY}-16384.mlxkv.tmp")
    cut.write_bytes(paths[-1].read_bytes()[:100])
    shown = run("cache", "ls", str(tmp_path)).stdout
    assert "generation checkpoints: 1 requests, 4 files" in shown and "16384.mlxkv.tmp" in shown
    rows = [r for r in json.loads(run("cache", "ls", str(tmp_path), "--json").stdout) if r["kind"] == "checkpoint"]
    assert [r["durable"] for r in rows].count(False) == 1


def test_prune_by_size_takes_the_newest_link_before_its_parents(tmp_path):
    paths = write_chain(tmp_path)
    total = sum(p.stat().st_size for p in paths)
    result = run("cache", "prune", str(tmp_path), "--max-bytes", str(total - 1))
    assert result.exit_code == 0, result.stdout
    # the first link is the least recently used, but a link goes only with those above it: the top one goes
    assert [p.exists() for p in paths] == [True, True, False]
