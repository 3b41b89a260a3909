"""The CUDA kernels' small inputs (kv/kernel_inputs.py): the values and dtypes they read, one device array
per value across calls (a new one per layer and step would be an upload each time)."""

from __future__ import annotations

import mlx.core as mx

from mlxq.kv.kernel_inputs import int_array, row_shares, row_starts, scale_array, sinks_array


def test_each_value_is_one_array_of_the_dtype_the_kernels_read():
    scale = 128**-0.5
    assert scale_array(scale) is scale_array(scale) and scale_array(scale) is not scale_array(0.125)
    assert scale_array(scale).dtype == mx.float32 and scale_array(scale).tolist() == [mx.array(scale).item()]
    assert int_array(1024) is int_array(1024) and int_array(1024).dtype == mx.int32
    assert int_array(1024).tolist() == [1024]
    assert sinks_array(None) is sinks_array(None) and sinks_array(None).shape == (1,)
    assert row_shares(None, 4) is row_shares(None, 4) and row_shares(None, 4).tolist() == [1, 1, 1, 1]
    assert row_shares(None, 3).shape == (3,)


def test_per_call_inputs_are_converted_contiguous():
    sinks = mx.arange(8, dtype=mx.bfloat16)[::2]  # a strided view: the kernels index it as dense
    got = sinks_array(sinks)
    assert got.dtype == mx.float32 and got.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert row_shares(mx.array([True, False, True]), 3).tolist() == [1, 0, 1]
    assert row_starts(mx.array([0, 5, 2], mx.int64)).dtype == mx.int32
