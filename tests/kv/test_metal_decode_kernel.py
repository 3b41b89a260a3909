"""The shared-prefix decode kernel for Metal (kv/metal_decode_kernel.py): routed only where its check passed.

Here (no Metal back-end) the route is tested as plain data and the wiring
with the backend predicate injected: the real kernel's build raises on this
machine, which must leave the plain path on and say why. Its agreement with
the plain path needs a Metal device: those tests skip elsewhere.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxq.kv import metal_decode_kernel
from mlxq.kv import shared_prefix_decode as decode
from mlxq.kv.shared_prefix_attention import shared_prefix_attention
from mlxq.kv.shared_prefix_decode import CallShape, route
from mlxq.models.presets import SIZES

ON_METAL = metal_decode_kernel.on_metal()
NEEDS_METAL = pytest.mark.skipif(not ON_METAL, reason="needs MLX's Metal back-end (a Mac's GPU)")
NEEDS_NO_METAL = pytest.mark.skipif(ON_METAL, reason="the kernel builds here: its failure needs no Metal")


def shape(rows=8, prefix=2048, queries=1, quantized=False, metal=True) -> CallShape:
    return CallShape(rows, queries, prefix, quantized, True, True, True, metal)


@pytest.fixture
def unchecked(monkeypatch):
    """enable() as at start-up: nothing checked, no kernel on; restored after the test."""
    monkeypatch.setattr(decode, "_kernels", frozenset())
    monkeypatch.setattr(decode, "_checked", False)
    monkeypatch.setattr(decode, "_metal_checked", False)
    monkeypatch.setattr(decode, "_declined", None)
    monkeypatch.delenv("MLXQ_METAL_ATTENTION", raising=False)


def test_a_metal_call_takes_the_kernel_only_once_its_check_passed():
    """One query per row, a shape the kernel takes, quantized K/V never, group tokens below the bound
    taken over from the CUDA gqa kernel; everything else the plain path."""
    metal = frozenset({"metal"})
    assert route(shape(), frozenset()) == "ops"  # not checked, or the check failed
    assert route(shape(), metal) == "metal"
    assert route(shape(metal=False), metal) == "ops"  # a head width or dtype it does not take
    assert route(shape(queries=7), metal) == "ops"  # a prefill chunk
    assert route(shape(quantized=True), metal) == "ops"
    rows = 64
    assert route(shape(rows, decode.METAL_MAX_GROUP_TOKENS // rows - 1), metal) == "metal"
    assert route(shape(rows, decode.METAL_MAX_GROUP_TOKENS // rows), metal) == "ops"


def test_cpu_and_cuda_routes_do_not_change_with_the_metal_field():
    """The field a Metal shape adds decides nothing where the Metal kernel is not on."""
    for kernels in (frozenset(), frozenset({"full", "split"}), frozenset({"full", "split", "gqa", "mma", "mma_gqa"})):
        for rows, prefix, queries in ((8, 2048, 1), (64, 2048, 1), (64, 16384, 1), (16, 2048, 3)):
            assert route(shape(rows, prefix, queries), kernels) == route(shape(rows, prefix, queries, metal=False),
                                                                        kernels)
    assert route(shape(8, 2048), frozenset({"full", "split", "gqa"})) == "gqa"


def test_the_call_shape_says_which_calls_the_kernel_takes(monkeypatch):
    def arrays(rows=4, heads=8, kv_heads=2, dim=64, queries=1, dtype=mx.float32, tail_dtype=None):
        return (mx.zeros((rows, heads, queries, dim), dtype), mx.zeros((1, kv_heads, 100, dim), dtype),
                mx.zeros((rows, kv_heads, 5, dim), tail_dtype or dtype), mx.zeros((rows, kv_heads, 5, dim), dtype))

    def takes(**kw):
        return decode.call_shape(*arrays(**kw)).metal

    assert ON_METAL or not takes()  # off Metal (CPU, CUDA) the field stays False: their shapes do not change
    monkeypatch.setattr(metal_decode_kernel, "on_metal", lambda: True)
    assert takes() and takes(dim=128, dtype=mx.bfloat16) and takes(dtype=mx.float16)
    assert takes(heads=16, dim=128)  # 8 query heads per KV head at 128: the widest it holds
    assert not takes(heads=18, dim=128)  # 9: wider than a thread's registers hold
    assert not takes(dim=48)  # not a multiple of the 32 lanes
    assert not takes(queries=2)
    assert not takes(tail_dtype=mx.bfloat16)
    # with the kernel on, the route of real arrays and a cache's memo pick it
    monkeypatch.setattr(decode, "_kernels", frozenset({"metal"}))
    q, pk, tk, tv = arrays()
    memo = decode.RouteMemo()
    assert decode.choose(q, pk, tk, tv) == memo.choose(q, pk, tk, tv) == "metal"
    assert decode.choose(*arrays(queries=3)) == "ops"
    assert not decode.worth_sharing(64, 16384)  # auto's gate stays CUDA's: nothing measured on Metal


@NEEDS_NO_METAL
def test_a_kernel_that_does_not_build_keeps_the_plain_path_and_says_why(unchecked, monkeypatch):
    """The backend predicate says Metal; the real kernel's launch raises here (no Metal back-end):
    no path is enabled, the check is not repeated, and /stats' kernel status says why."""
    monkeypatch.setattr(metal_decode_kernel, "on_metal", lambda: True)
    assert decode.enable() is False and not decode.is_enabled()
    status = decode.kernel_status()
    assert status["paths"] == [] and "the Metal decode kernel did not run" in status["declined"]
    assert "No Metal back-end" in status["declined"]
    q, pk, pv, tk, tv, starts, scale = metal_decode_kernel.check_inputs(mx.float32)
    assert decode.choose(q, pk, tk, tv) == "ops"
    want = shared_prefix_attention(q, pk, pv, tk, tv, starts, scale)
    assert mx.array_equal(decode.attention(q, pk, pv, tk, tv, starts, scale), want)
    assert decode.enable() is False and decode.kernel_status() == status  # checked once


def test_the_environment_keeps_the_plain_path_without_a_check(unchecked, monkeypatch):
    monkeypatch.setattr(metal_decode_kernel, "on_metal", lambda: True)
    monkeypatch.setenv("MLXQ_METAL_ATTENTION", "mlx")
    assert decode.enable() is False
    assert decode.kernel_status() == {"paths": [], "declined": "MLXQ_METAL_ATTENTION=mlx", "check": None}


def test_a_disagreement_is_named_by_dtype():
    """The start-up check's verdict: each dtype below its bound, a NaN never passes."""
    fine = {"mlx.core.float32": 3e-7, "mlx.core.float16": 1e-3, "mlx.core.bfloat16": 8e-3}
    assert metal_decode_kernel.disagreeing(fine) == {}
    bad = fine | {"mlx.core.float32": 2e-3, "mlx.core.bfloat16": float("nan")}
    assert set(metal_decode_kernel.disagreeing(bad)) == {"mlx.core.float32", "mlx.core.bfloat16"}
    assert set(map(str, metal_decode_kernel.BOUNDS)) == set(fine)  # the check's names for its dtypes


def test_auto_on_metal_says_it_was_not_measured(monkeypatch):
    from mlxq.engine.engine import _auto_declines_off_cuda

    if not ON_METAL:
        assert _auto_declines_off_cuda() == "auto: sharing measured no gain on this backend (CPU)"
    monkeypatch.setattr(metal_decode_kernel, "on_metal", lambda: True)
    assert _auto_declines_off_cuda().startswith("auto: not measured on Metal")


TINY_SHAPES = sorted({(s.heads, s.kv_heads, s.head_dim) for s in SIZES.values()})


@NEEDS_METAL
@pytest.mark.parametrize("heads, kv_heads, dim", TINY_SHAPES)
@pytest.mark.parametrize("dtype, bound", [(mx.float32, 1e-5), (mx.bfloat16, 2e-2)])
def test_the_kernel_equals_the_plain_path_on_every_tiny_shape(heads, kv_heads, dim, dtype, bound):
    """Each preset's attention shape, with and without sinks and rows outside the group (strided tails,
    left padding, a prefix not a multiple of 32): float32 within 1e-5, bf16 within the CUDA checks' bound."""
    assert metal_decode_kernel.max_error(dtype, heads, kv_heads, dim) < bound
    assert metal_decode_kernel.max_error(dtype, heads, kv_heads, dim, sinks=True, shares=True) < bound
    assert metal_decode_kernel.max_error(dtype, heads, kv_heads, dim, rows=3, prefix=32, own=1) < bound


@NEEDS_METAL
def test_the_start_up_check_passes_and_turns_the_kernel_on(unchecked):
    assert not metal_decode_kernel.disagreeing(metal_decode_kernel.self_check())
    assert decode.enable() is True and decode.kernel_status() == {"paths": ["metal"], "declined": None, "check": None}
    q, pk, _, tk, tv, _, _ = metal_decode_kernel.check_inputs(mx.bfloat16)
    assert decode.choose(q, pk, tk, tv) == "metal"
