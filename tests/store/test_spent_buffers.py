"""Checkpoint buffers the host read on MLX's CPU stream wait, once written, until the engine clears MLX's
cache (where they are freed rather than handed to a device allocation); the others go at once."""

from __future__ import annotations

import time

import mlx.core as mx

from mlxq.store import spent_buffers
from mlxq.store.checkpoint_links import CheckpointRecord
from mlxq.store.checkpoint_pack import Pack, PackedTensor
from mlxq.store.checkpoints import CheckpointStore
from mlxq.store.mlxkv import Identity
from mlxq.store.spent_buffers import SpentBuffers


def link(moved: bool, fill: float) -> tuple[list, Pack]:
    """One layer's keys and values of 3 tokens in one Pack; ``moved``: read through the CPU stream (by the
    writer thread), as the batch lane's Packs are on CUDA."""
    keys, values = mx.full((1, 2, 3, 4), fill), mx.full((1, 2, 3, 4), -fill)
    flat = mx.concatenate([keys.reshape(-1), values.reshape(-1)]).view(mx.uint8)
    pack = Pack(flat, host_side=moved)
    mx.async_eval(*pack.arrays)  # scheduled by this thread, as the engine thread stages them
    tensors = [PackedTensor(pack, at * keys.nbytes, keys.nbytes, tuple(keys.shape), keys.dtype) for at in (0, 1)]
    return [("kv", {"offset": 3}, [("keys", tensors[0]), ("values", tensors[1])])], pack


def test_written_links_host_read_buffers_wait_until_released(tmp_path):
    store = CheckpointStore(tmp_path, Identity("f" * 16, "native", ""))
    store.spent = SpentBuffers(hold=True)
    for n, moved in enumerate((True, False, True)):
        layers, _ = link(moved, float(n))
        record = CheckpointRecord(f"{n}" * 32, 1, (5, 6), 7, None, time.time())
        assert store.publish(record, [1, 5, 6], layers, True)
    assert store.flush(10).durable and store.as_dict()["written"] == 3
    assert store.spent.nbytes == 2 * 2 * 2 * 3 * 4 * 4  # the two moved links' Packs, held
    for n in range(3):
        record, caches = store.load(f"{n}" * 32)  # written whole
        assert mx.array_equal(caches[0].keys[..., :3, :], mx.full((1, 2, 3, 4), float(n))).item()
    assert store.spent.release() == 384 and store.spent.nbytes == 0


def test_elsewhere_nothing_is_held_and_a_full_hold_says_so(monkeypatch):
    loose = SpentBuffers(hold=False)
    loose.add([object()], 10**12)
    assert loose.nbytes == 0 and not loose.over_cap()
    monkeypatch.setattr(spent_buffers, "MAX_HELD_BYTES", 100)
    held = SpentBuffers(hold=True)
    held.add(["a"], 60)
    assert not held.over_cap()
    held.add(["b"], 60)
    assert held.over_cap() and held.release() == 120 and not held.over_cap()
