"""Quantized KV: the serial lane equals mlx-lm's quantized generation; batched rows equal serial rows."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from mlxq.engine.serial import run_serial
from mlxq.engine.types import Request
from mlxq.kv.projection import measure_footprint
from mlxq.kv.quantized import QuantizedRotatingKVCache
from mlxq.kv.scheme import KvSchemeError, head_dims, probe_caches, resolve_scheme
from tests.engine.test_batch_parity import run_schedule, staggered


def scheme_for(model, kv_quant: str, tmp_path=None, group_size: int = 64):
    probe = probe_caches(model)
    return resolve_scheme(kv_quant, group_size, tmp_path, probe, head_dims(probe))


def serial_tokens(model, tokenizer, request: Request, scheme, step: int = 2048, prompt_cache=None) -> list[int]:
    fresh = Request(request.request_id, request.prompt_ids, request.params, request.max_tokens, request.stop)
    return run_serial(model, tokenizer, fresh, lambda e: None, prefill_step_size=step, scheme=scheme,
                      prompt_cache=prompt_cache).tokens


def batched_tokens(model, tokenizer, arrivals, scheme, step: int = 2048) -> tuple[dict, int]:
    return run_schedule(model, tokenizer, arrivals, step_size=step, scheme=scheme)


@pytest.mark.parametrize("bits", ["8", "4"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_serial_lane_equals_mlx_lm_quantized_generation(load_tiny, arch, bits):
    model, tokenizer = load_tiny(arch)
    scheme = scheme_for(model, bits)
    for _, request in staggered(tokenizer):
        if request.params.temperature:  # greedy requests: mlx-lm's default sampler
            continue
        steps = generate_step(mx.array(request.prompt_ids), model, max_tokens=request.max_tokens,
                              kv_bits=int(bits), kv_group_size=64, quantized_kv_start=0, prefill_step_size=16)
        expected = [t for t, _ in steps]
        got = serial_tokens(model, tokenizer, request, scheme, step=16)
        assert got[: len(expected)] == expected[: len(got)] and len(got) > 0, request.request_id


@pytest.mark.parametrize("bits", ["8", "4"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "gemma3_text"])
def test_batched_rows_equal_serial_rows_under_the_same_scheme(load_tiny, arch, bits):
    model, tokenizer = load_tiny(arch)
    scheme = scheme_for(model, bits)
    arrivals = staggered(tokenizer)
    batched, widest = batched_tokens(model, tokenizer, arrivals, scheme, step=16)
    assert widest >= 3
    for _, request in arrivals:
        assert batched[request.request_id] == serial_tokens(model, tokenizer, request, scheme, 16), \
            request.request_id


def test_quantization_changes_the_cache_and_usually_the_tokens(load_tiny):
    model, tokenizer = load_tiny("llama")
    request = staggered(tokenizer)[0][1]
    native = serial_tokens(model, tokenizer, request, scheme_for(model, "off"))
    two_bit = serial_tokens(model, tokenizer, request, scheme_for(model, "2"))
    assert native != two_bit  # 2-bit KV on a random model: if nothing changed, nothing was quantized
    probe = probe_caches(model)
    scheme_for(model, "8").convert(probe)
    assert all(type(c) is QuantizedKVCache for c in probe)


def test_sliding_window_layers_quantize_on_the_serial_lane_past_the_window(load_tiny):
    model, tokenizer = load_tiny("gemma3_text")
    scheme = scheme_for(model, "8")
    probe = probe_caches(model)
    scheme.convert(probe)
    assert {type(c) for c in probe} == {QuantizedKVCache, QuantizedRotatingKVCache}
    for _, request in staggered(tokenizer)[:3]:
        for step in (16, 5, 2048):  # chunked prefill crossing the 16-token window in several ways
            tokens = serial_tokens(model, tokenizer, request, scheme, step)
            assert len(tokens) == request.max_tokens or tokens, request.request_id
    # 8-bit KV stays close to native: the first tokens of a greedy run agree.
    request = staggered(tokenizer)[0][1]
    assert serial_tokens(model, tokenizer, request, scheme)[:4] == \
        serial_tokens(model, tokenizer, request, scheme_for(model, "off"))[:4]


def test_bad_schemes_fail_at_resolution_naming_the_layer(load_tiny, tmp_path):
    model, _ = load_tiny("llama")
    probe = probe_caches(model)
    with pytest.raises(KvSchemeError, match="layer 0: --kv-group-size 128 does not divide its head_dim 64"):
        resolve_scheme("8", 128, tmp_path, probe, head_dims(probe))
    with pytest.raises(KvSchemeError, match="kv_config.json"):
        resolve_scheme("config", 64, tmp_path, probe, head_dims(probe))
    (tmp_path / "kv_config.json").write_text(json.dumps({"bits": [8]}))
    with pytest.raises(KvSchemeError, match="lists 1 layers; the model has 4"):
        resolve_scheme("config", 64, tmp_path, probe, head_dims(probe))
    (tmp_path / "kv_config.json").write_text(json.dumps({"bits": [8, 4, None, 7]}))
    with pytest.raises(KvSchemeError, match="layer 3: 7-bit"):
        resolve_scheme("config", 64, tmp_path, probe, head_dims(probe))


def test_per_layer_config_mixes_bits_and_full_precision(load_tiny, tmp_path):
    model, tokenizer = load_tiny("llama")
    (tmp_path / "kv_config.json").write_text(json.dumps({"bits": [8, 4, None, 8]}))
    probe = probe_caches(model)
    scheme = resolve_scheme("config", 64, tmp_path, probe, head_dims(probe))
    assert scheme.key.startswith("config-") and scheme.layer_bits == (8, 4, None, 8)
    scheme.convert(probe)
    assert [type(c).__name__ for c in probe] == ["QuantizedKVCache", "QuantizedKVCache", "KVCache",
                                                  "QuantizedKVCache"]
    assert [getattr(c, "bits", None) for c in probe] == [8, 4, None, 8]
    arrivals = staggered(tokenizer)
    batched, _ = batched_tokens(model, tokenizer, arrivals, scheme, step=16)
    for _, request in arrivals:
        assert batched[request.request_id] == serial_tokens(model, tokenizer, request, scheme, 16), \
            request.request_id


def test_kv_bytes_per_token_shrink_with_bits(load_tiny):
    model, _ = load_tiny("llama")
    per_token = {q: sum(layer.bytes_per_token for layer in measure_footprint(model, 2048,
                                                                            scheme_for(model, q)).layers)
                 for q in ("off", "8", "4")}
    # float32 KV, head_dim 64, group 64: 8-bit = 64 + 2*4 bytes per 64 values (vs 256); 4-bit = 32 + 8.
    assert per_token["off"] / per_token["8"] == pytest.approx(256 / 72)
    assert per_token["off"] / per_token["4"] == pytest.approx(256 / 40)
